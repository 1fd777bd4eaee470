"""Checkpoint files: exact round trips, nominal checkpoints, and every way a file can be bad."""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import tracemalloc
import zipfile

import numpy as np
import pytest

from odt_ops.api import CheckpointState
from odt_ops.checkpoint import Checkpoint, OptimizerState, check_matches, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError, CheckpointFileNotFoundError

RNG = np.random.default_rng(0)


def sample() -> Checkpoint:
    return Checkpoint(
        parameters={"fc.weight": RNG.standard_normal((3, 4)).astype(np.float32), "fc.bias": RNG.standard_normal(3).astype(np.float32),
                    "emb": RNG.standard_normal((5, 2))},
        requires_grad={"fc.weight": True, "fc.bias": True, "emb": False},
        buffers={"bn.running_mean": RNG.standard_normal(4).astype(np.float32)},
        optimizer=OptimizerState(step=7, learning_rate=1e-3, initial_learning_rate=2e-3,
                                 states={"fc.weight": {"exp_avg": RNG.standard_normal((3, 4)).astype(np.float32)}}),
        properties={"epoch": 4, "best_accuracy": 0.875, "user": "alice", "big": 2**40},
    )


def test_round_trip_is_exact(tmp_path):
    ckpt = sample()
    save_checkpoint(ckpt, tmp_path / "ckpt")
    back = load_checkpoint(tmp_path / "ckpt")
    for name, value in ckpt.parameters.items():
        assert back.parameters[name].dtype == value.dtype
        np.testing.assert_array_equal(back.parameters[name], value)
        assert isinstance(back.parameters[name], np.memmap)  # tensors are mapped, not all read at once
    assert back.requires_grad == ckpt.requires_grad
    np.testing.assert_array_equal(back.buffers["bn.running_mean"], ckpt.buffers["bn.running_mean"])
    assert (back.optimizer.step, back.optimizer.learning_rate, back.optimizer.initial_learning_rate) == (7, 1e-3, 2e-3)
    np.testing.assert_array_equal(back.optimizer.states["fc.weight"]["exp_avg"], ckpt.optimizer.states["fc.weight"]["exp_avg"])
    assert back.properties == ckpt.properties
    assert all(type(back.properties[k]) is type(v) for k, v in ckpt.properties.items())


