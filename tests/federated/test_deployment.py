"""Flower's deployment engine on 127.0.0.1: a SuperLink and three SuperNodes as separate processes
(each SuperNode one device, its ClientApp run in a subprocess per message), the ServerApp submitted
with `flwr run` against the running SuperLink, everything started and stopped by the test in
bounded time. Dependency installation at run time is off: nothing downloads."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from tests.federated.helpers import mlp_artifacts  # noqa: E402

BIN = Path(sys.executable).parent
APP = '''\
import json, os
import numpy as np
from odt_ops.federated.flower import ClientData, FederationSettings, client_app, server_app

ART = os.environ["ODT_FL_ARTIFACTS"]


def data(cid, context):
    centers = np.random.default_rng(123).random((10, 1, 8, 8), dtype=np.float32)
    rng = np.random.default_rng([0, cid])
    y = rng.integers(0, 10, 60)
    x = (centers[y] + 0.3 * rng.standard_normal((60, 1, 8, 8))).astype(np.float32)
    return ClientData(x[:40], y[:40], x[40:], y[40:])


def finish(result):
    with open(os.environ["ODT_FL_OUT"], "w") as f:
        json.dump({"rounds": result.history(), "clients": sorted(result.clients.values())}, f)


client = client_app(ART, data)
server = server_app(ART, FederationSettings(rounds=2, clients=3, lr=0.1, seed=1), on_finish=finish)
'''
PYPROJECT = '''\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "odt-fl-test"
version = "1.0.0"
description = "odt on Flower's deployment engine"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "odt"

[tool.flwr.app.components]
serverapp = "odt_fl_app:server"
clientapp = "odt_fl_app:client"

[tool.flwr.app.config]
rounds = 2
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise TimeoutError(what)


@pytest.mark.slow
def test_superlink_and_three_supernodes_on_localhost(tmp_path):
    if shutil.which("flower-superlink", path=str(BIN)) is None:
        pytest.skip("flwr's console scripts are not installed next to this interpreter")
    art = mlp_artifacts(tmp_path / "artifacts")
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text(PYPROJECT)
    (app / "odt_fl_app.py").write_text(APP)
    home = tmp_path / "flwr_home"
    home.mkdir()
    port = free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    out = tmp_path / "result.json"
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "ODT_FL_ARTIFACTS": str(art), "ODT_FL_OUT": str(out),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen] = []

    def start(name: str, *cmd: str) -> subprocess.Popen:
        # each in its own session, so stopping it stops the app processes it spawned too
        p = subprocess.Popen([str(BIN / cmd[0]), *cmd[1:]], env=env, cwd=tmp_path, stdout=open(logs / f"{name}.log", "w"),
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    try:
        start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
              "--disable-runtime-dependency-installation")
        wait_for(lambda: "Uvicorn running" in (logs / "superlink.log").read_text(), 60, "the SuperLink did not start")
        for i in range(3):
            start(f"supernode{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                  "--node-config", f"partition-id={i}")
        wait_for(lambda: all("SuperNode ID" in (logs / f"supernode{i}.log").read_text() for i in range(3)), 60, "SuperNodes did not connect")
        run = subprocess.run([str(BIN / "flwr"), "run", str(app), "local", "--stream"], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=420)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        wait_for(out.is_file, 60, "the ServerApp wrote no result")
        result = json.loads(out.read_text())
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 20
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
    assert result["clients"] == [0, 1, 2]
    assert [r["participants"] for r in result["rounds"]] == [3, 3]
    assert all(not r["dropped"] and r["client_eval_count"] == 3 for r in result["rounds"])
    assert all(p.poll() is not None for p in procs)
