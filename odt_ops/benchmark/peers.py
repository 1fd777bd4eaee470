"""The peers: which Python runs each worker, whether it is installed, and --setup-peers.

onnxruntime-training-cpu 1.19.2 (ORT training's last release) cannot share an
environment with onnxruntime's inference build (both are the package ``onnxruntime``)
and wants onnx 1.17, so it lives in its own virtual environment, .venv-bench-ort/ at
the repository root (or $ODT_BENCH_VENV). PyTorch is used from the main environment
when importable, else from that venv. A peer that is not installed is reported as
missing, with what to run; nothing is ever substituted for it.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

PEERS = ("odt", "ort-training", "torch", "ort-inference")  # also the table's column order
WORKERS = Path(__file__).resolve().parent / "workers"
SCRIPTS = {"odt": "run_odt.py", "ort-training": "run_ort_training.py", "torch": "run_torch.py",
           "ort-inference": "run_ort_inference.py"}

ORT_TRAINING = "onnxruntime-training-cpu==1.19.2"
ORT_TRAINING_ONNX = "onnx==1.17.*"  # the onnx that ORT training 1.19.2 was built and tested with
# Exactly this version: its CPU wheel is cached here; any other version or a range makes
# pip pull several GB of CUDA packages.
TORCH = "torch==2.13.0"
SETUP_HINT = "python -m odt_ops.benchmark --setup-peers"


@dataclass(frozen=True)
class PeerEnv:
    name: str
    python: str | None  # None: not available
    reason: str = ""  # why not, and what to run

    @property
    def script(self) -> Path:
        return WORKERS / SCRIPTS[self.name]


def repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def venv_dir() -> Path:
    return Path(os.environ.get("ODT_BENCH_VENV") or repo_root() / ".venv-bench-ort")


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _probe(python: Path | str, code: str) -> bool:
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_HAS_TORCH = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)"
# the training build ships onnxruntime/training/api; finding it imports nothing of onnxruntime
_HAS_ORT_TRAINING = ("import importlib.util, os, sys; s = importlib.util.find_spec('onnxruntime'); "
                     "sys.exit(s is None or not os.path.isdir(os.path.join(os.path.dirname(s.origin), 'training', 'api')))")


def locate(peer: str) -> PeerEnv:
    here = sys.executable
    venv = venv_python()
    if peer == "odt":
        return PeerEnv(peer, here)
    if peer == "ort-inference":
        if importlib.util.find_spec("onnxruntime") is None:
            return PeerEnv(peer, None, "onnxruntime is not installed in this environment (pip install onnxruntime)")
        return PeerEnv(peer, here)
    if peer == "torch":
        if importlib.util.find_spec("torch") is not None:
            return PeerEnv(peer, here)
        if venv.exists() and _probe(venv, _HAS_TORCH):
            return PeerEnv(peer, str(venv))
        return PeerEnv(peer, None, f"torch is not installed here nor in {venv_dir()} (run {SETUP_HINT}, "
                                   f"which installs exactly {TORCH})")
    if peer == "ort-training":
        if venv.exists() and _probe(venv, _HAS_ORT_TRAINING):
            return PeerEnv(peer, str(venv))
        return PeerEnv(peer, None, f"{ORT_TRAINING} is not installed in {venv_dir()} (run {SETUP_HINT})")
    raise ValueError(f"unknown peer {peer!r}; peers are {', '.join(PEERS)}")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def setup_peers() -> int:
    """Create the ORT training environment and install the comparators that are missing."""
    venv = venv_dir()
    if not venv_python().exists():
        base = shutil.which("python3.11") or sys.executable
        _run([base, "-m", "venv", str(venv)])
    pip = [str(venv_python()), "-m", "pip", "install", "-q"]
    _run([*pip, ORT_TRAINING, ORT_TRAINING_ONNX])
    check = [str(venv_python()), str(WORKERS / "run_ort_training.py"), "--check"]
    if subprocess.run(check).returncode != 0:  # a numpy 2 incompatibility is the one seen in practice
        _run([*pip, "numpy<2"])
        subprocess.run(check, check=True)
    if importlib.util.find_spec("torch") is None and not _probe(venv_python(), _HAS_TORCH):
        _run([*pip, TORCH])
    for peer in PEERS:
        env = locate(peer)
        print(f"{peer:14s} {env.python or 'missing: ' + env.reason}")
    return 0
