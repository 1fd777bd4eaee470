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


def test_a_write_removes_what_a_killed_writer_left_and_nothing_else(tmp_path):
    """A writer killed mid-write leaves its temp file (the target itself stays whole); the next
    write of the same target removes it, but never a live writer's or another target's."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    from odt_ops.checkpoint import load_checkpoint

    target = tmp_path / "checkpoint"
    save_checkpoint(Checkpoint(parameters={"w": np.zeros(4, np.float32)}, requires_grad={"w": True}), target)
    # a real writer, killed with SIGKILL while its temp file is open
    script = textwrap.dedent(f"""
        import sys, time
        from odt_ops.io import atomic_writer
        with atomic_writer({str(target)!r}) as f:
            f.write(b"partial")
            f.flush()
            print("writing", flush=True)
            time.sleep(60)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    os.kill(writer.pid, signal.SIGKILL)
    writer.wait(timeout=30)
    leftovers = list(tmp_path.glob(".checkpoint.*.tmp"))
    assert len(leftovers) == 1
    live = tmp_path / f".checkpoint.{os.getpid()}.live.tmp"  # a writer that is still running
    other = tmp_path / ".other.1.dead.tmp"
    live.write_bytes(b"")
    other.write_bytes(b"")

    save_checkpoint(Checkpoint(parameters={"w": np.ones(4, np.float32)}, requires_grad={"w": True}), target)
    assert not leftovers[0].exists()
    assert live.exists()
    assert other.exists()
    np.testing.assert_array_equal(load_checkpoint(target).parameters["w"], np.ones(4, np.float32))
