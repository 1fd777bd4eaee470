"""The engine's handle on a model: the normalized ModelProto plus where its weights live."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.errors import ModelLoadError

# opset 21 is the newest every maintained runtime executes (onnxruntime >= 1.18, its
# last training release 1.19.2 included); IR 10 is the matching IR version.
TARGET_OPSET = 21
TARGET_IR_VERSION = 10


@dataclass
class Model:
    proto: onnx.ModelProto
    base_dir: str | None = None  # directory that external tensor data is relative to
    source: str = "<in-memory model>"  # named in error messages
    normalized: bool = False  # load_model has run on it: loading it again is a no-op
    derived: set[str] = field(default_factory=set)  # initializers made by folding, not the user's weights
    batch_axes: dict[str, int] = field(default_factory=dict)  # graph inputs whose batch is not axis 0 (time-major)
    _arrays: dict[str, np.ndarray] | None = field(default=None, repr=False)

    @property
    def graph(self) -> onnx.GraphProto:
        return self.proto.graph

    @property
    def opset(self) -> int:
        return default_opset(self.proto)

    def initializer_arrays(self) -> dict[str, np.ndarray]:
        """Name -> array of every initializer; external data is memory-mapped, not copied."""
        if self._arrays is None:
            self._arrays = {t.name: tensor_to_array(t, self.base_dir, self.source) for t in self.graph.initializer}
        return self._arrays

    def forget_arrays(self) -> None:
        """Drop the cached arrays after the proto's initializers changed."""
        self._arrays = None


def default_opset(proto: onnx.ModelProto) -> int:
    for imp in proto.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return imp.version
    return 1


def tensor_to_array(tensor: onnx.TensorProto, base_dir: str | None, source: str) -> np.ndarray:
    """A TensorProto as numpy; external data is mapped read-only so big models load once."""
    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    path = os.path.join(base_dir or "", location)
    if not location or os.path.isabs(location) or ".." in location.split("/"):
        raise ModelLoadError(f"{source}: initializer {tensor.name!r} has an unsafe external data location {location!r}")
    if not os.path.exists(path):
        raise ModelLoadError(
            f"{source}: external data file {path!r} of initializer {tensor.name!r} is missing; "
            "keep the data file next to the model"
        )
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
    shape = tuple(tensor.dims)
    count = int(np.prod(shape, dtype=np.int64))
    offset = int(info.get("offset", 0))
    if count * dtype.itemsize + offset > os.path.getsize(path):
        raise ModelLoadError(f"{source}: external data file {path!r} is too short for initializer {tensor.name!r}")
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
