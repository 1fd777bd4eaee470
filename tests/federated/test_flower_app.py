"""The repository's Flower App (pipeline.flower_app) on a user's error, in process: its ServerApp
called as Flower's runtime calls it (flwr.server.run_serverapp.run), and the exception it raises
logged as the runtime logs it (flwr/simulation/app.py and flwr/superlink/runtime/run_serverapp.py:
``log(ERROR, "%s raised an exception", ..., exc_info=ex)``) through Flower's own console handler.
A bad override or missing artifacts is the one line ``python -m pipeline.federate`` prints, with
no traceback, and the error still reaches Flower (which marks the run failed); a bug keeps its
traceback. tests/federated/test_deployment.py runs the same through `flwr run .`."""
from __future__ import annotations

import io
import logging
import shutil

import pytest

pytest.importorskip("flwr")
pytest.importorskip("hydra")

from flwr.app import Context, RecordDict
from flwr.server.run_serverapp import run as run_serverapp
from flwr.supercore.logger import FLOWER_LOGGER, ConsoleHandler

from pipeline import federate, flower_app
from pipeline.errors import ConfigError, DataError
from tests.pipeline.conftest import REPO

BAD_OVERRIDE = "federated.roundz=3"


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """conf/ and no artifacts (a checkout before `dvc repro generate`)."""
    shutil.copytree(REPO / "conf", tmp_path / "conf")
    monkeypatch.setenv("ODT_PROJECT_ROOT", str(tmp_path))
    return tmp_path


def run_as_flower(workspace, overrides: str) -> tuple[BaseException, str]:
    """The ServerApp's exception and Flower's log of the run (its console format, uncoloured:
    ``ERROR :     <message>``)."""
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={"workspace": str(workspace), "overrides": overrides})
    out = io.StringIO()
    handler = ConsoleHandler(colored=False, stream=out)
    FLOWER_LOGGER.addHandler(handler)
    try:
        with pytest.raises(Exception) as raised:
            run_serverapp(grid=None, context=context, server_app_dir=str(REPO), loaded_server_app=flower_app.server)
        FLOWER_LOGGER.log(logging.ERROR, "%s raised an exception", "ServerApp", exc_info=raised.value)  # as Flower's runtime does
    finally:
        FLOWER_LOGGER.removeHandler(handler)
    return raised.value, out.getvalue()


def errors(logged: str) -> list[str]:
    """The messages of Flower's log lines, each asserted to be an ERROR line."""
    lines = logged.splitlines()
    assert all(line.startswith("ERROR") for line in lines), logged
    return [line.split(":", 1)[1].strip() for line in lines]


def test_a_bad_override_is_the_stages_one_line_and_fails_the_run(workspace, capsys):
    assert federate.main([BAD_OVERRIDE]) == ConfigError.exit_code
    stage_line = capsys.readouterr().err.strip()
    assert stage_line.startswith("federate: error: ") and "\n" not in stage_line

    exc, logged = run_as_flower(workspace, BAD_OVERRIDE)
    assert isinstance(exc, ConfigError)  # raised on: Flower's runtime records the run as failed
    assert "Traceback" not in logged, logged
    # the stage's line, once, then Flower's own line (its exit code follows in a real run)
    assert errors(logged) == [stage_line, "ServerApp raised an exception"], logged
    assert "unknown key 'federated.roundz'" in stage_line and "(did you mean 'federated.rounds'?)" in stage_line


def test_missing_artifacts_are_one_line_and_fail_the_run(workspace):
    exc, logged = run_as_flower(workspace, "federated.rounds=3")
    assert isinstance(exc, DataError)
    assert "Traceback" not in logged, logged
    assert errors(logged) == [
        f"federate: error: {workspace / 'data' / 'generate'}: no training artifacts; run `dvc repro generate` in {workspace} first",
        "ServerApp raised an exception",
    ], logged


def test_a_bug_keeps_its_traceback(workspace, monkeypatch):
    def broken(context):
        raise RuntimeError("a bug")

    monkeypatch.setattr(flower_app, "_workspace_of", broken)
    exc, logged = run_as_flower(workspace, "")
    assert isinstance(exc, RuntimeError)
    assert "federate: error" not in logged
    assert "Traceback (most recent call last):" in logged and "RuntimeError: a bug" in logged, logged
