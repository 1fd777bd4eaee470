"""Kernels: shape and indexing (Reshape, Transpose, Concat, Gather, Slice, ...) and constants."""
from __future__ import annotations

import numpy as np

from odt_ops.kernels.registry import kernel


@kernel("Constant", since=1)
def constant(*, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None,
             value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return (np.asarray(value),)
    if sparse_value is not None:
        return (np.asarray(sparse_value),)
    if value_float is not None:
        return (np.array(value_float, dtype=np.float32),)
    if value_floats is not None:
        return (np.array(value_floats, dtype=np.float32),)
    if value_int is not None:
        return (np.array(value_int, dtype=np.int64),)
    if value_ints is not None:
        return (np.array(value_ints, dtype=np.int64),)
    if value_string is not None:
        return (np.array(value_string, dtype=object),)
    if value_strings is not None:
        return (np.array(value_strings, dtype=object),)
    raise ValueError("Constant has none of its value attributes set")
