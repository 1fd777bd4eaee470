"""Every file a stage reads from an earlier stage is checked against the sha256 that stage
recorded when it wrote it: each stage's folder has a SHA256SUMS in sha256sum's format
(checked here with hashlib), and one bit flipped in any file a later stage reads stops that
stage with one line naming the file, its outputs untouched."""
from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

import pytest

from tests.pipeline.conftest import TINY_RUN

STAGES = ("prepare", "convert", "pretrain", "generate", "train", "evaluate", "export")
# (a file one stage writes, a later stage that reads it): every artifact handed on but prepare's
# other splits (read by the same loader as user_train)
READS = (
    ("data/prepare/user_train.npz", "train"),
    ("data/convert/base.onnx", "pretrain"),
    ("data/pretrain/base.onnx", "generate"),
    ("data/pretrain/base.onnx", "evaluate"),
    ("data/generate/training_model.onnx", "train"),
    ("data/generate/eval_model.onnx", "export"),
    ("data/generate/optimizer_model.onnx", "train"),
    ("data/generate/checkpoint", "evaluate"),
    ("data/train/checkpoint", "evaluate"),
    ("data/train/checkpoint", "export"),
)


def _main(stage: str) -> int:
    return importlib.import_module(f"pipeline.{stage}").main(["tracking=disabled", *TINY_RUN])


def test_a_flipped_bit_in_any_file_a_stage_reads_is_one_line_naming_it(project, capsys):
    for stage in STAGES:
        assert _main(stage) == 0, stage
    # each stage's SHA256SUMS lists every file it wrote (dotfiles aside), with the right digest
    for stage in STAGES:
        out = project / "data" / stage
        listed = {}
        for line in (out / "SHA256SUMS").read_text(encoding="utf-8").splitlines():
            digest, name = line.split("  ", 1)
            listed[name] = digest
        files = {p.relative_to(out).as_posix(): p for p in out.rglob("*")
                 if p.is_file() and p.name != "SHA256SUMS" and not p.name.startswith(".")}
        assert set(listed) == set(files), stage
        for name, path in files.items():
            assert listed[name] == hashlib.sha256(path.read_bytes()).hexdigest(), f"{stage}/{name}"
    capsys.readouterr()

    for rel, reader in READS:
        path = project / rel
        original = path.read_bytes()
        outputs = {p: p.read_bytes() for p in (project / "data" / reader).rglob("*") if p.is_file()}
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01  # one bit, mid-file
        path.write_bytes(bytes(flipped))
        try:
            assert _main(reader) == 1, f"{reader} read a changed {rel}"
        finally:
            path.write_bytes(original)
        err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert len(err) == 1, (rel, reader, err)
        assert err[0].startswith(f"{reader}: error: {rel}: changed after its stage wrote it"), (rel, reader, err)
        assert {p: p.read_bytes() for p in (project / "data" / reader).rglob("*") if p.is_file()} == outputs, reader
    # restored, each reads again
    assert _main("evaluate") == 0


@pytest.mark.parametrize("stage", ["pretrain", "train", "evaluate", "export", "federate"])
def test_stages_with_file_outputs_give_dvc_their_sha256sums(stage):
    """Where a stage's DVC outs are single files, SHA256SUMS is one of them, so `dvc checkout`
    of another experiment restores the record with the files (a stale one would refuse them)."""
    import yaml

    from tests.pipeline.conftest import REPO

    block = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"][stage]
    outs = {next(iter(e)) if isinstance(e, dict) else e for e in block.get("outs", [])}
    assert f"data/{stage}/SHA256SUMS" in outs
    assert "/SHA256SUMS" in (Path(REPO) / "data" / stage / ".gitignore").read_text(encoding="utf-8").split()
