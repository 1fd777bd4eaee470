"""Checkpoint files: exact round trips, nominal checkpoints, and every way a file can be bad."""
from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from odt_ops.checkpoint import Checkpoint, OptimizerState, check_matches, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError

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
