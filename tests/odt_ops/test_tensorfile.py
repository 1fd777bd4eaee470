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
