"""The `odt` console script as its users expect: installed where pip puts console scripts
(the distribution's own entry-point metadata is the oracle), its help naming itself, and
`--version` printing the installed distribution's version."""
from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

try:
    DIST = distribution("odt")
except PackageNotFoundError:  # pragma: no cover - the README's install makes it
    DIST = None

pytestmark = pytest.mark.skipif(DIST is None, reason="SKIPPED: the odt distribution is not installed (pip install -e .)")


def script() -> Path:
    (entry,) = [e for e in DIST.entry_points if e.group == "console_scripts" and e.name == "odt"]
    assert entry.value == "odt_ops.__main__:main"
    path = Path(sys.executable).parent / "odt"
    if not path.exists():
        pytest.skip(f"SKIPPED: no console script at {path} (this interpreter is not the one odt was installed into)")
    return path


def test_help_names_the_command_as_typed():
    out = subprocess.run([str(script()), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("usage: odt "), out.stdout
    assert "__main__" not in out.stdout
    out = subprocess.run([sys.executable, "-m", "odt_ops", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    assert out.stdout.startswith("usage: python -m odt_ops "), out.stdout


def test_version_is_the_installed_distributions():
    out = subprocess.run([str(script()), "--version"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    assert out.stdout.strip() == f"odt {DIST.version}", out.stdout
