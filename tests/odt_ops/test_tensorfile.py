"""Tensor files are reproducible: the same tensors always give the same bytes (DVC hashes outputs)."""
import time

import numpy as np

from odt_ops.checkpoint import Checkpoint, save_checkpoint


def test_same_checkpoint_same_bytes(tmp_path):
    ckpt = Checkpoint(parameters={"w": np.arange(6, dtype=np.float32)}, requires_grad={"w": True}, properties={"epoch": 1})
    save_checkpoint(ckpt, tmp_path / "a")
    time.sleep(2.1)  # zip timestamps have two-second resolution
    save_checkpoint(ckpt, tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()


def test_atomic_writes_honour_the_umask(tmp_path):
    import os

    from odt_ops.io import atomic_write_bytes

    old = os.umask(0o022)
    try:
        atomic_write_bytes(tmp_path / "out", b"data")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o644
