"""External tensor data read from untrusted models: only regular files inside the model's folder.

An ONNX tensor may keep its bytes in another file (``external_data``: ``location``, ``offset``,
``length``). A model from an untrusted source could point that at any file the process can
read: ``../../home/user/.ssh/id_rsa``, ``/etc/shadow``, a symlink placed inside the folder that
leads out of it, a path through a symlinked sub-folder, ``/dev/zero`` (an endless read) or a
FIFO (a read that blocks forever). onnx's own loader has had this class of bug, so the rules
are ours and checked here, on the resolved real path:

- the model must have a folder: a model handed over as bytes or as a ModelProto has none,
  and its relative locations would resolve against the working directory; such a model
  needs an explicit ``base_dir``;
- the location is relative, has no ``..`` part and no NUL, and its real path (every symlink
  resolved) lies inside the real path of the model's folder;
- it is a regular file (not a directory, device, FIFO or socket), checked on the opened file
  descriptor itself, so it cannot be swapped between the check and the read;
- ``offset`` and ``length`` are plain non-negative decimal integers, ``length`` (when given)
  equals the tensor's size, and offset + size lies within the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import onnx

from odt_ops import confined
from odt_ops.errors import ModelLoadError
from odt_ops.tensorfile import checked_shape


@dataclass(frozen=True)
class ExternalRef:
    """Where one tensor's bytes lie: a vetted real path, byte offset and byte count."""

    path: str
    offset: int
    nbytes: int


def tensor_dtype(tensor: onnx.TensorProto, source: str) -> np.dtype:
    """The numpy dtype of a tensor's data type, or ModelLoadError naming the tensor."""
    try:
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    except (KeyError, ValueError, TypeError):
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} has data type {tensor.data_type}, which is not an ONNX "
                             "tensor type; the file is damaged") from None
    return np.dtype(dtype)


def tensor_shape(tensor: onnx.TensorProto, source: str, dtype: np.dtype) -> tuple[int, ...]:
    """The tensor's dims, or ModelLoadError naming it unless numpy can hold them (non-negative, at
    most 32, within 1 TiB of ``dtype`` even when one is 0): checked before anything is mapped or made."""
    if any(d < 0 for d in tensor.dims):
        raise ModelLoadError(f"{source}: tensor {tensor.name!r} has negative dims {list(tensor.dims)}; the file is damaged")
    return checked_shape(tuple(tensor.dims), dtype, ModelLoadError, f"{source}: tensor {tensor.name!r}")


def resolve(tensor: onnx.TensorProto, base_dir: str | None, source: str) -> ExternalRef:
    """Vet ``tensor``'s external data entry against the rules above (the file is not read)."""
    name = tensor.name
    info: dict[str, str] = {}
    for entry in tensor.external_data:
        if entry.key in info:
            raise ModelLoadError(f"{source}: initializer {name!r} lists the external data key {entry.key!r} twice")
        info[entry.key] = entry.value
    location = info.get("location", "")
    if base_dir is None:
        raise ModelLoadError(
            f"{source}: initializer {name!r} keeps its data in the external file {location!r}, and a model given as bytes "
            "or as a ModelProto has no folder to find it in; pass base_dir= (the folder holding the data file) or load "
            "the model from its path")
    real = confined.resolve_inside(base_dir, location, ModelLoadError, f"{source}: external data of initializer {name!r}")
    offset = _count(info.get("offset", "0"), "offset", name, source) or 0  # absent: the file's start
    length = _count(info.get("length"), "length", name, source)
    dtype = tensor_dtype(tensor, source)
    if dtype.hasobject:
        raise ModelLoadError(f"{source}: initializer {name!r} is a string tensor with external data; odt_ops reads "
                             "only numeric external data")
    shape = tensor_shape(tensor, source, dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if length is not None and length != nbytes:
        raise ModelLoadError(f"{source}: external data of initializer {name!r} declares length {length}, its "
                             f"{dtype}{list(shape)} takes {nbytes} bytes; the file is damaged")
    return ExternalRef(real, offset, nbytes)


def _count(text: str | None, key: str, name: str, source: str) -> int | None:
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 19:  # int64 at most, as onnx stores it
        raise ModelLoadError(f"{source}: external data {key} {text[:40]!r} of initializer {name!r} is not a "
                             "non-negative integer; the file is damaged")
    return int(text)


def map_external(tensor: onnx.TensorProto, base_dir: str | None, source: str) -> np.ndarray:
    """The tensor's external bytes, memory-mapped read-only (vetted by ``resolve`` first)."""
    ref = resolve(tensor, base_dir, source)
    dtype = tensor_dtype(tensor, source)
    shape = tensor_shape(tensor, source, dtype)
    with confined.open_regular(ref.path, ModelLoadError, f"{source}: external data of initializer {tensor.name!r}") as f:
        size = os.fstat(f.fileno()).st_size
        if ref.offset + ref.nbytes > size:
            raise ModelLoadError(f"{source}: external data file {ref.path!r} ({size} bytes) is too short for initializer "
                                 f"{tensor.name!r} (bytes {ref.offset}..{ref.offset + ref.nbytes})")
        if ref.nbytes == 0:
            return np.zeros(shape, dtype)
        return np.memmap(f, dtype=dtype, mode="r", offset=ref.offset, shape=shape)


def inline(tensor: onnx.TensorProto, base_dir: str | None, source: str) -> None:
    """Move the tensor's external bytes into it (vetted and read by ``map_external``)."""
    data = np.ascontiguousarray(map_external(tensor, base_dir, source)).tobytes()
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.DEFAULT
    tensor.raw_data = data


def walk_tensors(model: onnx.ModelProto):
    """(tensor, top_level) for every TensorProto in the model: initializers, sparse initializers'
    parts, tensors in node attributes, of the main graph, its subgraphs and functions."""
    def graph_tensors(graph: onnx.GraphProto, top: bool):
        for t in graph.initializer:
            yield t, top
        for s in graph.sparse_initializer:
            yield s.values, False
            yield s.indices, False
        yield from node_tensors(graph.node)

    def node_tensors(nodes):
        for node in nodes:
            for attr in node.attribute:
                if attr.HasField("t"):
                    yield attr.t, False
                yield from ((t, False) for t in attr.tensors)
                if attr.HasField("sparse_tensor"):
                    yield attr.sparse_tensor.values, False
                    yield attr.sparse_tensor.indices, False
                if attr.HasField("g"):
                    yield from graph_tensors(attr.g, False)
                for g in attr.graphs:
                    yield from graph_tensors(g, False)

    yield from graph_tensors(model.graph, True)
    for function in model.functions:
        yield from node_tensors(function.node)
