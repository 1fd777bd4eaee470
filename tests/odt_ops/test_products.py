"""Matrix products through their chosen formulation (odt_ops/kernels/products.py): every
formulation equals numpy's plain ``x @ W`` within float32 rounding, for every operand layout;
the choice is made once per shape and kept, and recorded per machine, so a plan's runs are
bit-identical in one process and across processes."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from odt_ops.errors import ArgumentError
from odt_ops.kernels import products
from odt_ops.kernels.linalg import gemm
from odt_ops.kernels.products import FORMULATIONS, ProductRecord
from odt_ops.runtime.plan import Plan

# the personalization model's first layer (the slow shape reported on AVX2), a few rows against
# many columns, a weight gradient's shape, and odd sizes
SHAPES = [(64, 784, 256), (16, 784, 128), (256, 64, 784), (7, 33, 5)]


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch, tmp_path):
    """Each test starts as a new process on a machine with no recorded choices."""
    monkeypatch.setenv("ODT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(products, "_DECIDED", {})
    monkeypatch.setattr(products, "_RECORDED", [])


def _operands(rng, m, k, n, dtype, a_layout, b_layout):
    A = rng.standard_normal((m, k)).astype(dtype)
    B = rng.standard_normal((k, n)).astype(dtype)
    # "T": the operand arrives as a transposed view (a transposed-stored weight, transA/transB)
    A = np.ascontiguousarray(A.T).T if a_layout == "T" else A
    B = np.ascontiguousarray(B.T).T if b_layout == "T" else B
    return A, B


@pytest.mark.parametrize("how", FORMULATIONS)
@pytest.mark.parametrize("layouts", ["NN", "NT", "TN", "TT"])
@pytest.mark.parametrize(("m", "k", "n"), SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_formulation_equals_numpys_product(how, layouts, m, k, n, dtype):
    rng = np.random.default_rng(m + k + n)
    A, B = _operands(rng, m, k, n, dtype, *layouts)
    Y = ProductRecord(how)(A, B)
    plain = A @ B  # numpy's own product, as a user writes it
    exact = A.astype(np.float64) @ B.astype(np.float64)
    scale = np.abs(A).astype(np.float64) @ np.abs(B).astype(np.float64)  # the rounding bound's size
    eps = np.finfo(dtype).eps
    assert Y.dtype == dtype and Y.shape == (m, n) and Y.flags.c_contiguous
    assert np.all(np.abs(Y - exact) <= 2 * k * eps * scale)
    assert np.all(np.abs(Y - plain) <= 4 * k * eps * scale)


@pytest.mark.parametrize("how", FORMULATIONS)
def test_gemm_with_transposed_weights_through_each_formulation(how):
    rng = np.random.default_rng(3)
    x, W, b = rng.standard_normal((64, 784), np.float32), rng.standard_normal((256, 784), np.float32), rng.standard_normal(256, np.float32)
    (Y,) = gemm(x, W, b, alpha=0.5, beta=2.0, transB=1, _products=ProductRecord(how))
    want = 0.5 * (x.astype(np.float64) @ W.T.astype(np.float64)) + 2.0 * b
    np.testing.assert_allclose(Y, want, rtol=1e-5, atol=1e-4)
    assert Y.dtype == np.float32 and Y.flags.c_contiguous


def _layer_plan() -> Plan:
    """relu(x @ W^T + b), the personalization model's first layer: the plan fuses Gemm and Relu."""
    node = helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1, name="fc0")
    relu = helper.make_node("Relu", ["h"], ["y"], name="relu0")
    graph = helper.make_graph([node, relu], "layer", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("x", "W", "b")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return Plan(graph, {"": 21}, {}, ["x", "W", "b"], ["y"])


def test_a_plan_keeps_its_first_choice_so_its_runs_are_bit_identical(monkeypatch):
    """The calibration is made to answer differently each time it is asked (as a noisy timer may):
    the plan must still run the first answer on every later step."""
    answers = iter(["swapped", "direct", "packed", "direct"])
    monkeypatch.setattr(products, "calibrate", lambda A, B: (next(answers), {}))
    monkeypatch.setenv("ODT_GEMM", "calibrate")
    rng = np.random.default_rng(0)
    x, W, b = rng.standard_normal((64, 784), np.float32), rng.standard_normal((256, 784), np.float32), rng.standard_normal(256, np.float32)
    W = np.ascontiguousarray(W.T).T  # stored transposed, as Module stores a transB weight
    plan = _layer_plan()
    first = plan.run([x, W, b])[0]
    for _ in range(2):
        assert np.array_equal(plan.run([x, W, b])[0], first)
    swapped = np.maximum(products.compute(x, W.T, "swapped") + b, 0)
    assert np.array_equal(first, swapped)
    assert plan.formulations() == {"fused/fc0": ["64x784 @ 784x256 NN float32: swapped"]}
    # another plan in the same process meets the same key: the process's one choice, not a new one
    assert np.array_equal(_layer_plan().run([x, W, b])[0], first)


def test_calibration_times_the_candidates_and_keeps_direct_unless_clearly_faster():
    rng = np.random.default_rng(1)
    A, B = _operands(rng, 64, 784, 256, np.float32, "N", "T")
    how, times = products.calibrate(A, B)
    assert set(times) == {"direct", "swapped", "packed", "columns32", "columns64"} and all(t > 0 for t in times.values())
    assert how == "direct" or times[how] < products.MARGIN * times["direct"]


def test_the_rule_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("ODT_GEMM", raising=False)
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    assert products.rule() == "calibrate"
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Nehalem")  # pinned kernels: a reproducible run, no timing
    assert products.rule() == "direct"
    monkeypatch.setenv("ODT_GEMM", "swapped")
    assert ProductRecord().how == "swapped"
    monkeypatch.setenv("ODT_GEMM", "fastest")
    with pytest.raises(ArgumentError, match="ODT_GEMM='fastest'.*calibrate, direct, swapped, packed"):
        products.rule()


def _new_process(monkeypatch):
    """What a new process knows: nothing decided, the machine's record not yet read."""
    monkeypatch.setattr(products, "_DECIDED", {})
    monkeypatch.setattr(products, "_RECORDED", [])


def test_a_calibrated_choice_is_recorded_so_the_next_process_on_the_machine_adopts_it(monkeypatch):
    """A noisy timer may answer differently in each process; a seeded rerun must still compute the
    same bits, so the second process takes the first one's recorded choice and never times."""
    rng = np.random.default_rng(2)
    A, B = _operands(rng, 64, 784, 256, np.float32, "N", "T")
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("packed", {"direct": 2.0, "packed": 1.0}))
    assert products.decide(A, B, "calibrate") == "packed"
    assert products.cache_file().is_file()

    _new_process(monkeypatch)

    def timing_again(A, B):
        raise AssertionError("a recorded choice was timed again")

    monkeypatch.setattr(products, "calibrate", timing_again)
    assert products.decide(A, B, "calibrate") == "packed"
    # a different key is still calibrated
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("swapped", {}))
    C, D = _operands(rng, 32, 784, 256, np.float32, "N", "T")
    assert products.decide(C, D, "calibrate") == "swapped"
    _new_process(monkeypatch)
    monkeypatch.setattr(products, "calibrate", timing_again)
    assert [products.decide(A, B, "calibrate"), products.decide(C, D, "calibrate")] == ["packed", "swapped"]


