"""Fixtures shared by the engine's tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def one_torch_thread():
    """Tiny models: torch is fastest, and CI least contended, on one thread (its small kernels
    are slowest when threads contend for the two CPUs)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
