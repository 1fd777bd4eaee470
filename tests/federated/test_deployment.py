"""The README's Flower commands, run as written. `flwr run .` (the simulation): the first two
lines of the ```bash block under "With Flower's own tools". The deployment recipe: the ```bash block under "Deployment: a
SuperLink and SuperNodes" is taken from README.md and run by bash from the checkout, on
127.0.0.1 (a SuperLink, three SuperNodes as separate processes, `flwr run . local-deployment`).
Only the environment differs from a user's shell: Flower's config in a temporary FLWR_HOME,
the workspace (conf/, params.yaml, data/) a temporary one at test size (ODT_PROJECT_ROOT).
The oracle is Flower's own account of the run: `flwr run --stream` prints the ServerApp's
log, whose per-round lines must show every SuperNode's update averaged in and evaluated;
afterwards nothing listens on the recipe's ports (its last line stopped what it started)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")
pytest.importorskip("hydra")

from tests.pipeline.conftest import REPO

HEADING = "### Deployment: a SuperLink and SuperNodes"
PORTS = (9092, 9101, 9102, 9103)  # the recipe's SuperLink and SuperNodes


def bash_block(heading: str) -> str:
    """The first ```bash block under ``heading`` in README.md."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index(heading):]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, f"no ```bash block under {heading!r} in README.md"
    return match.group(1)


def recipe() -> str:
    return bash_block(HEADING)


