"""Kernels: linalg."""
from __future__ import annotations

import numpy as np

from odt_ops.kernels.registry import kernel
