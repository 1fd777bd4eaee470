"""ONNX attributes as the plain Python values kernels take as keyword arguments."""
from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

AT = onnx.AttributeProto


def attribute_value(attr: onnx.AttributeProto) -> Any:
    """Decode one attribute: strings to str, tensors to numpy, lists to lists."""
    if attr.type == AT.FLOAT:
        return float(attr.f)
    if attr.type == AT.INT:
        return int(attr.i)
    if attr.type == AT.STRING:
        return attr.s.decode("utf-8")
    if attr.type == AT.TENSOR:
        return numpy_helper.to_array(attr.t)
    if attr.type == AT.FLOATS:
        return [float(v) for v in attr.floats]
    if attr.type == AT.INTS:
        return [int(v) for v in attr.ints]
    if attr.type == AT.STRINGS:
        return [s.decode("utf-8") for s in attr.strings]
    if attr.type == AT.TENSORS:
        return [numpy_helper.to_array(t) for t in attr.tensors]
    if attr.type == AT.SPARSE_TENSOR:
        return sparse_to_dense(attr.sparse_tensor)
    return onnx.helper.get_attribute_value(attr)


def sparse_to_dense(sparse: onnx.SparseTensorProto) -> np.ndarray:
    """A SparseTensorProto as a dense array (indices are flat, or one coordinate row per value)."""
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(tuple(sparse.dims), dtype=values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return dense


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: attribute_value(a) for a in node.attribute}
