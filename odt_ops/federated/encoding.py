"""Model differences on the wire: encodings, and the checks a server runs on an update.

A client's update is a model difference (``odt_ops.export.ModelDiff``: trained minus
global, per trainable parameter, with the hash of the base it was computed against).
On the wire it takes one of three encodings:

- ``float32``: the difference exactly (4 bytes a value);
- ``float16``: each value rounded to half precision (2 bytes a value; refused when a
  value overflows half precision's 65504);
- ``int8``: per tensor, a float32 ``scale = max|d| / 127`` and ``q = rint(d / scale)``
  in [-127, 127] (1 byte a value plus 4 bytes a tensor); decoded as ``q * scale``,
  so the error of each value is at most ``scale / 2``.

``decode_diff`` always gives back a float32 ``ModelDiff``, which ``apply_diff`` and
``aggregate`` take. An encoded difference saves to the same kind of tensor file as a
``ModelDiff`` (format ``odt-encoded-diff``); a float32 one is saved as a plain model
difference, which ``odt_ops.export.load_diff`` reads.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from odt_ops.errors import ModelDiffError
from odt_ops.export import ModelDiff, _fingerprint, check_count, diff_header, load_diff, save_diff
from odt_ops.scalars import as_real
from odt_ops.tensorfile import read_tensor_file, write_tensor_file

ENCODINGS = ("float32", "float16", "int8")
ENCODED_FORMAT = "odt-encoded-diff"
ENCODED_VERSION = 1
INT8_LEVELS = 127
SCALE_BYTES = 4  # one float32 per int8 tensor


def fingerprint(params: Mapping[str, np.ndarray], names: Sequence[str] | None = None) -> str:
    """The base hash of ``params`` (names, dtypes, shapes and bytes), as model differences carry it."""
    return _fingerprint(params, list(params) if names is None else list(names))


def check_encoding(encoding: str) -> str:
    if encoding not in ENCODINGS:
        raise ModelDiffError(f"unknown diff encoding {encoding!r}; the encodings are {', '.join(ENCODINGS)}")
    return encoding


@dataclass
class EncodedDiff:
    """A model difference as sent: ``tensors`` in the encoding's dtype, ``scales`` per
    tensor for int8, and what a server needs to weigh and place it."""

    encoding: str
    tensors: dict[str, np.ndarray]
    base_hash: str
    scales: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0
    num_steps: int = 0
    metadata: dict[str, int | float | str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Payload bytes: the encoded values plus the int8 scales (no container overhead)."""
        return int(sum(t.nbytes for t in self.tensors.values()) + SCALE_BYTES * len(self.scales))


def encode_diff(diff: ModelDiff, encoding: str = "float32") -> EncodedDiff:
    """``diff`` in ``encoding`` (see the module docstring)."""
    check_encoding(encoding)
    _check_finite(diff.deltas, "model difference")
    num_examples = check_count(diff.num_examples, "num_examples", "encode_diff: the model difference")
    num_steps = check_count(diff.num_steps, "num_steps", "encode_diff: the model difference")
    tensors: dict[str, np.ndarray] = {}
    scales: dict[str, float] = {}
    for name, delta in diff.deltas.items():
        d = np.asarray(delta, dtype=np.float32)
        if encoding == "float32":
            tensors[name] = np.array(d)
        elif encoding == "float16":
            with np.errstate(over="ignore"):
                h = d.astype(np.float16)
            if not np.all(np.isfinite(h)):
                raise ModelDiffError(f"{name}: the difference reaches {float(np.abs(d).max()):g}, beyond float16's range (65504); "
                                     "send it as float32 or int8")
            tensors[name] = h
        else:
            peak = np.float32(np.abs(d).max()) if d.size else np.float32(0)
            scale = np.float32(peak / np.float32(INT8_LEVELS))
            if scale > 0:
                q = np.clip(np.rint(d / scale), -INT8_LEVELS, INT8_LEVELS).astype(np.int8)
            else:
                q = np.zeros(d.shape, np.int8)
            tensors[name] = q
            scales[name] = float(scale)
    return EncodedDiff(encoding, tensors, diff.base_hash, scales, num_examples, num_steps, dict(diff.metadata))


def decode_diff(encoded: EncodedDiff) -> ModelDiff:
    """The float32 ``ModelDiff`` an encoded one stands for (its counts checked: whole numbers in [0, 2**53])."""
    check_encoding(encoded.encoding)
    num_examples = check_count(encoded.num_examples, "num_examples", "decode_diff: the encoded difference")
    num_steps = check_count(encoded.num_steps, "num_steps", "decode_diff: the encoded difference")
    deltas: dict[str, np.ndarray] = {}
    for name, t in encoded.tensors.items():
        t = np.asarray(t)
        if encoded.encoding == "int8":
            if t.dtype != np.int8:
                raise ModelDiffError(f"{name}: an int8-encoded tensor holds {t.dtype}")
            if name not in encoded.scales:
                raise ModelDiffError(f"{name}: an int8-encoded tensor has no scale")
            scale = np.float32(encoded.scales[name])
            if not np.isfinite(scale) or scale < 0:
                raise ModelDiffError(f"{name}: the int8 scale {float(scale)!r} is not a finite number >= 0")
            deltas[name] = t.astype(np.float32) * scale
        else:
            want = np.float32 if encoded.encoding == "float32" else np.float16
            if t.dtype != want:
                raise ModelDiffError(f"{name}: a {encoded.encoding}-encoded tensor holds {t.dtype}")
            deltas[name] = t.astype(np.float32)
    _check_finite(deltas, "decoded model difference")
    return ModelDiff(deltas, encoded.base_hash, num_examples, num_steps, dict(encoded.metadata))


