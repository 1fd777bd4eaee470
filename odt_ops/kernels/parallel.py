"""Large elementwise passes split across threads (numpy releases the GIL inside a ufunc loop).

OpenBLAS parallelizes the matrix products; every other pass of a train step (activations,
their gradients) runs on one core. ``elementwise`` makes a unary-style kernel run in chunks
on a small pool of ``workers()`` threads (``ODT_ELEMENTWISE_THREADS``; off unless set, see
``workers``), for arrays of at least ``MIN_ELEMENTS``.

Bit-identical to one thread: each element is computed by the same code from the same
inputs, since the chunks are cut along independent elements at multiples of ``ALIGN``
elements (so numpy's SIMD loops see the same vector/remainder split and alignment as on the
whole array) and each chunk is the kernel run on a contiguous slice.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from odt_ops.errors import ArgumentError

# Measured on 2 Zen 4 cores under load (other processes on both): splitting np.exp/np.tanh over
# 2 threads lost below ~2^18 float32 elements and gained 1.5x on tanh at 2^20; a pool hand-off
# costs ~20-30 us
MIN_ELEMENTS = 1 << 18
ALIGN = 1024  # elements: a multiple of every SIMD width numpy uses, and of a cache line

_lock = threading.Lock()
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (its size, the pool)
_blas: list = []  # [threadpoolctl's controller of numpy's BLAS, or None when there is none], found once


def _blas_controller():
    """threadpoolctl's controller of numpy's BLAS, or None (threadpoolctl cannot read it), found once."""
    if not _blas:
        try:
            from threadpoolctl import ThreadpoolController

            found = ThreadpoolController().select(user_api="blas").lib_controllers
            _blas.append(found[0] if found else None)
        except Exception:  # threadpoolctl unable to read this BLAS
            _blas.append(None)
    return _blas[0]


def blas_threads() -> int:
    """The BLAS thread count in force now (OPENBLAS_NUM_THREADS without threadpoolctl)."""
    blas = _blas_controller()
    if blas is None:
        return max(1, int(os.environ.get("OPENBLAS_NUM_THREADS", "1") or 1))
    return max(1, int(blas.get_num_threads()))


def workers() -> int:
    """Threads for a large elementwise pass: ``ODT_ELEMENTWISE_THREADS`` (a count, or ``blas`` for
    BLAS's own count); unset, 1: the pool is off. Off by default because it never won on 2 Zen 4
    cores at 2 BLAS threads (scripts/elementwise_pool_ab.py, quiet machine): EfficientNet's train
    step at batch 32 took 40.5 ms with it against 38.5 ms without, the small CNN's at batch 64
    4.44 against 4.43 ms. Not because OpenBLAS's idle workers hold the other core: with BLAS at
    one thread (no workers at all) EfficientNet still took 40.4 ms with the pool against 38.3.
    One large ufunc does split well (scripts/thread_handoff.py: np.exp over 786,432 float32 0.36 ms
    on one thread, 0.24-0.25 in two halves, 0.28 when each half makes its own result and is copied
    in, as here), but splitting the step's 28 elementwise kernels of at least 2^18 elements (each
    several ufunc calls, the GIL handed over between them) cost 1.5-4.5 ms a step more in a
    prototype, and a round trip to a waiting thread takes 14-57 us on this machine."""
    value = os.environ.get("ODT_ELEMENTWISE_THREADS", "").strip().lower()
    if not value:
        return 1
    if value == "blas":
        return blas_threads()
    if not value.isdigit() or int(value) < 1:
        raise ArgumentError(f"ODT_ELEMENTWISE_THREADS={value!r}: expected a thread count (1 or more) or 'blas'")
    return int(value)


def cpu_name() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform module says."""
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as lines:
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    return platform.processor() or platform.machine()


def blas_description() -> str:
    """numpy's BLAS as threadpoolctl names it (library, version, kernels' architecture), and the
    core type forced on OpenBLAS: what decides which of its kernels run."""
    blas = _blas_controller()
    name = "unknown BLAS" if blas is None else " ".join(
        str(blas.info().get(field)) for field in ("internal_api", "version", "architecture"))
    return f"{name} {os.environ.get('OPENBLAS_CORETYPE', '')}".strip()


def _executor(threads: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool[0] < threads:
            if _pool is not None:
                _pool[1].shutdown(wait=False)  # its idle threads end; chunks already given to it still finish
            _pool = (threads, ThreadPoolExecutor(max_workers=threads, thread_name_prefix="odt-elementwise"))
        return _pool[1]


def chunks(n: int, parts: int) -> list[slice]:
    """[0, n) cut into at most ``parts`` runs, each starting at a multiple of ALIGN."""
    step = -(-n // parts)
    step = -(-step // ALIGN) * ALIGN
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def elementwise(fn: Callable[..., tuple]) -> Callable[..., tuple]:
    """``fn(X, *others, **attrs) -> (Y,)``, Y elementwise in X and in every other array argument
    of X's shape, run in chunks on ``workers()`` threads when X is large and contiguous; scalars
    and 0-d arrays go to every chunk whole (any other operand: the whole kernel on one thread)."""

    @functools.wraps(fn)
    def run(X, *others, **attrs):
        if not isinstance(X, np.ndarray) or X.size < MIN_ELEMENTS or not X.flags.c_contiguous:
            return fn(X, *others, **attrs)
        threads = workers()
        # every other array must be of X's shape and contiguous (cut like X) or 0-d (whole to each chunk)
        if threads < 2 or any(isinstance(o, np.ndarray) and o.ndim and (o.shape != X.shape or not o.flags.c_contiguous) for o in others):
            return fn(X, *others, **attrs)
        flat = X.reshape(-1)
        split = [o.reshape(-1) if isinstance(o, np.ndarray) and o.shape == X.shape else None for o in others]
        parts = chunks(flat.size, threads)
        out: list[np.ndarray] = []

        def part(s: slice) -> None:
            args = [f[s] if f is not None else o for f, o in zip(split, others)]
            y = fn(flat[s], *args, **attrs)[0]
            with _lock:  # the first chunk to finish learns the result's dtype and makes the result
                if not out:
                    out.append(np.empty(flat.size, dtype=y.dtype))
            out[0][s] = y

        futures = [_executor(threads).submit(part, s) for s in parts[1:]]
        part(parts[0])
        for f in futures:
            f.result()
        return (out[0].reshape(X.shape),)

    return run
