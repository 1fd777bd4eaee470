"""The committed pipeline gives the same bytes on any x86-64 machine (README, "Reproducibility").

Two machines' worth of arithmetic on one: OpenBLAS picks its kernels from OPENBLAS_CORETYPE
when set (its documented override of CPU detection), and numpy leaves out the SIMD loops
NPY_DISABLE_CPU_FEATURES names (numpy's documented runtime dispatch control). A caller with
an AVX2 machine's kernels (Haswell, no AVX-512 loops) and one with a first-generation AVX
machine's (Sandybridge) run pretrain, the stage whose bytes differed between CPUs: run the
way DVC runs it (`sh pipeline/stage.sh pretrain`), both give the same base.onnx, bit for bit.
The same two callers running `python -m pipeline.pretrain` directly get different bytes, so
this machine can tell the two kinds of arithmetic apart (the check can fail).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import config, convert, prepare
from pipeline.paths import Paths
from tests.pipeline.conftest import REPO, TINY

MACHINES = {  # caller environments: what these CPUs' OpenBLAS and numpy would choose
    "avx2": {"OPENBLAS_CORETYPE": "Haswell", "NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL AVX512_SPR"},
    "avx": {"OPENBLAS_CORETYPE": "Sandybridge", "NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL AVX512_SPR"},
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


pytestmark = pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(),
                                reason="SKIPPED: needs an x86-64 CPU with AVX2 and FMA to run both machines' kernels")


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """prepare's and convert's outputs at test size, and params.yaml as DVC would run it."""
    root = tmp_path_factory.mktemp("repro")
    (root / "conf").symlink_to(REPO / "conf")
    overrides = [*TINY, "pretrain.epochs=2", "tracking=disabled"]
    (root / "params.yaml").write_text(config.compose_yaml(overrides, root=REPO), encoding="utf-8")
    cfg = config.load([], root=root)
    paths = Paths(root)
    prepare.run(cfg, paths)
    convert.run(cfg, paths)
    return root


def pretrain_digest(project: Path, machine: str, *command: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENBLAS_", "NPY_", "OMP_", "DVC_", "MLFLOW_"))}
    env.update(MACHINES[machine], ODT_PROJECT_ROOT=str(project), ODT_PYTHON=sys.executable)
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return hashlib.sha256((project / "data" / "pretrain" / "base.onnx").read_bytes()).hexdigest()


def test_pretrain_bytes_are_the_same_under_two_machines_kernels(project):
    pinned = {m: pretrain_digest(project, m, "sh", "pipeline/stage.sh", "pretrain") for m in MACHINES}
    assert pinned["avx2"] == pinned["avx"]
    free = {m: pretrain_digest(project, m, sys.executable, "-m", "pipeline.pretrain") for m in MACHINES}
    assert free["avx2"] != free["avx"]  # without stage.sh's pinning the kernels show in the bytes
