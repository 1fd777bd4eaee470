"""Fed corrupted checkpoints, model differences and artifacts, the readers either read them or
raise one of our typed errors naming the file; nothing else escapes (seeded mutations: byte
flips, truncation, and damage to the JSON manifests, the zip entries and the artifact metadata)."""
from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import onnx
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import load_checkpoint
from odt_ops.errors import OdtError
from odt_ops.export import load_diff, model_diff, save_diff
from tests.odt_ops.models import mlp

SEED = 20261125


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    d = tmp_path_factory.mktemp("originals")
    artifacts.generate_artifacts(mlp((6, 5, 3)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=d, opset=21)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    module(np.ones((2, 6), np.float32), np.zeros(2, np.int64))
    optimizer.step()
    state.properties["epoch"] = 1
    CheckpointState.save_checkpoint(state, d / "trained", include_optimizer_state=True)
    save_diff(model_diff(d / "checkpoint", d / "trained", num_examples=2), d / "update.odtdiff")
    return d


def _byte_damage(data: bytes, rng: np.random.Generator) -> bytes:
    kind = rng.integers(3)
    if kind == 0:  # flip a few bytes
        b = bytearray(data)
        for pos in rng.integers(0, len(b), rng.integers(1, 9)):
            b[pos] ^= int(rng.integers(1, 256))
        return bytes(b)
    if kind == 1:  # truncate
        return data[: int(rng.integers(0, len(data)))]
    return data + bytes(rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8))  # trailing garbage


_JUNK = [None, 0, -1, 1.5, "x", "", [], {}, [1, "a"], {"a": 1}, True, 2**70]


def _damage_json(value, rng: np.random.Generator):
    """One structural change somewhere in a JSON document: a key dropped or added, a value of
    another type."""
    if isinstance(value, dict) and value and rng.random() < 0.7:
        key = list(value)[rng.integers(len(value))]
        action = rng.integers(4)
        out = dict(value)
        if action == 0:
            del out[key]
        elif action == 1:
            out[key] = _JUNK[rng.integers(len(_JUNK))]
        elif action == 2:
            out[f"unexpected_{rng.integers(100)}"] = 1
        else:
            out[key] = _damage_json(value[key], rng)
        return out
    if isinstance(value, list) and value and rng.random() < 0.7:
        i = int(rng.integers(len(value)))
        return value[:i] + [_damage_json(value[i], rng)] + value[i + 1:]
    return _JUNK[rng.integers(len(_JUNK))]


def _manifest_damage(data: bytes, rng: np.random.Generator) -> bytes:
    """Rewrite the zip with its manifest damaged (JSON, encoding) or an entry stored oddly."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        members = [(info, zf.read(info)) for info in zf.infolist()]
    out = io.BytesIO()
    kind = rng.integers(4)
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zf:
        for info, body in members:
            compress = zipfile.ZIP_STORED
            if info.filename == "manifest.json":
                if kind == 0:
                    body = json.dumps(_damage_json(json.loads(body), rng)).encode()
                elif kind == 1:
                    body = body[: int(rng.integers(len(body)))]  # invalid JSON
                elif kind == 2:
                    body = b"\xff\xfe" + body  # not UTF-8
            elif kind == 3 and rng.random() < 0.5:
                compress = zipfile.ZIP_DEFLATED  # a tensor entry compressed
            zf.writestr(zipfile.ZipInfo(info.filename, date_time=(1980, 1, 1, 0, 0, 0)), body, compress_type=compress)
    result = bytearray(out.getvalue())
    if kind == 3 and rng.random() < 0.3:  # an unknown compression method in the central directory
        at = result.rfind(b"PK\x01\x02")
        result[at + 10:at + 12] = (99).to_bytes(2, "little")
    return bytes(result)


def _mutants(data: bytes, zip_based: bool, n: int, rng: np.random.Generator):
    for _ in range(n):
        yield _manifest_damage(data, rng) if zip_based and rng.random() < 0.5 else _byte_damage(data, rng)


def _escapes(read, path, mutants) -> list[str]:
    escaped = []
    for damaged in mutants:
        path.write_bytes(damaged)
        try:
            read(path)
        except OdtError as exc:
            assert str(path) in str(exc) or path.name in str(exc), f"the error does not name the file: {exc}"
        except Exception as exc:
            escaped.append(f"{type(exc).__name__}: {str(exc)[:120]}")
    return escaped


@pytest.mark.parametrize("kind", ["checkpoint", "diff"])
def test_corrupted_tensor_files_raise_typed_errors(originals, tmp_path, kind):
    source, read = {"checkpoint": ("trained", load_checkpoint), "diff": ("update.odtdiff", load_diff)}[kind]
    rng = np.random.default_rng(SEED)
    escaped = _escapes(read, tmp_path / source, _mutants((originals / source).read_bytes(), True, 1000, rng))
    assert not escaped, f"{len(escaped)} of 1000 escaped: {sorted(set(escaped))[:10]}"


def _with_metadata(model_bytes: bytes, rng: np.random.Generator) -> bytes:
    model = onnx.load_from_string(model_bytes)
    for prop in model.metadata_props:
        if prop.key.startswith("odt."):
            kind = rng.integers(3)
            if kind == 0:
                prop.value = json.dumps(_damage_json(json.loads(prop.value), rng))
            elif kind == 1:
                prop.value = prop.value[: int(rng.integers(len(prop.value)))]
            else:
                prop.value = prop.value.replace('"', "'", 1)  # single quotes: not JSON
    return model.SerializeToString()


@pytest.mark.parametrize("kind", ["training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"])
def test_corrupted_artifacts_raise_typed_errors(originals, tmp_path, kind):
    rng = np.random.default_rng(SEED)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"):
        (tmp_path / name).write_bytes((originals / name).read_bytes())

    def read(path):
        state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
        module = Module(tmp_path / "training_model.onnx", state, tmp_path / "eval_model.onnx")
        Optimizer(tmp_path / "optimizer_model.onnx", module)

    original = (originals / kind).read_bytes()
    mutants = [_with_metadata(original, rng) for _ in range(300)] + list(_mutants(original, False, 100, rng))
    escaped = _escapes(read, tmp_path / kind, mutants)
    assert not escaped, f"{len(escaped)} of {len(mutants)} escaped: {sorted(set(escaped))[:10]}"
