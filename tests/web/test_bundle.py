"""The web bundle (python -m odt_ops export-web) against what it was made from: the artifact
files' own bytes and hashes, the checkpoint as odt_ops reads it, and odt's diff format."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from odt_ops.__main__ import main
from odt_ops.checkpoint import load_checkpoint
from odt_ops.errors import WebBundleError
from odt_ops.export import apply_diff, model_diff, save_diff
from odt_ops.web_bundle import BINARY, MANIFEST, write_web_bundle


def _manifest(bundle):
    return json.loads((bundle / MANIFEST).read_text()), (bundle / BINARY).read_bytes()


def test_models_are_the_artifact_files_byte_for_byte_with_their_sha256(bundle_root):
    manifest, blob = _manifest(bundle_root / "bundle")
    assert manifest["binary"]["sha256"] == hashlib.sha256(blob).hexdigest()
    assert manifest["binary"]["bytes"] == len(blob)
    for role, entry in manifest["models"].items():
        original = (bundle_root / "artifacts" / entry["file"]).read_bytes()
        assert blob[entry["offset"] : entry["offset"] + entry["bytes"]] == original, role
        assert entry["sha256"] == hashlib.sha256(original).hexdigest()


def test_tensors_are_the_checkpoint_values_and_samples_the_npz_values(bundle_root):
    manifest, blob = _manifest(bundle_root / "bundle")
    ckpt = load_checkpoint(bundle_root / "artifacts" / "checkpoint")

    def read(entry):
        assert entry["offset"] % 8 == 0  # a typed array views it in place
        return np.frombuffer(blob, np.dtype(entry["dtype"]).newbyteorder("<"), int(np.prod(entry["shape"])), entry["offset"]).reshape(entry["shape"])

    params = [t for t in manifest["tensors"] if t["kind"] == "parameter"]
    assert {t["name"] for t in params} == set(ckpt.parameters)
    for t in params:
        np.testing.assert_array_equal(read(t), ckpt.parameters[t["name"]])
        assert t["trainable"] == ckpt.requires_grad[t["name"]]
    for name in ("train", "holdout"):
        with np.load(bundle_root / "samples" / f"{name}.npz") as data:
            np.testing.assert_array_equal(read(manifest["samples"][name]["x"]), data["x"])
            np.testing.assert_array_equal(read(manifest["samples"][name]["y"]), data["y"])


def test_base_hash_is_what_apply_diff_checks(bundle_root, tmp_path):
    manifest, _ = _manifest(bundle_root / "bundle")
    base = load_checkpoint(bundle_root / "artifacts" / "checkpoint")
    trained = load_checkpoint(bundle_root / "artifacts" / "checkpoint")
    trained.parameters = {n: np.array(a) + np.float32(0.5) for n, a in trained.parameters.items()}
    diff = model_diff(base, trained)
    assert diff.base_hash == manifest["base_hash"]
    save_diff(diff, tmp_path / "d.odtdiff")
    apply_diff(base, tmp_path / "d.odtdiff")  # the same base: accepted


def test_object_arrays_in_samples_are_refused_not_unpickled(bundle_root, tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, x=np.array([object()], dtype=object), y=np.array([1]))
    with pytest.raises(WebBundleError, match="bad.npz"):
        write_web_bundle(bundle_root / "artifacts", tmp_path / "out", samples={"train": bad})


def test_samples_of_another_shape_than_the_model_input_are_refused(bundle_root, tmp_path):
    wrong = tmp_path / "wrong.npz"
    np.savez(wrong, x=np.zeros((4, 1, 28, 28), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(WebBundleError, match=r"wrong.npz: the 'train' samples are \[1, 28, 28\] each, the model's input 'x' takes \[1, 8, 8\]"):
        write_web_bundle(bundle_root / "artifacts", tmp_path / "out", samples={"train": wrong})


def test_page_without_npm_ci_names_the_fix(bundle_root, tmp_path):
    with pytest.raises(WebBundleError, match="npm ci"):
        write_web_bundle(bundle_root / "artifacts", tmp_path / "out", page=True, web_dir=tmp_path / "empty-web")


def test_cli_writes_the_bundle_and_reports_a_missing_artifact(bundle_root, tmp_path, capsys):
    assert main(["export-web", str(bundle_root / "artifacts"), str(tmp_path / "out"), "--no-page"]) == 0
    assert (tmp_path / "out" / MANIFEST).is_file()
    assert (tmp_path / "out" / BINARY).is_file()
    assert main(["export-web", str(tmp_path), str(tmp_path / "out2"), "--no-page"]) == 2
    assert "training_model.onnx" in capsys.readouterr().err
    # an output folder the system refuses (a file is there): one line naming it, not a traceback
    (tmp_path / "a_file").write_text("mine")
    assert main(["export-web", str(bundle_root / "artifacts"), str(tmp_path / "a_file"), "--no-page"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {tmp_path / 'a_file'}: File exists; choose a path you can read or write"]
    assert (tmp_path / "a_file").read_text() == "mine"
