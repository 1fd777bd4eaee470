"""Large elementwise passes split across threads (odt_ops/kernels/parallel.py) give the same
bits as one thread, for every kernel that splits; the pool is off unless ODT_ELEMENTWISE_THREADS
asks for it."""
from __future__ import annotations

import numpy as np
import pytest

from odt_ops.errors import ArgumentError
from odt_ops.kernels import elementwise as ew
from odt_ops.kernels import parallel
from odt_ops.runtime.fusion.graph import bind, fused_node

N = parallel.MIN_ELEMENTS + 3 * parallel.ALIGN + 37  # odd: the last chunk ends in a SIMD remainder
KERNELS = {"Exp": lambda X: ew.exp(X), "Tanh": lambda X: ew.tanh(X), "Sigmoid": lambda X: ew.sigmoid(X),
           "HardSigmoid": lambda X: ew.hard_sigmoid(X, alpha=0.3, beta=0.4), "HardSwish": lambda X: ew.hard_swish(X)}


def _x(dtype=np.float32, shape=(N,)) -> np.ndarray:
    return (np.random.default_rng(0).standard_normal(shape) * 4).astype(dtype)


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op", sorted(KERNELS))
def test_split_kernels_are_bit_identical_to_one_thread(monkeypatch, op, dtype, threads):
    X = _x(dtype, (7, N // 7))
    monkeypatch.setattr(parallel, "workers", lambda: 1)
    (one,) = KERNELS[op](X)
    monkeypatch.setattr(parallel, "workers", lambda: threads)
    cuts = []
    monkeypatch.setattr(parallel, "chunks", lambda n, parts, chunks=parallel.chunks: cuts.append(parts) or chunks(n, parts))
    (split,) = KERNELS[op](X)
    assert cuts == [threads]  # it did split
    assert split.shape == X.shape and split.dtype == one.dtype
    assert np.array_equal(split, one)


@pytest.mark.parametrize("op", ["SigmoidGrad", "TanhGrad"])
def test_fused_activation_gradients_split_bit_identically(monkeypatch, op):
    run = bind(fused_node(op, ["dY", "Y", "one"], ["dX"], "g"), 21)
    dY, Y, one = _x(), np.tanh(_x()[::-1].copy()), np.array(1, np.float32)
    monkeypatch.setattr(parallel, "workers", lambda: 1)
    (want,) = run(dY, Y, one)
    monkeypatch.setattr(parallel, "workers", lambda: 2)
    assert np.array_equal(run(dY, Y, one)[0], want)


def test_chunks_cover_the_array_at_aligned_starts_and_small_or_odd_operands_stay_whole(monkeypatch):
    for n, parts in [(N, 2), (N, 3), (parallel.ALIGN * 5, 4), (10, 4)]:
        cuts = parallel.chunks(n, parts)
        assert cuts[0].start == 0 and cuts[-1].stop == n and len(cuts) <= parts
        assert all(a.stop == b.start and b.start % parallel.ALIGN == 0 for a, b in zip(cuts, cuts[1:]))
    seen = []
    monkeypatch.setattr(parallel, "workers", lambda: 2)
    probe = parallel.elementwise(lambda X, *o: (seen.append(X.size) or X + 1,))
    probe(_x())
    assert sorted(seen) == sorted(c.stop - c.start for c in parallel.chunks(N, 2)) and len(seen) == 2
    seen.clear()
    probe(_x(), np.ones((1, N), np.float32))  # another operand that broadcasts: one call, whole
    assert seen == [N]
    probe(_x(), np.float32(2))  # a scalar goes to every chunk: split
    assert len(seen) == 3
    probe(np.ones(100, np.float32))  # small: whole
    assert seen[-1] == 100 and len(seen) == 4


def test_the_pool_is_off_unless_asked_and_then_takes_the_count_given_or_blas_s(monkeypatch):
    monkeypatch.delenv("ODT_ELEMENTWISE_THREADS", raising=False)
    assert parallel.workers() == 1
    monkeypatch.setenv("ODT_ELEMENTWISE_THREADS", "3")
    assert parallel.workers() == 3
    threadpoolctl = pytest.importorskip("threadpoolctl", reason="threadpoolctl sets BLAS's thread count here")
    monkeypatch.setenv("ODT_ELEMENTWISE_THREADS", "blas")
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        assert parallel.workers() == 1
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        assert parallel.workers() == 2
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("ODT_ELEMENTWISE_THREADS", bad)
        with pytest.raises(ArgumentError, match=rf"ODT_ELEMENTWISE_THREADS='{bad}': expected a thread count"):
            parallel.workers()
