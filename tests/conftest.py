"""Suite-wide settings. Under CI (CI=true) hypothesis draws the same examples on every run, so a
landing never depends on luck; locally it keeps exploring new ones. The engine's per-machine
record of matrix-product choices (kernels/products.py) goes to a folder of the run's own, so the
suite neither reads a developer's record nor leaves one behind."""
import os
import tempfile
from pathlib import Path

from hypothesis import settings

from tests.fd_coverage import FiniteDifferenceCoverage

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")

os.environ.setdefault("ODT_CACHE_DIR", tempfile.mkdtemp(prefix="odt-test-cache-"))


def pytest_configure(config):
    # a session that runs every finite-difference test fails if a gradient rule went unchecked
    config.pluginmanager.register(FiniteDifferenceCoverage(config, Path(__file__).parent / "odt_ops"), "fd-coverage")
