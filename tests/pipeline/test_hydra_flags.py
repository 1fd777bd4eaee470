"""Hydra's own flags on a stage, run as a Hydra user types them, checked against what Hydra
documents each flag to do (hydra.cc, "Command line flags"): ``--cfg job`` prints the job's
config as YAML, ``--cfg hydra`` Hydra's, ``--info`` the search path, defaults tree and config,
``--hydra-help`` Hydra's flags; ``-m`` is refused with the DVC command that sweeps."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.pipeline.conftest import REPO


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """params.yaml as `dvc exp run -S optimizer.lr=1e-3` leaves it (conf/ says 3e-3)."""
    root = tmp_path_factory.mktemp("ws")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["optimizer"]["lr"] = 1e-3
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "conf").symlink_to(REPO / "conf")
    return root


def stage(root, *args):
    env = {**os.environ, "ODT_PROJECT_ROOT": str(root)}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_cfg_job_prints_the_configuration_the_stage_would_run(workspace):
    proc = stage(workspace, "--cfg", "job", "tracking=disabled")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert "hydra" not in cfg  # job only
    assert cfg["optimizer"]["lr"] == 1e-3
    assert cfg["tracking"]["enabled"] is False  # params.yaml plus the override
    proc = stage(workspace, "--cfg", "job", "--package", "optimizer")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# @package optimizer")
    assert yaml.safe_load(proc.stdout)["lr"] == 1e-3  # Hydra's package view
    proc = stage(workspace, "-c", "hydra")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["hydra"]["run"]["dir"] == "."  # conf/config.yaml's hydra node


def test_info_and_hydra_help_are_hydras(workspace):
    proc = stage(workspace, "model=cnn", "--info")
    assert proc.returncode == 0, proc.stderr
    for section in ("Config search path", "Defaults Tree", "Config"):
        assert section in proc.stdout, proc.stdout[:2000]
    assert "model: cnn" in proc.stdout
    assert f"file://{workspace / 'conf'}" in proc.stdout  # the switched group, conf/ searched
    proc = stage(workspace, "--hydra-help")
    assert proc.returncode == 0, proc.stdout
    assert "--cfg,-c" in proc.stdout, proc.stdout
    assert "--multirun,-m" in proc.stdout, proc.stdout


def test_multirun_says_how_to_sweep(workspace):
    for args in (["-m", "optimizer.lr=1e-3,3e-3"], ["optimizer.lr=1e-3,3e-3"]):
        proc = stage(workspace, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1, proc.stderr
        assert "dvc exp run --queue -S 'optimizer.lr=1e-3,3e-3'" in lines[0]
        assert "Traceback" not in proc.stderr


def test_a_bad_override_with_cfg_is_one_line(workspace):
    proc = stage(workspace, "--cfg", "job", "optimizer.lrr=1")
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.lrr" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
