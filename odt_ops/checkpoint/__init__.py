"""The checkpoint: one file holding everything training needs to resume exactly.

One state (``state.py``: ``Checkpoint``, ``OptimizerState``), two formats that read into it:
ours (``native.py``, which is also the only one written) and ONNX Runtime's training checkpoint
(``ort.py``, a FlatBuffer read through ``flatbuffer.py``), told apart by ONNX Runtime's file
identifier.
"""
from __future__ import annotations

import os

from odt_ops.checkpoint.native import FORMAT, FORMAT_VERSION, read_checkpoint, save_checkpoint
from odt_ops.checkpoint.ort import is_ort_header, read_ort_checkpoint
from odt_ops.checkpoint.state import ENGINE_RNG, Checkpoint, OptimizerState, Property, check_matches
from odt_ops.errors import CheckpointError
from odt_ops.tensorfile import open_input


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint, ours or ONNX Runtime's (FlatBuffer "ODTC"), verifying every member.

    A missing path, a folder and anything but a regular file (a FIFO, /dev/zero) are refused
    with a CheckpointError naming them, unread."""
    with open_input(path, CheckpointError, "checkpoint") as f:
        head = f.read(8)
    if is_ort_header(head):
        return read_ort_checkpoint(path)
    return read_checkpoint(path)


__all__ = ["ENGINE_RNG", "FORMAT", "FORMAT_VERSION", "Checkpoint", "OptimizerState", "Property", "check_matches",
           "load_checkpoint", "save_checkpoint"]
