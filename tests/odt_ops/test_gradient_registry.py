"""The gradient rules' layout and coverage: each rule lives in the rules module named like
its kernel's module, and each is run by a finite-difference check in the gradient tests (as
every claimed kernel has a case in ONNX's node tests)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from onnx import helper

import odt_ops.grad.rules  # noqa: F401 - registers every rule
from odt_ops.grad.registry import GRADIENTS
from odt_ops.kernels.registry import lookup
from tests.odt_ops.gradcheck import differentiated_ops, make_model

REPO = Path(__file__).resolve().parents[2]


def _family(module: str) -> str:
    return module.rsplit(".", 1)[1]


def test_each_rule_sits_in_the_rules_module_named_like_its_kernels():
    misplaced = []
    for (domain, op), rule in GRADIENTS.items():
        kernel = lookup(domain, op, 10_000)
        assert kernel is not None, f"{op} has a gradient rule but no kernel"
        if _family(rule.fn.__module__) != _family(kernel.fn.__module__):
            misplaced.append(f"{op}: rule in {rule.fn.__module__}, kernel in {kernel.fn.__module__}")
    assert not misplaced, misplaced


# ---- every rule is checked against finite differences ------------------------------------
# The check itself runs at the end of a session that ran every finite-difference test
# (tests/fd_coverage.py, over the op types tests/odt_ops/gradcheck.py records as it checks);
# the tests below hold its parts and run it on a small suite of its own, under pytest-xdist.

SMALL_SUITE_CONFTEST = """
import os
from pathlib import Path

import odt_ops.grad.rules  # registers every rule
from odt_ops.grad.registry import GRADIENTS, gradient
from tests.fd_coverage import FiniteDifferenceCoverage

REAL = set(GRADIENTS)
if os.environ.get("ODT_DUMMY_RULE"):
    @gradient("OdtDummy")  # a rule no finite-difference test runs
    def dummy(ctx, node):
        raise AssertionError("never differentiated")


def pytest_configure(config):
    # held to: the rules registered here beyond the real ones, and the two this suite checks
    rules = lambda: (set(GRADIENTS) - REAL) | {("", "Relu"), ("", "Tanh")}
    config.pluginmanager.register(FiniteDifferenceCoverage(config, Path(__file__).parent, rules), "fd-coverage")
"""

SMALL_SUITE_TEST = """
import numpy as np
from onnx import helper

from tests.odt_ops.gradcheck import check_gradients, make_model


def test_{op}():
    x = np.random.default_rng(0).uniform(0.2, 1.0, (2, 3)) * np.array([1.0, -1.0, 1.0])
    check_gradients(make_model([helper.make_node("{op}", ["X"], ["Y"])], {{"X": x}}), {{"X": x}}, ["X"])
"""


def _run_small_suite(directory: Path, *args: str, dummy: bool) -> subprocess.CompletedProcess:
    (directory / "conftest.py").write_text(SMALL_SUITE_CONFTEST, encoding="utf-8")
    for op in ("Relu", "Tanh"):  # one module each, so both xdist workers may record
        (directory / f"test_gradients_{op.lower()}.py").write_text(SMALL_SUITE_TEST.format(op=op), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(REPO), "ODT_DUMMY_RULE": "1" if dummy else ""}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=directory,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_registered_rule_without_a_finite_difference_check_fails_the_session(tmp_path):
    # under xdist, as the README runs the suite: the workers' records reach the controller
    run = _run_small_suite(tmp_path, "-n", "2", dummy=True)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "2 passed" in run.stdout, run.stdout  # every test passed: the session check failed it
    assert "gradient rules without a finite-difference check" in run.stdout, run.stdout
    assert "['OdtDummy']" in run.stdout, run.stdout


def test_a_session_whose_checks_cover_every_rule_passes(tmp_path):
    # in one process (had its own record not been read, Relu and Tanh would be reported)
    run = _run_small_suite(tmp_path, dummy=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "without a finite-difference check" not in run.stdout, run.stdout


def test_a_partial_session_says_it_cannot_tell(tmp_path):
    run = _run_small_suite(tmp_path, "-k", "relu", dummy=True)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "finite-difference coverage of the gradient rules not checked" in run.stdout, run.stdout
    assert "some were deselected" in run.stdout, run.stdout


def test_recorded_ops_are_those_downstream_of_the_parameters():
    # Shape reads X but only its shape reaches the loss through Reshape's shape input; the
    # Add of two constants reads no parameter: neither rule runs
    x = np.ones((2, 3))
    nodes = [helper.make_node("Add", ["C", "C"], ["D"]), helper.make_node("Mul", ["X", "D"], ["M"]),
             helper.make_node("Relu", ["M"], ["R"]), helper.make_node("Shape", ["C"], ["S"]),
             helper.make_node("Reshape", ["R", "S"], ["Y"])]
    model = make_model(nodes, {"X": x}, initializers={"C": np.ones((2, 3))})
    assert differentiated_ops(model, ["X"]) == {("", "Mul"), ("", "Relu"), ("", "Reshape")}
