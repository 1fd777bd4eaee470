"""pipeline/io.py: a stage's output folder swapped in whole, even when the process is
killed in the middle of the swap; and the SHA256SUMS a stage leaves beside its outputs,
checked by coreutils' own sha256sum -c and by the readers."""
from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.errors import DataError
from pipeline.io import DIGESTS, publish_dir, verify_digest, write_digests

REPO = Path(__file__).resolve().parents[2]


def killed_while_publishing(target: Path, after: str) -> int:
    """Publish a new ``target`` in a child process killed (os._exit, no cleanup) right after
    the rename into ``.<name>.<after>-<pid>``; returns its exit code."""
    script = textwrap.dedent(f"""
        import os, sys
        from pathlib import Path
        from pipeline.io import publish_dir
        real = os.replace
        def replace(src, dst):
            real(src, dst)
            if Path(dst).name.startswith(".{target.name}.{after}-"):
                os._exit(9)  # killed here: no except, no finally
        os.replace = replace
        with publish_dir({str(target)!r}) as staging:
            (staging / "model.onnx").write_text("new")
    """)
    return subprocess.run([sys.executable, "-c", script], cwd=REPO).returncode


@pytest.mark.parametrize("after,content", [("old", "new"), ("ready", "old")], ids=["between-the-renames", "before-the-first"])
def test_a_swap_killed_half_way_is_finished_or_undone_by_the_next_run(tmp_path, after, content):
    target = tmp_path / "data" / "train"
    target.mkdir(parents=True)
    (target / "model.onnx").write_text("old")
    assert killed_while_publishing(target, after) == 9
    if after == "old":  # the crash the issue saw: no data/train at all, only the dot folders
        assert not target.exists()
        assert sorted(p.name.split("-")[0] for p in target.parent.iterdir()) == [".train.old", ".train.ready"]
    with publish_dir(target) as staging:  # the next run: it finds the half-done swap first
        (staging / "seen.txt").write_text((target / "model.onnx").read_text())
    assert (target / "seen.txt").read_text() == content  # the swap was finished (or undone) before the stage ran
    assert sorted(p.name for p in target.parent.iterdir()) == ["train"]  # no leftovers


def test_digests_are_sha256sum_compatible_and_catch_a_flipped_bit(tmp_path):
    out = tmp_path / "generate"
    out.mkdir()
    (out / "eval_model.onnx").write_bytes(bytes(range(256)) * 40)
    (out / "checkpoint").write_bytes(b"weights")
    (out / ".gitignore").write_text("/x\n")
    write_digests(out)
    if shutil.which("sha256sum"):
        check = subprocess.run(["sha256sum", "--strict", "-c", DIGESTS], cwd=out, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert check.stdout.count(": OK") == 2, check.stdout + check.stderr
    verify_digest(out / "eval_model.onnx")  # unchanged: no error
    data = bytearray((out / "eval_model.onnx").read_bytes())
    data[1000] ^= 0x01
    (out / "eval_model.onnx").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"eval_model.onnx: changed after its stage wrote it .* dvc checkout"):
        verify_digest(out / "eval_model.onnx")
