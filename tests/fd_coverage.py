"""A session check: every registered gradient rule was checked against finite differences.

tests/odt_ops/gradcheck.py records, in each process, the op types of the nodes a passing
``check_gradients`` differentiated (``gradcheck.CHECKED``). At the end of a session that ran
every finite-difference test (each ``test_gradients*.py`` module whole, none deselected, all
passed), this plugin compares the record with the gradient registry and fails the session,
naming each rule that no finite-difference test ran. Under pytest-xdist each worker hands its
record and what it deselected to the controller (``workeroutput``), which collects the
finite-difference items from the workers' collections and their outcomes from the reports it
receives, so the answer is the same with ``-n 2`` as in one process. A session that ran only
part of those tests (a single file, ``-k``, ``-x`` after a failure) cannot tell, and says so in
one line instead of checking.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

Rule = tuple[str, str]  # (domain, op type), as the registry keys them


def registered_rules() -> set[Rule]:
    import odt_ops.grad.rules  # noqa: F401 - registers every rule
    from odt_ops.grad.registry import GRADIENTS

    return set(GRADIENTS)


def checked_here() -> set[Rule]:
    """The record of this process (empty if no finite-difference test ran in it)."""
    import sys

    gradcheck = sys.modules.get("tests.odt_ops.gradcheck")
    return set(gradcheck.CHECKED) if gradcheck is not None else set()


def unchecked(rules: Iterable[Rule], checked: Iterable[Rule]) -> list[str]:
    """The rules no finite-difference check ran, domain-qualified outside the default domain."""
    done = set(checked)
    return sorted(op if not domain else f"{domain}::{op}" for domain, op in set(rules) - done)


class FiniteDifferenceCoverage:
    """Registered once per session (tests/conftest.py); ``directory`` holds the
    ``test_gradients*.py`` modules, ``rules`` gives what the registry holds at the end."""

    def __init__(self, config: pytest.Config, directory: Path, rules: Callable[[], Iterable[Rule]] = registered_rules):
        self.root = Path(config.rootpath)
        self.directory = Path(directory).resolve()
        self.rules = rules
        self.files = {p.name for p in self.directory.glob("test_gradients*.py")}
        self.collected: set[str] = set()  # node ids of finite-difference tests
        self.passed: set[str] = set()
        self.deselected = False
        self.checked: set[Rule] = set()  # the workers' records (the controller's own is read at the end)

    def _ours(self, nodeid: str) -> bool:
        path = nodeid.split("::", 1)[0]
        return Path(path).name in self.files and (self.root / path).resolve().parent == self.directory

    # ---- every process ------------------------------------------------------------------
    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.collected.update(item.nodeid for item in session.items if self._ours(item.nodeid))

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected |= any(self._ours(item.nodeid) for item in items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed and self._ours(report.nodeid):
            self.passed.add(report.nodeid)

    # ---- the controller under pytest-xdist ------------------------------------------------
    @pytest.hookimpl(optionalhook=True)
    def pytest_xdist_node_collection_finished(self, node, ids: list[str]) -> None:
        self.collected.update(i for i in ids if self._ours(i))

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        output = getattr(node, "workeroutput", {})
        self.checked.update(tuple(r) for r in output.get("fd_checked", ()))
        self.deselected |= bool(output.get("fd_deselected", False))

    # ---- the end -----------------------------------------------------------------------
    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if hasattr(config, "workeroutput"):  # a worker: hand the record to the controller
            config.workeroutput["fd_checked"] = sorted(checked_here())
            config.workeroutput["fd_deselected"] = self.deselected
            return
        ran = {Path(i.split("::", 1)[0]).name for i in self.collected}
        if not self.collected:
            return
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        incomplete = [why for bad, why in [
            (ran != self.files, f"ran {sorted(ran)} of {sorted(self.files)}"),
            (self.deselected, "some were deselected"),
            (self.passed != self.collected, f"{len(self.collected - self.passed)} of {len(self.collected)} did not pass"),
        ] if bad]
        if incomplete:
            if reporter is not None:
                reporter.write_line("")  # after the progress line (ensure_newline misses it under xdist)
                reporter.write_line(f"finite-difference coverage of the gradient rules not checked: the session ran part of "
                                    f"the finite-difference tests ({'; '.join(incomplete)})")
            return
        missing = unchecked(self.rules(), self.checked | checked_here())
        if missing:
            if reporter is not None:
                reporter.write_line("")  # after the progress line (ensure_newline misses it under xdist)
                reporter.write_sep("=", "gradient rules without a finite-difference check", red=True)
                reporter.write_line(f"no test in {sorted(self.files)} ran check_gradients (tests/odt_ops/gradcheck.py) over "
                                    f"a graph with these ops: {missing}; add a case for each")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
