"""odt-web's unit tests (web/test/*.test.js) under Node's test runner, on this module's bundle."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.web.conftest import WEB, missing_node_packages


@pytest.mark.skipif(missing_node_packages() is not None, reason=str(missing_node_packages()))
def test_node_unit_tests_pass(bundle_root):
    env = {**os.environ, "ODT_WEB_BUNDLE": str(bundle_root / "bundle")}
    run = subprocess.run(["node", "--test", "test/"], cwd=WEB, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert "# fail 0" in run.stdout
