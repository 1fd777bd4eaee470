"""Equivalent formulations of a 2-D matrix product, and the rule that picks one per shape.

OpenBLAS runs some shapes and operand layouts several times slower than others, and which
ones depends on the CPU (its kernels are picked by core type): on an AVX2 EPYC a batch of 64
rows times a row-major [784, 256] weight ran at 11 GFLOP/s where the same numbers with 800
inputs ran at 33; on this AVX-512 Zen 4 (and under OpenBLAS's Haswell kernels on it) a
column-major (transposed-view) [784, 256] weight at 16 rows runs at 15-20 GFLOP/s against
70-84 row-major. So the product ``A @ B`` (A [M, K], B [K, N], either a transposed view) may
be computed as

- ``direct``: ``np.matmul(A, B)``, BLAS reading transposed views through its flags;
- ``swapped``: ``(B^T @ A^T)^T``, copied to row-major (the caller gets C order either way);
- ``packed``: ``np.matmul`` on row-major copies of the operands that are not row-major;
- ``columns32``, ``columns64``: B's columns in blocks of that many, one product each into its
  slice of the result. Why: OpenBLAS's AVX-512 build multiplies small products without packing
  its operands, and a few rows times a wide weight is small only in blocks: on this Zen 4, 16
  rows times a [784, 256] weight take 88 us whole and 62 us in 64-column blocks (the weight
  gradient [784, 16] @ [16, 256]: 78 against 67 us), while at 64 rows the blocks are slower.

All three are the same sums; they may round differently in the last bits (OpenBLAS's kernels
block and vectorize each call differently), so the choice is made once per (shape, layouts,
dtype) and never changes afterwards: each plan node keeps what it chose (``ProductRecord``),
within a process every node meeting the same key gets the same choice (a write-once table),
and a calibrated choice is recorded in a small JSON file per machine (``ODT_CACHE_DIR``, else
``$XDG_CACHE_HOME/odt``, else ``~/.cache/odt``; one file per CPU model, numpy and BLAS build and
thread count), so later processes on that machine adopt it instead of timing again: two runs of
the same plan, in one process or in two, are bit-identical. Where the cache cannot be written
(a read-only home) the choice holds for the process only.

The rule (environment ``ODT_GEMM``): ``calibrate`` times the formulations on the first
operands of each key (best of a few runs each, a few milliseconds per key, only for products
of at least ``CALIBRATE_MIN_FLOP``) and keeps the fastest if it beats ``direct`` by
``MARGIN``; ``direct``, ``swapped`` or ``packed`` force one (tests, measurements). The default
is ``calibrate``, except when ``OPENBLAS_CORETYPE`` pins OpenBLAS's kernels (the pipeline does
that so every machine computes the same bytes): a timing-based choice would differ between
machines and runs, so then it is ``direct``.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from odt_ops.errors import ArgumentError
from odt_ops.io import atomic_write_bytes
from odt_ops.kernels import parallel

COLUMN_BLOCKS = {"columns32": 32, "columns64": 64}
FORMULATIONS = ("direct", "swapped", "packed", *COLUMN_BLOCKS)
RULES = ("calibrate", *FORMULATIONS)
CALIBRATE_MIN_FLOP = 2_000_000  # below ~0.05 ms a product's choice cannot pay for its timing noise
MARGIN = 0.9  # another formulation must take under 90% of direct's time to be chosen
_REPEATS = 3

Key = tuple  # (M, K, N, layout of A, layout of B, dtype name)


def _layout(X: np.ndarray) -> str:
    return "C" if X.flags.c_contiguous else "F" if X.flags.f_contiguous else "S"


def compute(A: np.ndarray, B: np.ndarray, how: str) -> np.ndarray:
    """``A @ B`` for 2-D operands, as the formulation ``how``; a row-major result."""
    if how == "swapped":
        return np.ascontiguousarray(np.matmul(B.T, A.T).T)
    if how == "packed":
        return np.matmul(np.ascontiguousarray(A), np.ascontiguousarray(B))
    if how in COLUMN_BLOCKS:
        return _column_blocks(A, B, np.empty((A.shape[0], B.shape[1]), dtype=np.result_type(A, B)), COLUMN_BLOCKS[how])
    return np.matmul(A, B)


def compute_into(A: np.ndarray, B: np.ndarray, how: str, out: np.ndarray) -> None:
    """``A @ B`` as the formulation ``how``, written into ``out`` (A @ B's shape and dtype): the
    same bits as ``compute``."""
    if how == "direct":
        np.matmul(A, B, out=out)
    elif how in COLUMN_BLOCKS:
        _column_blocks(A, B, out, COLUMN_BLOCKS[how])
    else:
        np.copyto(out, compute(A, B, how))


def _column_blocks(A: np.ndarray, B: np.ndarray, C: np.ndarray, width: int) -> np.ndarray:
    for j in range(0, B.shape[1], width):
        np.matmul(A, B[:, j:j + width], out=C[:, j:j + width])
    return C


def rule() -> str:
    """The rule in force (see the module docstring); read when a plan binds its products."""
    value = os.environ.get("ODT_GEMM", "").strip().lower()
    if not value:
        return "direct" if os.environ.get("OPENBLAS_CORETYPE") else "calibrate"
    if value not in RULES:
        raise ArgumentError(f"ODT_GEMM={value!r}: expected one of {', '.join(RULES)} (unset: calibrate, "
                            "or direct when OPENBLAS_CORETYPE pins OpenBLAS's kernels)")
    return value


def _best_ms(fn: Callable[[], object]) -> float:
    fn()  # the first call pays for page faults and BLAS's buffers
    best = float("inf")
    for _ in range(_REPEATS):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def calibrate(A: np.ndarray, B: np.ndarray) -> tuple[str, dict[str, float]]:
    """The formulation to use for operands shaped and laid out as A and B, with each candidate's
    best time in ms (timed on A and B themselves: the kernels never write their inputs)."""
    candidates = ["direct", "swapped"] + (["packed"] if not (A.flags.c_contiguous and B.flags.c_contiguous) else [])
    candidates += [how for how, width in COLUMN_BLOCKS.items() if B.shape[1] > width]
    times = {how: _best_ms(functools.partial(compute, A, B, how)) for how in candidates}
    fastest = min(times, key=times.__getitem__)
    return (fastest if times[fastest] < MARGIN * times["direct"] else "direct"), times


# key -> (formulation, the times that chose it): written once per key for the whole process
_DECIDED: dict[Key, tuple[str, dict[str, float]]] = {}
_RECORDED: list = []  # [the machine's recorded choices {key text: formulation}], read once


def _machine() -> str:
    """What a choice depends on besides the shapes: the CPU, numpy, its BLAS and its threads, and
    the candidates (a record made before a formulation existed never timed it)."""
    return (f"{parallel.cpu_name()}|numpy {np.__version__}|{parallel.blas_description()}|threads {parallel.blas_threads()}"
            f"|formulations {' '.join(FORMULATIONS)}")


def cache_file() -> Path:
    """This machine's record of calibrated choices."""
    root = os.environ.get("ODT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "odt")
    digest = hashlib.sha256(_machine().encode()).hexdigest()[:16]
    return Path(root) / f"gemm-{digest}.json"


def _key_text(key: Key) -> str:
    return ",".join(map(str, key))


def _read_recorded(path: Path) -> dict[str, str]:
    """The recorded choices; a missing, unreadable or foreign file records nothing (it is only a
    cache: the products are recalibrated and the file rewritten)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return {}
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, dict):
        return {}
    return {k: v for k, v in choices.items() if isinstance(k, str) and v in FORMULATIONS}


def _recorded() -> dict[str, str]:
    if not _RECORDED:
        _RECORDED.append(_read_recorded(cache_file()))
    return _RECORDED[0]


def _record(key: Key, how: str) -> None:
    path = cache_file()
    choices = _read_recorded(path)  # another process may have recorded keys since this one read
    if choices.get(_key_text(key)) == how:
        return
    choices[_key_text(key)] = how
    with contextlib.suppress(OSError):  # a read-only cache: the choice holds for this process only
        atomic_write_bytes(path, json.dumps({"machine": _machine(), "choices": choices}, indent=1).encode())
    _recorded().update(choices)


def decide(A: np.ndarray, B: np.ndarray, how: str) -> str:
    """The process's one choice for A and B's key under the rule ``how``."""
    if how != "calibrate":
        return how
    M, K = A.shape
    N = B.shape[1]
    if A.dtype != B.dtype or A.dtype not in (np.float32, np.float64) or 2 * M * K * N < CALIBRATE_MIN_FLOP:
        return "direct"
    key = (M, K, N, _layout(A), _layout(B), A.dtype.name)
    if key not in _DECIDED:
        recorded = _recorded().get(_key_text(key))
        if recorded is not None:
            _DECIDED[key] = (recorded, {})
        else:
            _DECIDED[key] = calibrate(A, B)
            _record(key, _DECIDED[key][0])
    return _DECIDED[key][0]


class ProductRecord:
    """One plan node's choices: {(M, K, N, layouts, dtype): formulation}, each made on the first
    product of that key and kept for the life of the plan."""

    __slots__ = ("how", "chosen")

    def __init__(self, how: str | None = None):
        self.how = rule() if how is None else how
        self.chosen: dict[Key, str] = {}

    def __call__(self, A: np.ndarray, B: np.ndarray) -> np.ndarray:
        return compute(A, B, self.choose(A, B))

    def choose(self, A: np.ndarray, B: np.ndarray) -> str:
        """The formulation for 2-D A and B: this node's first choice for their key."""
        key = (*A.shape, B.shape[1], A.strides, B.strides, A.dtype.str, B.dtype.str)
        how = self.chosen.get(key)
        if how is None:
            how = self.chosen[key] = decide(A, B, self.how)
        return how

    def describe(self) -> list[str]:
        """One line per key: 'MxK @ KxN (layouts, dtype): formulation'."""
        return [f"{m}x{k} @ {k}x{n} {_strides_layout(sa)}{_strides_layout(sb)} {np.dtype(da).name}: {how}"
                for (m, k, n, sa, sb, da, _db), how in self.chosen.items()]


def _strides_layout(strides: tuple[int, int]) -> str:
    return "T" if strides[0] < strides[1] else "N"  # a transposed view steps along rows fastest


def multiply(A: np.ndarray, B: np.ndarray, record: ProductRecord | None) -> np.ndarray:
    """``A @ B`` through ``record`` when both are 2-D, else numpy's matmul (batches, vectors).

    A stack of matrices times one matrix ([..., M, K] @ [K, N], B's leading axes all 1: a linear
    layer on a sequence) is one [(...)*M, K] @ [K, N] product: numpy's matmul makes one BLAS
    call per matrix of the stack, each too small for BLAS's threads (a transformer's [64, 16,
    128] @ [128, 512]: 2.1 ms as 64 calls, 1.4 ms as one at one thread, 0.7 ms at two, AMD EPYC
    Zen 4). The rows are the same dot products either way."""
    if A.ndim > 2 and B.ndim >= 2 and A.ndim >= B.ndim and all(d == 1 for d in B.shape[:-2]):
        rows = A.reshape(math.prod(A.shape[:-1]), A.shape[-1])
        product = np.matmul(rows, B.reshape(B.shape[-2:])) if record is None else record(rows, B.reshape(B.shape[-2:]))
        return product.reshape(*A.shape[:-1], B.shape[-1])
    if record is None or A.ndim != 2 or B.ndim != 2:
        return np.matmul(A, B)
    return record(A, B)
