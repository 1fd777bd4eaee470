"""The engine's handle on a model: the normalized ModelProto plus where its weights live."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from odt_ops.domain import default_opset
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
        return default_opset(self.proto.opset_import, 1)

    def initializer_arrays(self) -> dict[str, np.ndarray]:
        """Name -> array of every initializer; external data is memory-mapped, not copied."""
        if self._arrays is None:
            self._arrays = {t.name: tensor_to_array(t, self.base_dir, self.source) for t in self.graph.initializer}
        return self._arrays

    def forget_arrays(self) -> None:
        """Drop the cached arrays after the proto's initializers changed."""
        self._arrays = None


def tensor_to_array(tensor: onnx.TensorProto, base_dir: str | None, source: str) -> np.ndarray:
    """A TensorProto as numpy; external data is mapped read-only so big models load once, and
    only from a regular file inside ``base_dir`` (see ``odt_ops.ir.external``)."""
    from odt_ops.ir import external

    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return external.map_external(tensor, base_dir, source)
    external.tensor_dtype(tensor, source)
    try:
        return numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:  # data of another size than its dims say
        raise ModelLoadError(f"{source}: initializer {tensor.name!r} ({list(tensor.dims)}) holds unreadable data: "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from None
