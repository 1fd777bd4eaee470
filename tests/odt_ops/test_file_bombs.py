"""Bombs in checkpoints, nominal checkpoints and model differences are refused at once.

A deflate bomb (a manifest or tensor member that inflates to gigabytes), a member whose declared
size disagrees with the file, and an npy header declaring 2**40 elements are each refused
before anything is inflated or mapped: under a second, with Python-level allocations (which
tracemalloc sees: zlib's output, json's and numpy's buffers) under 32 MiB. The bombs are built
by hand (tests/odt_ops/fuzz/zipcraft.py); their inflated size is checked with zlib, the oracle."""
from __future__ import annotations

import json
import time
import tracemalloc
import zlib

import numpy as np
import pytest

from odt_ops.checkpoint import Checkpoint, OptimizerState, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError, ModelDiffError, OdtError
from odt_ops.export import ModelDiff, apply_diff, load_diff, save_diff
from tests.odt_ops.fuzz import zipcraft

MANIFEST_BOMB = int(2.5 * 2**30)  # the size in issue 20
TENSOR_BOMB = 2**32 - 1  # the largest member a zip without zip64 declares


def _checkpoint(nominal: bool) -> Checkpoint:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}
    ckpt = Checkpoint(parameters=params, requires_grad={"w": True, "b": True},
                      optimizer=OptimizerState(1, 0.1, 0.1, {n: {"momentum": np.zeros_like(a)} for n, a in params.items()}))
    if nominal:
        ckpt.make_nominal()
    return ckpt


@pytest.fixture(params=["checkpoint", "nominal checkpoint", "model difference"])
def original(request, tmp_path):
    """(path of a valid file, its reader, the error it raises)."""
    path = tmp_path / "original"
    if request.param == "model difference":
        save_diff(ModelDiff({"w": np.ones((4, 3), np.float32)}, "0" * 64, 3, 1), path)
        return path, load_diff, ModelDiffError
    save_checkpoint(_checkpoint(request.param == "nominal checkpoint"), path)
    return path, load_checkpoint, CheckpointError


def _refused_fast(read, path, error) -> str:
    tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(error) as info:
            read(path)
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(path) in str(info.value)
    assert elapsed < 1.0, f"took {elapsed:.1f} s"
    assert peak < 32 << 20, f"allocated {peak >> 20} MiB"
    return str(info.value)


def _replace(path, name: str, member: zipcraft.Member) -> None:
    members = zipcraft.read_members(path.read_bytes())
    assert any(m.name == name for m in members)
    path.write_bytes(zipcraft.build([member if m.name == name else m for m in members]))


def test_a_deflate_bomb_manifest_is_refused_unread(original):
    path, read, error = original
    manifest = next(m for m in zipcraft.read_members(path.read_bytes()) if m.name == "manifest.json")
    bomb = zipcraft.deflate_bomb(MANIFEST_BOMB, manifest.data[:-1] + b', "pad": "')
    assert zlib.decompressobj(-15).decompress(bomb, 1 << 20)[:1] == b"{"  # a real deflate stream
    _replace(path, "manifest.json", zipcraft.Member("manifest.json", bomb, zipcraft.DEFLATED, crc=0, file_size=MANIFEST_BOMB))
    assert "compressed" in _refused_fast(read, path, error)


def test_a_deflate_bomb_tensor_is_refused_unread(original):
    path, read, error = original
    _replace(path, "t0.npy", zipcraft.Member("t0.npy", zipcraft.deflate_bomb(TENSOR_BOMB), zipcraft.DEFLATED, crc=0,
                                             file_size=TENSOR_BOMB))
    assert "compressed" in _refused_fast(read, path, error)


def test_a_member_declaring_more_bytes_than_the_file_holds_is_refused(original):
    path, read, error = original
    member = next(m for m in zipcraft.read_members(path.read_bytes()) if m.name == "t0.npy")
    _replace(path, "t0.npy", zipcraft.Member("t0.npy", member.data, file_size=2**31))
    _refused_fast(read, path, error)


