"""Bad input to a stage is one line on stderr naming the file (or the key) and the fix,
never a traceback: damaged models between stages, forged or oversized user data, a CSV
from Excel (read, not refused), a learning rate that is not a finite positive number;
and files dropped into data/user are used, or one line says why not."""
from __future__ import annotations

import importlib
import struct
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest

from pipeline import prepare
from pipeline.io import DIGESTS, load_npz
from pipeline.paths import Paths
from tests.pipeline.conftest import TINY, TINY_RUN, copy_outputs

ARGS = ["tracking=disabled", *TINY_RUN]


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def truncate(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path):
    path.write_bytes(b"\x08\x07garbage, not a protobuf\xff\xff\xff")


@pytest.mark.parametrize(
    "stage,rel,damage",
    [("pretrain", "data/convert/base.onnx", truncate), ("pretrain", "data/convert/base.onnx", garbage),
     ("train", "data/generate/training_model.onnx", truncate), ("train", "data/generate/training_model.onnx", garbage),
     ("export", "data/generate/training_model.onnx", truncate), ("generate", "data/pretrain/base.onnx", garbage)],
    ids=["truncated-base", "garbage-base", "truncated-training-model", "garbage-training-model", "export-truncated-training-model",
         "garbage-pretrained"],
)
@pytest.mark.parametrize("digests", [True, False], ids=["recorded", "no-record"])
def test_a_damaged_model_handed_to_a_stage_is_one_line(project, tiny_run, capsys, stage, rel, damage, digests):
    copy_outputs(tiny_run, project)
    damage(project / rel)
    if not digests:  # without SHA256SUMS, the stage must still fail cleanly when it parses the file
        (project / rel).with_name(DIGESTS).unlink(missing_ok=True)
    assert importlib.import_module(f"pipeline.{stage}").main(ARGS) == 1
    line = one_line(capsys)
    assert line.startswith(f"{stage}: error: "), line
    assert rel in line, line


