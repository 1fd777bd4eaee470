"""Fixtures for the web tests: one bundle (with the demo page) per module, and what the
browser and Node tests need, with the reason when it is missing (the tests skip visibly)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.web.bundle_fixture import make_bundle

REPO = Path(__file__).resolve().parents[2]
WEB = REPO / "web"
ORT_WEB = WEB / "node_modules" / "onnxruntime-web" / "package.json"


def missing_node_packages() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed (apt-get install nodejs); odt-web's tests need it"
    if not ORT_WEB.is_file():
        return f"onnxruntime-web is not installed in {WEB}: run `npm ci` there (.ci/run does)"
    return None


@pytest.fixture(scope="session")
def bundle_root(tmp_path_factory) -> Path:
    """make_bundle's folder: artifacts/, samples/ and bundle/ (with the page when npm ci has run)."""
    root = tmp_path_factory.mktemp("web")
    make_bundle(root, page=missing_node_packages() is None)
    return root
