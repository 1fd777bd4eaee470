"""What handing numpy work to a second Python thread costs on this machine, the figures behind
kernels/parallel.py's default (its pool off):

    OPENBLAS_NUM_THREADS=1 python scripts/thread_handoff.py

prints, as medians over ``--repeats`` runs: one large np.exp on one thread, the same split in two
halves (each written into a result the caller made, and each made by its thread and copied in,
as the pool does), both again when the caller has just written the array (as the node before
does in a train step: the helper's half then comes from the other core's cache); a multiply of
two such arrays with the caches cleared, alone and right after a matrix product (at two BLAS
threads OpenBLAS's idle worker then spins on the second core: run it with
``OPENBLAS_NUM_THREADS=2`` to see that); and the round trip of an empty job to a waiting thread,
straight after the last one and after the thread has waited ``--idle`` ms (as it does between a
step's large nodes).
"""
from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from odt_ops.kernels import parallel


class Helper:
    """One waiting thread that runs the jobs it is given, one at a time."""

    def __init__(self) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._job = lambda: None
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            self._job()
            self._done.release()

    def start(self, job) -> None:
        self._job = job
        self._go.release()

    def join(self) -> None:
        self._done.acquire()


def median_ms(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1000


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs="+", default=[32, 16, 16, 96],
                   help="the array (default: EfficientNet's largest activation at batch 32, channels last)")
    p.add_argument("--repeats", type=int, default=400)
    p.add_argument("--idle", type=float, default=1.0, help="ms the thread waits before a timed round trip")
    args = p.parse_args()
    x = np.random.default_rng(0).standard_normal(args.shape, dtype=np.float32)
    y = np.empty_like(x)
    half = x.shape[0] // 2
    helper = Helper()

    def into_caller_result() -> None:
        helper.start(lambda: np.exp(x[half:], out=y[half:]))
        np.exp(x[:half], out=y[:half])
        helper.join()

    def own_result_copied() -> None:
        result = np.empty_like(x)

        def part(s: slice) -> None:
            result[s] = np.exp(x[s])
        helper.start(lambda: part(slice(half, None)))
        part(slice(0, half))
        helper.join()

    def round_trip() -> None:
        helper.start(lambda: None)
        helper.join()

    print(f"np.exp over {x.size:,} float32 {tuple(args.shape)}, median of {args.repeats} (ms):")
    print(f"  one thread                                  {median_ms(lambda: np.exp(x), args.repeats):.3f}")
    print(f"  two halves into the caller's result         {median_ms(into_caller_result, args.repeats):.3f}")
    print(f"  two halves, each its own result, copied in  {median_ms(own_result_copied, args.repeats):.3f}")

    def rewrite() -> None:  # in a train step the node before has just written the array, on the caller's core
        np.copyto(x, x + 0)

    print(f"  one thread, x just written by the caller    {median_ms(lambda: np.exp(x), args.repeats, before=rewrite):.3f}")
    print(f"  two halves into the caller's result, ditto  {median_ms(into_caller_result, args.repeats, before=rewrite):.3f}")
    # memory-bound: two cold operands (caches cleared), alone and right after a matrix product at
    # BLAS's thread count (OpenBLAS's workers then spin on the other cores for a while)
    other = np.random.default_rng(1).standard_normal(args.shape, dtype=np.float32)
    clear = np.ones(16 << 20, dtype=np.float32)  # 64 MiB, past any cache here
    a, b = np.ones((1024, 512), dtype=np.float32), np.ones((512, 512), dtype=np.float32)

    def split_multiply() -> None:
        helper.start(lambda: np.multiply(x[half:], other[half:], out=y[half:]))
        np.multiply(x[:half], other[:half], out=y[:half])
        helper.join()

    def cold() -> None:
        clear.sum()

    def cold_after_product() -> None:
        clear.sum()
        a @ b

    print(f"np.multiply of two such arrays, caches cleared first (ms; BLAS threads {parallel.blas_threads()}):")
    for name, before in (("", cold), (", after a matrix product", cold_after_product)):
        whole = median_ms(lambda: np.multiply(x, other), args.repeats // 2, before=before)
        print(f"  one thread{name:25s} {whole:.3f}   two halves {median_ms(split_multiply, args.repeats // 2, before=before):.3f}")
    print("round trip of an empty job to the waiting thread (us):")
    print(f"  straight after the last one                 {median_ms(round_trip, args.repeats) * 1000:.1f}")
    pause = args.idle / 1000
    print(f"  after it waited {args.idle:g} ms                       "
          f"{median_ms(round_trip, args.repeats // 4, before=lambda: time.sleep(pause)) * 1000:.1f}")


if __name__ == "__main__":
    main()