def _another_machine(monkeypatch):
    monkeypatch.setattr(products, "_machine", lambda: "another CPU|numpy 2|openblas Haswell|threads 1")


def _more_formulations(monkeypatch):  # an engine that has formulations the record never timed
    monkeypatch.setattr(products, "FORMULATIONS", (*products.FORMULATIONS, "newer"))


@pytest.mark.parametrize("change", [_another_machine, _more_formulations], ids=["another machine or BLAS build", "more formulations"])
def test_a_record_made_under_other_conditions_is_not_adopted(monkeypatch, change):
    rng = np.random.default_rng(3)
    A, B = _operands(rng, 64, 784, 256, np.float32, "N", "T")
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("packed", {}))
    products.decide(A, B, "calibrate")
    _new_process(monkeypatch)
    change(monkeypatch)
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("direct", {}))
    assert products.decide(A, B, "calibrate") == "direct"


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"choices": {"64,784,256,C,F,float32": "fastest"}}'])
def test_a_damaged_record_is_only_a_cache_it_is_recalibrated_and_rewritten(monkeypatch, content):
    rng = np.random.default_rng(4)
    A, B = _operands(rng, 64, 784, 256, np.float32, "N", "T")
    products.cache_file().parent.mkdir(parents=True)
    products.cache_file().write_bytes(content)
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("swapped", {}))
    assert products.decide(A, B, "calibrate") == "swapped"
    _new_process(monkeypatch)
    assert products._read_recorded(products.cache_file()) == {"64,784,256,C,F,float32": "swapped"}


def test_a_read_only_cache_keeps_the_choice_for_the_process(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("ODT_CACHE_DIR", str(blocked / "odt"))
    rng = np.random.default_rng(5)
    A, B = _operands(rng, 64, 784, 256, np.float32, "N", "T")
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("swapped", {}))
    assert products.decide(A, B, "calibrate") == "swapped"
    monkeypatch.setattr(products, "calibrate", lambda A, B: ("direct", {}))
    assert products.decide(A, B, "calibrate") == "swapped"


@pytest.mark.parametrize(("a_shape", "b_shape"), [
    ((64, 16, 128), (128, 512)),     # a linear layer on a sequence
    ((2, 3, 5, 7), (7, 4)),          # two stacking axes
    ((2, 3, 5, 7), (1, 1, 7, 4)),    # B with leading axes of one (broadcast)
    ((3, 5, 7), (1, 7, 4)),
    ((0, 5, 7), (7, 4)),             # an empty stack
    ((3, 5, 0), (0, 4)),             # K = 0: zeros
])
@pytest.mark.parametrize("record", [None, "calibrate"])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_stack_times_one_matrix_is_numpys_matmul(a_shape, b_shape, record, transposed):
    """[..., M, K] @ [K, N] runs as one [(...)*M, K] product; numpy's matmul (one BLAS call per
    matrix of the stack) is the oracle for the values and the broadcast shape, also for a
    non-contiguous stack (its last two axes a transposed view)."""
    rng = np.random.default_rng(1)
    A = rng.standard_normal(a_shape).astype(np.float32)
    if transposed:
        A = np.ascontiguousarray(np.swapaxes(A, -1, -2)).swapaxes(-1, -2)
    B = rng.standard_normal(b_shape).astype(np.float32)
    got = products.multiply(A, B, None if record is None else ProductRecord(record))
    want = np.matmul(A, B)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_batch_times_a_batch_stays_numpys_matmul():
    """Two real stacks (attention's [B, H, S, D] @ [B, H, D, S]) are numpy's matmul, bit for bit."""
    rng = np.random.default_rng(2)
    A, B = rng.standard_normal((2, 3, 5, 7)).astype(np.float32), rng.standard_normal((2, 3, 7, 5)).astype(np.float32)
    np.testing.assert_array_equal(products.multiply(A, B, ProductRecord("direct")), np.matmul(A, B))