def _npy(shape: tuple[int, ...], body: bytes) -> bytes:
    header = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {shape!r}, }}"
    header += " " * (63 - (10 + len(header)) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + body


@pytest.mark.parametrize("manifest_agrees", [True, False])
def test_an_npy_header_declaring_2_to_the_40_elements_is_refused_before_mapping(original, manifest_agrees):
    path, read, error = original
    members = zipcraft.read_members(path.read_bytes())
    if manifest_agrees:  # the manifest says so too: only the member's size gives it away
        manifest = json.loads(next(m.data for m in members if m.name == "manifest.json"))
        manifest["tensors"][0]["shape"] = [2**40]
        manifest["tensors"][0]["dtype"] = "<f4"
        members = [zipcraft.Member(m.name, json.dumps(manifest).encode()) if m.name == "manifest.json" else m for m in members]
    members = [zipcraft.Member("t0.npy", _npy((2**40,), b"\0" * 64)) if m.name == "t0.npy" else m for m in members]
    path.write_bytes(zipcraft.build(members))
    _refused_fast(read, path, error)


@pytest.mark.parametrize("shape", [(0, 2**63 - 1), (0, 10**30), (2**40, 0, 2**40)], ids=["0x2**63-1", "0x10**30", "2**40x0x2**40"])
def test_an_empty_tensor_with_a_huge_dimension_is_refused_before_numpy_sees_it(original, shape):
    """No values, so the member's size matches (0 bytes of data); numpy refuses to make even an empty
    array with such a dimension ("array is too big", "Maximum allowed dimension exceeded")."""
    path, read, error = original
    members = zipcraft.read_members(path.read_bytes())
    manifest = json.loads(next(m.data for m in members if m.name == "manifest.json"))
    manifest["tensors"][0].update(shape=list(shape), dtype="<f4")  # the manifest agrees with the header
    members = [zipcraft.Member(m.name, json.dumps(manifest).encode()) if m.name == "manifest.json"
               else zipcraft.Member("t0.npy", _npy(shape, b"")) if m.name == "t0.npy" else m for m in members]
    path.write_bytes(zipcraft.build(members))
    text = _refused_fast(read, path, error)
    assert f"{path}: tensor {manifest['tensors'][0]['name']!r}: shape [" in text
    assert "spans more than 2**40 bytes (it holds no values, yet numpy cannot even make it empty)" in text
    if error is ModelDiffError:  # applying it reads it the same way
        base = _checkpoint(False)
        _refused_fast(lambda p: apply_diff(base, p), path, error)


def test_a_nominal_parameter_declaring_a_huge_shape_is_refused(tmp_path):
    """A nominal checkpoint's parameters are a declared shape and dtype (a spec), made only when the
    values are copied in: the declaration is checked on load."""
    path = tmp_path / "nominal"
    save_checkpoint(_checkpoint(True), path)
    members = zipcraft.read_members(path.read_bytes())
    manifest = json.loads(next(m.data for m in members if m.name == "manifest.json"))
    specs = [e for e in manifest["tensors"] if "spec" in e]
    for shape, says in (([0, 2**63 - 1], "spans more than 2**40 bytes"), ([-1, 3], "has a negative dimension"),
                        (["4", 3], "is not a list of integers"), ([1] * 33, "33 dimensions")):
        specs[0]["spec"]["shape"] = shape
        path.write_bytes(zipcraft.build([zipcraft.Member(m.name, json.dumps(manifest).encode()) if m.name == "manifest.json"
                                         else m for m in members]))
        assert f"{path}: parameter {specs[0]['name']!r}: " in _refused_fast(load_checkpoint, path, CheckpointError)
        assert says in _refused_fast(load_checkpoint, path, CheckpointError)


@pytest.mark.parametrize("header", [b"{'descr': '<f4', 'fortran_order': False, 'shape': (((((((", b"[" * 5000,
                                    b"{'descr': '(2,)<f4', 'fortran_order': False, 'shape': (3,), }",
                                    b"{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (3,), }",
                                    b"\xff\xfe{'descr'", b"{'descr': '<f4', 'fortran_order': 0, 'shape': (-1,), }"])
def test_an_npy_header_the_tokenizer_cannot_parse_is_ours(original, header):
    path, read, error = original
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    body = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header + b"\0" * 48
    members = [zipcraft.Member("t0.npy", body) if m.name == "t0.npy" else m for m in zipcraft.read_members(path.read_bytes())]
    path.write_bytes(zipcraft.build(members))
    _refused_fast(read, path, error)


def test_deep_json_in_a_manifest_is_ours(original):
    path, read, error = original
    members = zipcraft.read_members(path.read_bytes())
    deep = b"[" * 100_000 + b"]" * 100_000
    path.write_bytes(zipcraft.build([zipcraft.Member(m.name, deep) if m.name == "manifest.json" else m for m in members]))
    with pytest.raises(OdtError, match=str(path)):
        read(path)