def encoding_error(diff: ModelDiff, encoded: EncodedDiff) -> float:
    """Relative L2 error of the decoded difference against the exact one (0 for float32)."""
    decoded = decode_diff(encoded).deltas
    num = sum(float(np.sum((decoded[n].astype(np.float64) - np.asarray(d, np.float64)) ** 2)) for n, d in diff.deltas.items())
    den = sum(float(np.sum(np.asarray(d, np.float64) ** 2)) for d in diff.deltas.values())
    return float(np.sqrt(num / den)) if den > 0 else 0.0


def save_encoded(encoded: EncodedDiff, path: str | os.PathLike) -> None:
    """Write an encoded difference atomically (a float32 one as a plain model difference)."""
    if encoded.encoding == "float32":
        save_diff(decode_diff(encoded), path)
        return
    check_encoding(encoded.encoding)
    for key in ("num_examples", "num_steps"):  # load_encoded would refuse the file
        check_count(getattr(encoded, key), key, f"{path}: the encoded difference")
    header = {"encoding": encoded.encoding, "base_hash": encoded.base_hash, "num_examples": encoded.num_examples,
              "num_steps": encoded.num_steps, "metadata": encoded.metadata}
    tensors = [({"name": n, **({"scale": encoded.scales[n]} if n in encoded.scales else {})}, t) for n, t in encoded.tensors.items()]
    write_tensor_file(path, ENCODED_FORMAT, ENCODED_VERSION, header, tensors, ModelDiffError)


def load_encoded(path: str | os.PathLike) -> EncodedDiff:
    """Read what ``save_encoded`` wrote (a plain model difference reads as float32)."""
    try:
        manifest, tensors = read_tensor_file(path, ENCODED_FORMAT, ENCODED_VERSION, ModelDiffError, "encoded model difference")
    except ModelDiffError as exc:
        if "(format " not in str(exc):  # another kind of file: maybe a plain model difference
            raise
        d = load_diff(path)
        return EncodedDiff("float32", {n: np.asarray(a, np.float32) for n, a in d.deltas.items()}, d.base_hash,
                           num_examples=d.num_examples, num_steps=d.num_steps, metadata=d.metadata)
    encoding = manifest.get("encoding")
    if encoding not in ENCODINGS:
        raise ModelDiffError(f"{path}: unknown encoding {encoding!r}; the file is damaged")
    base_hash, num_examples, num_steps, metadata = diff_header(manifest, path)
    arrays = {e["name"]: np.array(a) for e, a in tensors}
    read = {e["name"]: as_real(e["scale"]) for e, _ in tensors if "scale" in e}
    bad = [n for n, v in read.items() if v is None or not math.isfinite(v)]
    if bad:
        raise ModelDiffError(f"{path}: the int8 scales of {bad} are not finite numbers; the file is damaged")
    scales = {n: float(v) for n, v in read.items() if v is not None}
    enc = EncodedDiff(encoding, arrays, base_hash, scales, num_examples, num_steps, metadata)
    try:
        decode_diff(enc)  # every tensor of the right dtype, finite, with its scale
    except ModelDiffError as exc:
        raise ModelDiffError(f"{path}: {exc}") from None
    return enc


def clip_update(deltas: Mapping[str, np.ndarray], max_norm: float) -> tuple[dict[str, np.ndarray], float]:
    """The update scaled to an L2 norm (over every tensor together) of at most ``max_norm``,
    and its norm before: DP-FedAvg's flat clipping, done on the client."""
    if not max_norm > 0:
        raise ModelDiffError(f"clipping norm {max_norm!r}: expected a number > 0")
    norm = float(np.sqrt(sum(float(np.sum(np.asarray(d, np.float64) ** 2)) for d in deltas.values())))
    factor = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return {n: (np.asarray(d) * np.float32(factor)).astype(np.asarray(d).dtype) for n, d in deltas.items()}, norm


def check_update(deltas: Mapping[str, np.ndarray], expected: Mapping[str, tuple[tuple[int, ...], np.dtype]], *,
                 base_hash: str | None = None, expected_hash: str | None = None) -> list[str]:
    """Why an update must not be averaged in (empty when it may): parameters missing or
    unknown, wrong shape or dtype, non-finite values, or made from another base."""
    problems: list[str] = []
    if expected_hash is not None and base_hash != expected_hash:
        problems.append(f"made from another base (base hash {str(base_hash)[:12]}..., the round's global model is {expected_hash[:12]}...)")
    missing = [n for n in expected if n not in deltas]
    unknown = [n for n in deltas if n not in expected]
    if missing:
        problems.append(f"missing parameters {missing}")
    if unknown:
        problems.append(f"unknown parameters {unknown}")
    for name, (shape, dtype) in expected.items():
        if name not in deltas:
            continue
        a = np.asarray(deltas[name])
        if tuple(a.shape) != tuple(shape) or a.dtype != np.dtype(dtype):
            problems.append(f"{name}: {a.dtype}{list(a.shape)}, expected {np.dtype(dtype)}{list(shape)}")
        elif not np.all(np.isfinite(a)):
            problems.append(f"{name}: non-finite values (NaN or infinity)")
    return problems


def _check_finite(deltas: Mapping[str, np.ndarray], where: str) -> None:
    bad = [n for n, d in deltas.items() if not np.all(np.isfinite(np.asarray(d)))]
    if bad:
        raise ModelDiffError(f"{where}: {bad} hold NaN or infinite values")


__all__ = ["ENCODINGS", "EncodedDiff", "check_encoding", "check_update", "clip_update", "decode_diff", "encode_diff",
           "encoding_error", "fingerprint", "load_encoded", "save_encoded"]