def flower_env(home: Path, workspace: Path, **extra: str) -> dict[str, str]:
    """A user's shell but for Flower's config home and the test-size workspace."""
    return {**os.environ, "FLWR_HOME": str(home), "ODT_PROJECT_ROOT": str(workspace), "FLWR_TELEMETRY_ENABLED": "0",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", **extra}


def run_in_own_session(script: str, env: dict[str, str], timeout: float = 420) -> tuple[int, str]:
    """``bash -c script`` from the checkout in its own session, killed with all it started."""
    proc = subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        with contextlib.suppress(ProcessLookupError):  # already gone
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """conf/ and a params.yaml at test size, and the artifacts generate makes from them."""
    from pipeline import config, convert, generate, prepare, pretrain
    from pipeline.paths import Paths

    root = tmp_path_factory.mktemp("deploy_ws")
    shutil.copytree(REPO / "conf", root / "conf")
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    tiny = ["tracking=disabled", "data.user_samples=100", "data.user_train_per_class=3", "pretrain.epochs=2"]
    (root / "params.yaml").write_text(config.compose_yaml(tiny, root=root), encoding="utf-8")
    cfg = config.load([], root=root)
    paths = Paths(root)
    for stage in (prepare, convert, pretrain, generate):
        stage.run(cfg, paths)
    return root


@pytest.mark.slow
def test_readme_deployment_recipe_runs_as_written(workspace, tmp_path):
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the recipe activates the checkout's .venv, which this checkout lacks (the README's commands make it)")
    if shutil.which("curl") is None:
        pytest.skip("the recipe waits for the SuperLink with curl, which is not installed")
    busy = [p for p in PORTS if port_taken(p)]
    if busy:
        pytest.skip(f"the recipe's ports {busy} are in use on 127.0.0.1 (another SuperLink?)")
    home = tmp_path / "flwr_home"
    env = flower_env(home, workspace, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    # its own session: whatever the recipe leaves running is stopped with it
    returncode, out = run_in_own_session("set -e\n" + recipe(), env)
    assert returncode == 0, out[-4000:]
    rounds = re.findall(r"round (\d+)/2: (\d+)/(\d+) clients succeeded; clients' accuracy [\d.]+ \((\d+) evaluated\)", out)
    assert [r[0] for r in rounds] == ["1", "2"], out[-4000:]
    assert all(r[1:] == ("3", "3", "3") for r in rounds), rounds  # every SuperNode trained and evaluated, every round
    listing = subprocess.run([str(Path(sys.executable).parent / "flwr"), "list", "local-deployment"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=60)
    # the SuperLink is gone by now (the recipe's last line stops it): flwr list must fail to connect, not hang
    assert listing.returncode != 0
    assert (home / "config.toml").read_text().count("[superlink.local-deployment]") == 1
    assert not any(port_taken(p) for p in PORTS), "the recipe's last line left a process listening"


SIMULATION_HEADING = "### With Flower's own tools: `flwr run .`"
LOCAL_SUPERLINK_PORTS = (39091, 39092, 39093)  # where `flwr run .` starts Flower's local SuperLink


def _simulation_lines() -> list[str]:
    return [line for line in bash_block(SIMULATION_HEADING).splitlines() if line.strip()]


def _stop_processes_with(env_key: str, value: str) -> None:
    """Stop every process whose environment has ``env_key=value`` (the local SuperLink that
    `flwr run .` leaves running, in its own session, for the next run), and wait until they are
    gone (or zombies: their ports are free), so the next test finds the SuperLink's ports free."""
    wanted = f"{env_key}={value}".encode()
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if wanted in (proc / "environ").read_bytes().split(b"\0"):
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(proc)
    deadline = time.monotonic() + 10
    while killed and time.monotonic() < deadline:
        killed = [proc for proc in killed if _alive(proc)]
        time.sleep(0.1)


def _alive(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # gone
        return False


@pytest.mark.slow
def test_readme_flwr_run_simulation_runs_as_written(workspace, tmp_path):
    """`flwr run .` as the README writes it (its first two lines: the venv, then a run of ten
    simulated SuperNodes) runs our ServerApp and ClientApps to the end; the oracle is the
    ServerApp's own streamed per-round lines."""
    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the README activates the checkout's .venv, which this checkout lacks (the README's commands make it)")
    busy = [p for p in LOCAL_SUPERLINK_PORTS if port_taken(p)]
    if busy:
        pytest.skip(f"Flower's local SuperLink ports {busy} are in use on 127.0.0.1 (a `flwr run .` left running?)")
    home = tmp_path / "flwr_home"
    activate, first_run = _simulation_lines()[:2]
    assert first_run == 'flwr run . --stream --federation-config "num-supernodes=10"'
    try:
        returncode, out = run_in_own_session(f"set -e\n{activate}\n{first_run}", flower_env(home, workspace))
    finally:
        _stop_processes_with("FLWR_HOME", str(home))
    assert returncode == 0, out[-4000:]
    rounds = re.findall(r"round (\d+)/(\d+): (\d+)/(\d+) clients succeeded; clients' accuracy [\d.]+ \((\d+) evaluated\)", out)
    assert rounds, out[-4000:]
    total = int(rounds[0][1])
    assert [int(r[0]) for r in rounds] == list(range(1, total + 1)), out[-4000:]
    assert all(r[2] == r[3] for r in rounds), rounds  # every sampled client's update averaged in
    assert all(r[4] == "10" for r in rounds), rounds  # the ten simulated SuperNodes evaluated, every round


@pytest.mark.slow
def test_readme_flwr_run_with_a_users_error_prints_one_line_and_fails_the_run(tmp_path):
    """The README's third `flwr run .` line with an override naming no key (`federated.roundz=3`),
    then as written in a checkout without artifacts: each run's streamed log has the one line
    `python -m pipeline.federate` gives, no traceback, and Flower's exit code for a failed
    simulation; `flwr ls` lists both runs finished:failed with the error in their details.
    `flwr run` itself returns 0: Flower 1.42's CLI streams the log and never reads the run's status
    (flwr/cli/run/run.py `_run_with_control_api`, flwr/cli/log.py `start_stream`)."""
    from flwr.common.constant import Status, SubStatus
    from flwr.supercore.exit import ExitCode

    if not (REPO / ".venv" / "bin" / "activate").is_file():
        pytest.skip("the README activates the checkout's .venv, which this checkout lacks (the README's commands make it)")
    busy = [p for p in LOCAL_SUPERLINK_PORTS if port_taken(p)]
    if busy:
        pytest.skip(f"Flower's local SuperLink ports {busy} are in use on 127.0.0.1 (a `flwr run .` left running?)")
    workspace = tmp_path / "checkout"  # conf/, no artifacts (no `dvc repro generate`)
    shutil.copytree(REPO / "conf", workspace / "conf")
    home, listing = tmp_path / "flwr_home", tmp_path / "runs.json"
    env = flower_env(home, workspace)
    stage = subprocess.run([sys.executable, "-m", "pipeline.federate", "federated.roundz=3"], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    stage_line = stage.stderr.strip()
    assert stage.returncode == 2 and stage_line.startswith("federate: error: ") and "\n" not in stage_line, stage.stderr

    activate, _, with_overrides = _simulation_lines()[:3]
    valid = "federated=fedprox federated.rounds=3"
    assert f"overrides='{valid}'" in with_overrides
    typo = with_overrides.replace(valid, "federated.roundz=3")
    script = f"set -e\n{activate}\n{typo}\n{with_overrides}\nflwr ls --format json > {shlex.quote(str(listing))}"
    try:
        returncode, out = run_in_own_session(script, env)
    finally:
        _stop_processes_with("FLWR_HOME", str(home))
    assert returncode == 0, out[-4000:]  # `set -e`: both `flwr run` returned 0, though both runs failed
    assert "Traceback" not in out, out[-6000:]
    assert out.count(stage_line) == 1, out[-6000:]
    artifacts = f"{workspace / 'data' / 'generate'}: no training artifacts; run `dvc repro generate` in {workspace} first"
    assert out.count(f"federate: error: {artifacts}") == 1, out[-6000:]
    assert out.count(f"Exit Code: {ExitCode.SIMULATION_EXCEPTION}") == 2, out[-6000:]
    runs = json.loads(listing.read_text())["runs"]
    assert [r["status"] for r in runs] == [f"{Status.FINISHED}:{SubStatus.FAILED}"] * 2, runs
    details = sorted(r["status-details"] for r in runs)
    assert details[0].endswith(artifacts) and details[1].endswith(stage_line.removeprefix("federate: error: ")), details
