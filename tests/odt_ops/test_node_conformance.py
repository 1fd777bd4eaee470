"""The ONNX spec's own node test cases, run through odt_ops.backend, for every claimed op."""
from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import odt_ops
from odt_ops.backend import OdtBackend
from tests.odt_ops.conformance_gaps import KNOWN_GAPS


def _cases():
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases(None)
    claimed = set(odt_ops.supported_ops())
    return [c for c in cases if c.model.graph.node and {n.op_type for n in c.model.graph.node if n.domain in ("", "ai.onnx")} <= claimed
            and all(n.domain in ("", "ai.onnx") for n in c.model.graph.node)]


CASES = _cases()


def test_every_claimed_op_has_spec_cases():
    tested = {n.op_type for c in CASES for n in c.model.graph.node}
    # an op we claim must be exercised by at least one of the spec's cases
    untested = set(odt_ops.supported_ops()) - tested
    assert not untested, f"claimed ops without a spec node test: {sorted(untested)}"


def test_gap_list_names_real_cases():
    names = {c.name for c in CASES}
    assert set(KNOWN_GAPS) <= names, f"stale entries in KNOWN_GAPS: {sorted(set(KNOWN_GAPS) - names)}"


def _array(x):
    """Cases of exotic element types (float8, int4, ...) carry TensorProtos, not arrays."""
    return numpy_helper.to_array(x) if isinstance(x, onnx.TensorProto) else x


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_node_case(case):
    if case.name in KNOWN_GAPS:
        pytest.xfail(KNOWN_GAPS[case.name])
    rep = OdtBackend.prepare(case.model)
    for inputs, expected in case.data_sets:
        with np.errstate(all="ignore"):
            outputs = rep.run([_array(x) for x in inputs])
        assert len(outputs) >= len(expected)
        for got, want in zip(outputs, expected):
            want = np.asarray(_array(want))
            assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
            assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
            if want.dtype == object or want.dtype.kind in "USb":
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=case.rtol, atol=case.atol, equal_nan=True)
