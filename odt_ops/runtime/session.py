"""InferenceSession: run a (normalized) forward model, with onnxruntime's calling convention."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from odt_ops.domain import opset_versions
from odt_ops.errors import InputError, ModelCheckError
from odt_ops.ir.load import ModelSource, load_model
from odt_ops.ir.model import Model
from odt_ops.runtime.plan import Plan


@dataclass(frozen=True)
class ValueSpec:
    """Name, dtype and shape of a graph input or output (None or str for symbolic dims)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    source: str | None = field(default=None, compare=False)  # the model file, named in errors

    @classmethod
    def of(cls, value: onnx.ValueInfoProto, source: str | None = None) -> ValueSpec:
        tt = value.type.tensor_type
        try:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else None
        except (KeyError, ValueError, TypeError):
            raise ModelCheckError(f"{source or 'model'}: value {value.name!r} has element type {tt.elem_type}, which is "
                                  "not an ONNX tensor type") from None
        shape = None
        if tt.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tt.shape.dim)
        return cls(value.name, dtype, shape, source)

    @property
    def _where(self) -> str:  # a file's path; "<bytes>" and "<in-memory model>" add nothing
        return f"{self.source}: " if self.source and not self.source.startswith("<") else ""

    def check(self, value: object) -> np.ndarray:
        """The feed as an array, or InputError naming the input and what was expected."""
        if not isinstance(value, np.ndarray):
            value = np.asarray(value)
        if self.dtype == np.dtype(object) and value.dtype.kind in "US":
            value = value.astype(object)  # ONNX strings are Python str objects; onnxruntime takes numpy's str arrays too
        if self.dtype is not None and value.dtype != self.dtype:
            raise InputError(f"{self._where}input {self.name!r}: expected dtype {self.dtype}, got {value.dtype}; cast it with .astype(np.{self.dtype})")
        if self.shape is not None:
            if value.ndim != len(self.shape):
                raise InputError(f"{self._where}input {self.name!r}: expected shape {_fmt(self.shape)} (rank {len(self.shape)}), got {tuple(value.shape)}")
            for want, got in zip(self.shape, value.shape):
                if isinstance(want, int) and want != got:
                    raise InputError(f"{self._where}input {self.name!r}: expected shape {_fmt(self.shape)}, got {tuple(value.shape)}")
        return value


def _fmt(shape: Sequence[object]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _owned(result: np.ndarray) -> np.ndarray:
    """Outputs that may be views of a feed or a weight (Identity, Reshape, Expand...) are copied,
    so a caller writing into an output never changes its input or the model."""
    if isinstance(result, np.generic):  # numpy ufuncs turn 0-d results into scalars
        return np.asarray(result)
    if result.base is None and result.flags.writeable:
        return result
    return result.copy()


class InferenceSession:
    """``InferenceSession(model).run(output_names, {input: array})`` as with onnxruntime."""

    def __init__(self, model: ModelSource, *, seed: int = 0, normalize: bool = True):
        self.model: Model = load_model(model) if normalize else load_model(model, target_opset=None, batch_dim=None)
        graph = self.model.graph
        self.inputs = [ValueSpec.of(v, self.model.source) for v in graph.input]
        self.outputs = [ValueSpec.of(v, self.model.source) for v in graph.output]
        opsets = opset_versions(self.model.proto.opset_import)
        self._rng = np.random.default_rng(seed)
        self._plan = Plan(
            graph,
            opsets,
            self.model.initializer_arrays(),
            [v.name for v in self.inputs],
            [v.name for v in self.outputs],
            rng=self._rng,
            source=self.model.source,
        )

    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, object]) -> list[np.ndarray]:
        unknown = set(feeds) - {v.name for v in self.inputs}
        if unknown:
            raise InputError(f"unknown input(s) {sorted(unknown)}; the model's inputs are {self.input_names()}")
        missing = [v.name for v in self.inputs if v.name not in feeds]
        if missing:
            raise InputError(f"missing input(s) {missing}; the model's inputs are {self.input_names()}")
        inputs = [spec.check(feeds[spec.name]) for spec in self.inputs]
        results = [_owned(r) for r in self._plan.run(inputs)]
        if output_names is None:
            return results
        index = {n: i for i, n in enumerate(self.output_names())}
        bad = [n for n in output_names if n not in index]
        if bad:
            raise InputError(f"unknown output(s) {bad}; the model's outputs are {self.output_names()}")
        return [results[index[n]] for n in output_names]
