"""The structure-aware fuzzer (tests/odt_ops/fuzz) over every reader and the use after it.

Each case damages one real file (checkpoint, trained checkpoint, nominal checkpoint, model
difference, the three artifacts, a forward model with external data, ONNX Runtime's checkpoint)
and uses the folder as a user would. It passes when every case ends well or with an odt_ops error
naming the damaged file, opens nothing outside its folder (CPython's audit events), and stays
within the time and tracemalloc bounds of tests/odt_ops/fuzz/run.py.

CI runs a small seeded scale; the release run is larger:

    ODT_FUZZ_CASES=5000 .venv/bin/python -m pytest tests/odt_ops/test_fuzz_files.py -q
    .venv/bin/python -m tests.odt_ops.fuzz.run --cases 5000 --seed 20   # the same, with counts by outcome
"""
from __future__ import annotations

import os

import pytest

from tests.odt_ops.fuzz.run import fuzz, summary
from tests.odt_ops.fuzz.watch import outside, watching

CASES = int(os.environ.get("ODT_FUZZ_CASES", "360"))  # 40 per damaged file: ~25 s on 2 loaded cores
SEED = int(os.environ.get("ODT_FUZZ_SEED", "20"))


def test_the_watcher_sees_reads_outside_a_folder(tmp_path):
    """The oracle itself: an open outside the folder, also through a symlink inside it, is seen."""
    (tmp_path / "folder").mkdir()
    (tmp_path / "secret").write_bytes(b"x")
    os.symlink(tmp_path / "secret", tmp_path / "folder" / "link")
    with watching() as opened:
        (tmp_path / "folder" / "link").read_bytes()
        fd = os.open(tmp_path / "secret", os.O_RDONLY)
        os.close(fd)
    assert len(outside(opened, tmp_path / "folder")) == 2


def test_damaged_files_end_well_or_in_our_errors_naming_the_file(tmp_path):
    results = fuzz(CASES, SEED, tmp_path)
    failures = [r for r in results if r.outcome not in ("ok", "typed")]
    if failures:
        first = "\n".join(f"case {r.index} {r.target} [{r.what}] {r.outcome}: {r.detail}" for r in failures[:10])
        pytest.fail(f"{summary(results)}\n{first}\nrerun one: python -m tests.odt_ops.fuzz.run --seed {SEED} --case N")
    # the cases reached past the containers: some were used fully, most were refused by our checks
    assert sum(r.outcome == "ok" for r in results) > CASES // 20
    assert sum(r.outcome == "typed" for r in results) > CASES // 2
