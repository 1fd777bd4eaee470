"""Suite-wide settings. Under CI (CI=true) hypothesis draws the same examples on every run, so a
landing never depends on luck; locally it keeps exploring new ones."""
import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, deadline=None)
if os.environ.get("CI"):
    settings.load_profile("ci")
