"""Gradient rules: convolution, pooling, normalization, resampling."""
from __future__ import annotations

import numpy as np

from odt_ops.grad.registry import gradient