def test_a_flipped_bit_in_eval_model_is_refused_by_export(project, tiny_run, capsys):
    paths = copy_outputs(tiny_run, project)
    data = bytearray(paths.artifacts.eval_model.read_bytes())
    data[len(data) // 2] ^= 0x10
    paths.artifacts.eval_model.write_bytes(bytes(data))
    assert importlib.import_module("pipeline.export").main(ARGS) == 1
    line = one_line(capsys)
    assert "data/generate/eval_model.onnx: changed after its stage wrote it" in line, line
    assert "dvc checkout" in line, line


@pytest.mark.parametrize("value", ["inf", "nan", "-0.1", "0"])
def test_a_learning_rate_that_is_not_finite_and_positive_is_a_configuration_error(project, capsys, value):
    assert importlib.import_module("pipeline.train").main(["tracking=disabled", f"optimizer.lr={value}"]) == 2
    line = one_line(capsys)
    assert "optimizer.lr=" in line, line
    assert "a finite number > 0" in line, line


# --------------------------------------------------------------------------- the user's data


def forged_npz(path, n=10**12):
    """An .npz whose x header declares ``n`` float32 values but holds a few bytes."""
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (n,)
    with zipfile.ZipFile(path, "w") as zf:
        with zf.open("x.npy", "w") as f:
            np.lib.format.write_array_header_1_0(f, header)
            f.write(b"\0" * 16)
        with zf.open("y.npy", "w") as f:
            np.lib.format.write_array(f, np.zeros(1, np.int64))


def header_bomb_npz(path, header_bytes=64 * 2**20):
    """An .npz whose deflated x.npy declares a ``header_bytes`` header (format 2.0: a 4-byte length):
    a few kilobytes on disk that numpy would read whole before its own header limit applies."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        with zf.open("x.npy", "w") as f:
            f.write(b"\x93NUMPY\x02\x00" + struct.pack("<I", header_bytes))
            for _ in range(header_bytes // 2**20):
                f.write(b" " * 2**20)
        with zf.open("y.npy", "w") as f:
            np.lib.format.write_array(f, np.zeros(1, np.int64))


def png_header_only(path, width, height):
    """A PNG that declares ``width`` x ``height`` pixels (Pillow reads the size from IHDR)."""
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_user_data_that_would_exhaust_memory_is_one_line(project, capsys):
    pytest.importorskip("PIL")
    user = project / "data" / "user"
    (user / "big" / "3").mkdir(parents=True)
    forged_npz(user / "forged.npz")
    png_header_only(user / "big" / "3" / "bomb.png", 20000, 20000)  # Pillow's own limit refuses it
    (user / "big" / "4").mkdir()
    png_header_only(user / "big" / "4" / "large.png", 5000, 5000)  # below Pillow's limit, above ours
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/forged.npz"]) == 1
    line = one_line(capsys)
    assert "forged.npz" in line, line
    assert "declares shape [1000000000000]" in line, line
    header_bomb_npz(user / "header.npz")
    assert (user / "header.npz").stat().st_size < 2**20
    tracemalloc.start()
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/header.npz"]) == 1
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    line = one_line(capsys)
    assert "header.npz" in line and "declares a 67,108,864-byte header" in line, line
    assert peak < 16 * 2**20, peak  # the declared header was never read
    # a CSV whose header has 200,000 columns over one-field rows: refused at its first row, before any array
    (user / "wide.csv").write_text("label," + ",".join(f"p{i}" for i in range(199_999)) + "\n" + "1\n" * 200_000)
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/wide.csv"]) == 1
    line = one_line(capsys)
    assert "wide.csv: line 2 has 1 fields, the header has 200000" in line, line
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/big"]) == 1
    line = one_line(capsys)
    assert "bomb.png" in line, line
    assert "decompression bomb" in line, line
    (user / "big" / "3" / "bomb.png").unlink()
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/big"]) == 1
    line = one_line(capsys)
    assert "large.png" in line, line
    assert "5000x5000" in line, line
    assert "decompression bomb" in line, line


def test_a_csv_saved_by_excel_with_a_byte_order_mark_is_read(tmp_path):
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 17, (20, 64)), np.arange(20) % 10
    lines = ["label," + ",".join(f"p{i}" for i in range(64))] + [f"{c}," + ",".join(map(str, row)) for c, row in zip(y, x)]
    (tmp_path / "excel.csv").write_bytes("\r\n".join(lines).encode("utf-8-sig"))  # what Excel's "CSV UTF-8" writes
    paths = Paths(tmp_path)
    from tests.pipeline.conftest import load_cfg

    m = prepare.run(load_cfg("data.user_data=excel.csv", "data.pixel_max=16"), paths)
    assert m["n_user_train"] + m["n_user_holdout"] == 20
    got = np.concatenate([load_npz(paths.split(s))["x"].reshape(-1, 64) for s in ("user_train", "user_holdout")])
    assert sorted(map(tuple, np.round(got * 16).astype(int))) == sorted(map(tuple, x))


def test_files_dropped_into_data_user_are_used_or_one_line_says_why_not(project, capsys):
    user = project / "data" / "user"
    user.mkdir(parents=True)
    (user / "README.md").write_text("notes")
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 17, (40, 64)) / 16.0, np.arange(40) % 10
    np.savez(user / "day1.npz", x=x[:20], y=y[:20])
    np.savez(user / "day2.npz", x=x[20:], y=y[20:])
    assert prepare.main(["tracking=disabled", *TINY]) == 0  # data.user_data is null: the dropped files are the user's data
    err = capsys.readouterr().err
    assert "2 file(s) in data/user (npz) are the user's data" in err, err
    paths = Paths(project)
    got = np.concatenate([load_npz(paths.split(s))["x"].reshape(-1, 64) for s in ("user_train", "user_holdout")])
    assert sorted(map(tuple, got)) == sorted(map(tuple, x.astype(np.float32)))

    (user / "notes.txt").write_text("not data")  # a file of no known kind: said, and the simulated user stands in
    assert prepare.main(["tracking=disabled", *TINY]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prepare: not using")]
    assert len(err) == 1, err
    assert "notes.txt" in err[0], err
    assert "data.user_data" in err[0], err
    assert len(load_npz(paths.split("user_train"))["y"]) == 30  # TINY's simulated user: 3 per class
