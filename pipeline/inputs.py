"""What a training stage reads, checked before any work: generate's artifacts (present, and their
digests as written), prepare's splits (dtypes, lengths) and whether the samples fit the model;
and the labels as the artifacts' label input takes them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from odt_ops import meta
from pipeline.errors import DataError
from pipeline.io import load_npz, verify_digest
from pipeline.paths import Artifacts, Paths


def generated(paths: Paths) -> Artifacts:
    """generate's artifacts, once every one a training stage needs is there."""
    gen = paths.artifacts
    for path in gen.required():
        if not path.is_file():
            raise DataError(f"{paths.show(path)}: generate's artifact not found; run the pipeline from the start (dvc repro)")
        verify_digest(path, paths.show(path))
    return gen


def upstream(path: Path, stage: str, paths: Paths) -> Path:
    """``path``, an output of ``stage`` this stage reads: there, and with the sha256 ``stage``
    recorded when it wrote it (its folder's SHA256SUMS); a DataError naming the file otherwise."""
    if not path.is_file():
        raise DataError(f"{paths.show(path)}: {stage}'s output not found; run the pipeline from the start (dvc repro)")
    verify_digest(path, paths.show(path))
    return path


def model_proto(path: Path, paths: Paths) -> onnx.ModelProto:
    """An ONNX file's protobuf, weights left outside; a truncated or garbage file is a
    DataError naming it (protobuf's DecodeError otherwise escapes as a traceback)."""
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(str(path), load_external_data=False)
    except (DecodeError, OSError, ValueError, RuntimeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(f"{paths.show(path)}: not a readable ONNX model ({reason}); rerun the stage that writes it "
                        "(dvc repro -f), or check the file you pointed at") from None



@dataclass(frozen=True)
class Split:
    name: str
    path: Path
    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def load_split(paths: Paths, name: str) -> Split:
    path = paths.split(name)
    verify_digest(path, paths.show(path))
    arrays = load_npz(path, ("x", "y"), what="prepare output")
    x, y = arrays["x"], arrays["y"]
    if x.dtype != np.float32 or y.dtype.kind not in "iu" or len(x) != len(y):
        raise DataError(f"{paths.show(path)}: expected x float32 [N, ...] and integer y [N], got x {x.dtype}{list(x.shape)}, "
                        f"y {y.dtype}{list(y.shape)}; rerun prepare (dvc repro)")
    return Split(name, path, x, y.astype(np.int64))


def check_fits(split: Split, model_path: Path, paths: Paths) -> None:
    """The split's samples have the shape the model's first input takes; names both files."""
    proto = model_proto(model_path, paths)
    inits = {t.name for t in proto.graph.initializer}
    spec = next(i for i in proto.graph.input if i.name not in inits)
    dims = [d.dim_value if d.HasField("dim_value") else None for d in spec.type.tensor_type.shape.dim]
    got = list(split.x.shape[1:])
    if len(dims) != len(got) + 1 or any(d is not None and d != g for d, g in zip(dims[1:], got)):
        shown = "[" + ", ".join("batch" if i == 0 else ("?" if d is None else str(d)) for i, d in enumerate(dims)) + "]"
        raise DataError(
            f"{paths.show(split.path)}: samples of shape {got} do not fit the input {spec.name!r} {shown} of "
            f"{paths.show(model_path)}; set data.input_shape to the model's input and rerun prepare, or choose a model for this data"
        )


def target_encoder(model_path: Path, paths: Paths | None = None) -> Callable[[np.ndarray], np.ndarray]:
    """Labels as the artifacts' label input takes them: class ids (cross-entropy) or
    one-hot float rows (mse, l1, bce_with_logits), read from the model's metadata."""
    proto = model_proto(model_path, paths or Paths.default())
    info = meta.read(proto, str(model_path))
    (label,) = info.labels
    value = next(i for i in proto.graph.input if i.name == label)
    elem = value.type.tensor_type.elem_type
    if elem == onnx.TensorProto.INT64:
        return lambda y: np.ascontiguousarray(y, dtype=np.int64)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(elem)
    width = value.type.tensor_type.shape.dim[-1].dim_value

    def one_hot(y: np.ndarray) -> np.ndarray:
        out = np.zeros((len(y), width), dtype=dtype)
        out[np.arange(len(y)), y] = 1
        return out

    return one_hot