def test_optimizer_state_is_optional(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt", include_optimizer_state=False)
    assert load_checkpoint(tmp_path / "ckpt").optimizer is None


def test_nominal_checkpoint_has_specs_only(tmp_path):
    ckpt = sample()
    ckpt.parameters["big"] = np.ones((100, 100), np.float32)
    save_checkpoint(ckpt, tmp_path / "full")
    ckpt.make_nominal()
    save_checkpoint(ckpt, tmp_path / "nominal")
    back = load_checkpoint(tmp_path / "nominal")
    assert back.nominal
    assert back.spec("fc.weight") == ((3, 4), np.dtype(np.float32))
    assert back.parameters["fc.weight"].size == 0
    assert back.spec("big") == ((100, 100), np.dtype(np.float32))
    assert (tmp_path / "nominal").stat().st_size < (tmp_path / "full").stat().st_size / 4


def test_truncated_file_is_refused_with_its_name(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    data = (tmp_path / "ckpt").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(CheckpointError, match="cut"):
        load_checkpoint(tmp_path / "cut")


def test_flipped_byte_is_detected(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    data = bytearray((tmp_path / "ckpt").read_bytes())
    data[data.find(b"\x93NUMPY") + 140] ^= 0xFF  # inside the first tensor's data
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted"):
        load_checkpoint(tmp_path / "bad")


def _rewrite_manifest(src, dst, change):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "manifest.json":
                manifest = json.loads(data)
                change(manifest)
                data = json.dumps(manifest).encode()
            zout.writestr(info, data)


def test_newer_format_version_is_refused(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    _rewrite_manifest(tmp_path / "ckpt", tmp_path / "new", lambda m: m.update(format_version=99))
    with pytest.raises(CheckpointError, match="newer"):
        load_checkpoint(tmp_path / "new")


def test_pickled_objects_are_never_loaded(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    evil = tmp_path / "evil"
    with zipfile.ZipFile(tmp_path / "ckpt") as zin, zipfile.ZipFile(evil, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename == "t0.npy":
                import io
                buf = io.BytesIO()
                np.lib.format.write_array(buf, np.array([object()], dtype=object), allow_pickle=True)
                data = buf.getvalue()
            zout.writestr(info, data)
    with pytest.raises(CheckpointError):
        load_checkpoint(evil)


def test_failed_save_keeps_the_old_file(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    before = (tmp_path / "ckpt").read_bytes()
    bad = sample()
    bad.properties["oops"] = [1, 2]
    with pytest.raises(CheckpointError, match="oops"):
        save_checkpoint(bad, tmp_path / "ckpt")
    bad = sample()
    bad.parameters["fc.bias"] = np.array([object()], dtype=object)
    with pytest.raises(CheckpointError, match="fc.bias"):
        save_checkpoint(bad, tmp_path / "ckpt")
    assert (tmp_path / "ckpt").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp file left behind


def test_mismatch_names_every_parameter(tmp_path):
    ckpt = sample()
    expected = {"fc.weight": ((4, 4), np.dtype(np.float32)), "fc.bias": ((3,), np.dtype(np.float64)), "missing": ((1,), np.dtype(np.float32))}
    with pytest.raises(CheckpointError) as info:
        check_matches(ckpt, expected, "artifacts/checkpoint")
    text = str(info.value)
    assert "fc.weight" in text
    assert "fc.bias" in text
    assert "missing" in text
    assert "artifacts/checkpoint" in text


# ------------------------------------------------------------------------------------------- what is not a checkpoint file


@contextlib.contextmanager
def deadline(seconds: int):
    """Fail instead of hanging: SIGALRM interrupts a blocking open() or read() (a FIFO's)."""
    def expired(signum, frame):
        pytest.fail(f"still running after {seconds} s: the read blocks", pytrace=False)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _not_a_file(tmp_path, kind: str):
    """(path, what the message must say): paths a user (or a script) may hand over as a checkpoint."""
    path = tmp_path / "ckpt"
    if kind == "fifo":  # a plain open() of it blocks until a writer comes: forever
        os.mkfifo(path)
        return path, "a FIFO (named pipe), not a regular file: refused unread"
    if kind == "symlink to /dev/zero":  # a plain read of it never ends: memory runs out
        os.symlink("/dev/zero", path)
        return path, "a character device, not a regular file: refused unread"
    if kind == "/dev/zero":
        return "/dev/zero", "a character device, not a regular file: refused unread"
    if kind == "folder":
        path.mkdir()
        return path, "a folder, not a checkpoint file; name the checkpoint file in it"
    return path, "no such checkpoint file"


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "/dev/zero", "folder", "missing"])
@pytest.mark.parametrize("load", [load_checkpoint, CheckpointState.load_checkpoint], ids=["load_checkpoint", "CheckpointState"])
def test_a_fifo_a_device_or_a_folder_is_named_for_what_it_is_unread(tmp_path, kind, load):
    path, says = _not_a_file(tmp_path, kind)
    tracemalloc.start()
    try:
        with deadline(20), pytest.raises(CheckpointError) as info:
            load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == f"{path}: {says}" + ("; give the path of the checkpoint file itself" if "unread" in says else "")
    assert isinstance(info.value, CheckpointFileNotFoundError) == (kind == "missing")
    assert peak < 8 << 20, f"allocated {peak >> 20} MiB"


def test_a_symlink_to_a_checkpoint_is_followed(tmp_path):
    """A user's own path may be a symlink (DVC links its cache so): it is read when it leads to a file."""
    ckpt = sample()
    save_checkpoint(ckpt, tmp_path / "real")
    os.symlink(tmp_path / "real", tmp_path / "link")
    np.testing.assert_array_equal(load_checkpoint(tmp_path / "link").parameters["emb"], ckpt.parameters["emb"])


# ------------------------------------------------------------------------------------------- optimizer scalars


@pytest.mark.parametrize("key,value,says", [
    ("learning_rate", math.nan, "optimizer.learning_rate is nan"),
    ("learning_rate", -1e-3, "optimizer.learning_rate is -0.001"),
    ("learning_rate", "0.1", "optimizer.learning_rate is '0.1'"),
    ("learning_rate", True, "optimizer.learning_rate is True"),
    ("learning_rate", 10**400, f"optimizer.learning_rate is {'1' + '0' * 35}..."),  # past float's range
    ("initial_learning_rate", math.inf, "optimizer.initial_learning_rate is inf"),
    ("initial_learning_rate", None, "optimizer.initial_learning_rate is None"),
    ("step", -5, "optimizer.step is -5"),
    ("step", 2.5, "optimizer.step is 2.5"),
    ("step", 2**63, f"optimizer.step is {2**63}"),
    ("step", False, "optimizer.step is False"),
], ids=lambda v: str(v)[:12])
def test_bad_optimizer_scalars_are_refused_naming_the_file_and_key(tmp_path, key, value, says):
    """A NaN learning rate loaded silently made every parameter NaN at the first Optimizer.step();
    the Python API refuses such a rate (checked_learning_rate), and so does the checkpoint loader."""
    save_checkpoint(sample(), tmp_path / "ckpt")
    _rewrite_manifest(tmp_path / "ckpt", tmp_path / "bad", lambda m: m["optimizer"].update({key: value}))
    for load in (load_checkpoint, CheckpointState.load_checkpoint):
        with pytest.raises(CheckpointError) as info:
            load(tmp_path / "bad")
        text = str(info.value)
        assert text.startswith(f"{tmp_path / 'bad'}: {says}; "), text
        assert ("a learning rate is a finite number >= 0" if "rate" in key else "a step count is an integer from 0") in text


def test_a_missing_optimizer_scalar_is_named(tmp_path):
    save_checkpoint(sample(), tmp_path / "ckpt")
    _rewrite_manifest(tmp_path / "ckpt", tmp_path / "bad", lambda m: m["optimizer"].pop("step"))
    with pytest.raises(CheckpointError, match=r"bad: optimizer.step is missing; a step count"):
        load_checkpoint(tmp_path / "bad")


def test_a_zero_learning_rate_and_step_still_load(tmp_path):
    ckpt = sample()
    ckpt.optimizer.step, ckpt.optimizer.learning_rate, ckpt.optimizer.initial_learning_rate = 0, 0.0, 0.0
    save_checkpoint(ckpt, tmp_path / "ckpt")
    opt = load_checkpoint(tmp_path / "ckpt").optimizer
    assert (opt.step, opt.learning_rate, opt.initial_learning_rate) == (0, 0.0, 0.0)
