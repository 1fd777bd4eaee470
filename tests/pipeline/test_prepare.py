"""prepare: deterministic splits of the real digits, a user whose handwriting a
globally trained model reads clearly worse, and the user's own data formats."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from pipeline import prepare
from pipeline.errors import DataError
from pipeline.io import load_npz
from pipeline.paths import SPLITS, Paths
from tests.pipeline.conftest import TINY, load_cfg


def digest(paths: Paths) -> dict[str, str]:
    return {name: hashlib.sha256(paths.split(name).read_bytes()).hexdigest() for name in SPLITS}


def test_tiny_run_is_deterministic_and_well_formed(tmp_path):
    cfg = load_cfg(*TINY)
    a, b = Paths(tmp_path / "a"), Paths(tmp_path / "b")
    metrics = prepare.run(cfg, a)
    prepare.run(cfg, b)
    assert digest(a) == digest(b)
    assert metrics["n_user_train"] == 30
    assert metrics["n_user_train"] + metrics["n_user_holdout"] == 100
    assert metrics["n_global_train"] + metrics["n_global_test"] == 1797 - 100
    for name in SPLITS:
        data = load_npz(a.split(name))
        x, y = data["x"], data["y"]
        assert x.dtype == np.float32
        assert x.shape[1:] == (1, 8, 8)
        assert x.min() >= 0
        assert x.max() <= 1
        assert y.dtype == np.int64
        assert len(x) == len(y)
        assert set(np.unique(y)) <= set(range(10))
    assert np.bincount(load_npz(a.split("user_train"))["y"], minlength=10).tolist() == [3] * 10
    # another seed, other splits
    prepare.run(load_cfg(*TINY, "seed=1"), c := Paths(tmp_path / "c"))
    assert digest(c) != digest(a)


def test_the_user_shift_is_real(prepared):
    """A model fit on the cloud's data reads the user's handwriting clearly worse, and
    the user's own labelled digits carry what it misses (the room personalization has)."""
    from sklearn.linear_model import LogisticRegression

    def xy(name):
        d = load_npz(prepared.split(name))
        return d["x"].reshape(len(d["x"]), -1), d["y"]

    cloud = LogisticRegression(max_iter=2000).fit(*xy("global_train"))
    global_acc = cloud.score(*xy("global_test"))
    user_acc = cloud.score(*xy("user_holdout"))
    assert global_acc > 0.9
    assert user_acc < global_acc - 0.25, (global_acc, user_acc)
    # 150 of the user's own digits alone already beat the cloud model on the user
    own = LogisticRegression(max_iter=2000).fit(*xy("user_train"))
    assert own.score(*xy("user_holdout")) > user_acc + 0.1


def test_probe_metrics_record_the_shift(prepared):
    import json

    summary = json.loads((prepared.out("prepare") / "summary.json").read_text())
    m = summary["metrics"]
    assert m["probe_acc_global_test"] > 0.85
    assert m["probe_acc_user_holdout"] < 0.7
    assert summary["style"]["slant_deg"] == 22.0


# --------------------------------------------------------------------------- own data


def _own_samples(n=60, seed=0):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % 10
    x = rng.integers(0, 17, size=(n, 64)).astype(np.float64)
    return x, y


def test_own_npz_replaces_the_simulated_user(tmp_path):
    x, y = _own_samples()
    np.savez(tmp_path / "mine.npz", x=x / 16.0, y=y)
    paths = Paths(tmp_path)
    m = prepare.run(load_cfg("data.user_data=mine.npz", "data.user_holdout_fraction=0.5"), paths)
    assert m["n_user_train"] + m["n_user_holdout"] == 60
    assert 30 - 12 <= m["n_user_holdout"] <= 30 + 12  # a fair coin per sample: within 3 standard deviations
    ux = np.concatenate([load_npz(paths.split(s))["x"] for s in ("user_train", "user_holdout")])
    assert ux.shape == (60, 1, 8, 8)
    assert np.isclose(np.sort(ux.ravel()), np.sort((x / 16.0).ravel().astype(np.float32))).all()


def _rows(paths: Paths, split: str) -> set[bytes]:
    return {row.tobytes() for row in load_npz(paths.split(split))["x"]}


def test_a_sample_trained_on_never_enters_a_later_holdout(tmp_path):
    """The scheduled job splits the whole inbox again each time files arrive (pipeline/retrain.py), and
    compares the promoted model with its successor on the new holdout: every sample keeps its side as the
    inbox grows, so no holdout holds a sample an earlier split trained on. The oracle is the samples
    themselves (their pixels), not the split's indices."""
    inbox = tmp_path / "data" / "user"
    inbox.mkdir(parents=True)
    x, y = _own_samples(200, seed=1)
    np.savez(inbox / "first.npz", x=x / 16.0, y=y)
    paths = Paths(tmp_path)
    cfg = load_cfg("data.user_data=data/user")
    prepare.run(cfg, paths)
    trained, held = _rows(paths, "user_train"), _rows(paths, "user_holdout")
    more_x, more_y = _own_samples(300, seed=2)
    np.savez(inbox / "second.npz", x=more_x / 16.0, y=more_y)
    prepare.run(cfg, paths)
    assert not trained & _rows(paths, "user_holdout")
    assert held <= _rows(paths, "user_holdout")
    assert len(_rows(paths, "user_train") | _rows(paths, "user_holdout")) == 500
    # about the configured share of all 500 samples (a binomial's 3 standard deviations: 33)
    held_now = _rows(paths, "user_holdout")
    assert abs(len(held_now) - 250) <= 33
    prepare.run(load_cfg("data.user_data=data/user", "seed=1"), paths)
    assert _rows(paths, "user_holdout") != held_now  # another seed is another split


@pytest.mark.parametrize("user_data", ["data/user/broken.npz", "null"], ids=["named", "dropped"])
def test_a_bad_file_is_named_as_the_user_wrote_it(tmp_path, user_data):
    """The scheduled job runs prepare in DVC's temporary copy (.dvc/tmp/exps/...), a folder the user
    never saw: a bad file is named relative to the repository, as the user put it there."""
    copy = tmp_path / ".dvc" / "tmp" / "exps" / "standalone" / "tmpabc123"
    (copy / "data" / "user").mkdir(parents=True)
    (copy / "data" / "user" / "broken.npz").write_bytes(b"PK\x03\x04 cut short")
    with pytest.raises(DataError) as info:
        prepare.run(load_cfg(f"data.user_data={user_data}"), Paths(copy))
    message = str(info.value)
    assert "data/user/broken.npz: not a readable .npz" in message, message
    assert str(copy) not in message, message


def test_own_csv_with_pixel_max(tmp_path):
    x, y = _own_samples(40)
    lines = ["label," + ",".join(f"p{i}" for i in range(64))] + [f"{c}," + ",".join(str(int(v)) for v in row) for c, row in zip(y, x)]
    (tmp_path / "mine.csv").write_text("\n".join(lines) + "\n")
    paths = Paths(tmp_path)
    m = prepare.run(load_cfg("data.user_data=mine.csv", "data.pixel_max=16"), paths)
    assert m["n_user_train"] + m["n_user_holdout"] == 40
    assert load_npz(paths.split("user_train"))["x"].max() <= 1.0


def test_own_image_folder_dark_ink_is_inverted(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    for c in range(10):
        (tmp_path / "imgs" / str(c)).mkdir(parents=True)
        for k in range(2):
            a = np.full((32, 32), 255, np.uint8)  # white paper
            a[4 + c:20 + c, 8 + 2 * k:12 + 2 * k] = 0  # a dark stroke
            Image.fromarray(a).save(tmp_path / "imgs" / str(c) / f"{k}.png")
    paths = Paths(tmp_path)
    m = prepare.run(load_cfg("data.user_data=imgs"), paths)
    assert m["n_user_train"] + m["n_user_holdout"] == 20
    assert m["n_user_train"] > 0 and m["n_user_holdout"] > 0
    x = load_npz(paths.split("user_train"))["x"]
    assert x.shape[1:] == (1, 8, 8)
    assert x.mean() < 0.3
    assert x.max() == 1.0  # light ink on dark, like the digits


@pytest.mark.parametrize(
    "setup,needles",
    [
        (lambda d: None, ["missing.npz", "not found", "data.user_data=null"]),
        (lambda d: (d / "missing.npz").write_bytes(b"PK\x03\x04 definitely not a zip"), ["missing.npz", "not a readable .npz"]),
        (lambda d: np.savez(d / "missing.npz", x=np.zeros((4, 64))), ["missing.npz", "no array(s) ['y']"]),
        (lambda d: np.savez(d / "missing.npz", x=np.zeros((4, 7)), y=np.zeros(4)), ["missing.npz", "shape (7,)", "data.input_shape=[1, 8, 8]"]),
        (lambda d: np.savez(d / "missing.npz", x=np.full((4, 64), 255.0), y=np.zeros(4)), ["missing.npz", "data.pixel_max"]),
        (lambda d: np.savez(d / "missing.npz", x=np.zeros((4, 64)), y=np.array([0, 1, 2, 12])), ["missing.npz", "labels", "12.0"]),
    ],
    ids=["missing", "corrupt", "no-y", "wrong-shape", "pixel-range", "label-range"],
)
def test_bad_user_npz_names_the_file_and_the_fix(tmp_path, setup, needles):
    setup(tmp_path)
    with pytest.raises(DataError) as info:
        prepare.run(load_cfg("data.user_data=missing.npz"), Paths(tmp_path))
    for needle in needles:
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize(
    "text,needles",
    [
        ("a,b\n1,2\n", ["no column named 'label'", "data.label_column"]),
        ("label," + ",".join(f"p{i}" for i in range(64)) + "\n3," + ",".join(["0"] * 63 + ["x"]) + "\n", ["line 2", "'p63'", "'x' is not a number"]),
        ("label,p0\n", ["header row and at least one sample"]),
    ],
    ids=["no-label-column", "bad-cell", "empty"],
)
def test_bad_user_csv_names_the_line_and_column(tmp_path, text, needles):
    (tmp_path / "mine.csv").write_text(text)
    with pytest.raises(DataError) as info:
        prepare.run(load_cfg("data.user_data=mine.csv"), Paths(tmp_path))
    assert "mine.csv" in str(info.value)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_main_failure_keeps_earlier_outputs(project, capsys):
    """A stage that fails leaves data/<stage>/ exactly as the last good run left it."""
    assert prepare.main(["tracking=disabled", *TINY]) == 0
    before = digest(Paths(project))
    assert prepare.main(["tracking=disabled", *TINY, "data.user_data=data/user/nope.npz"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "nope.npz" in err[0]
    assert "not found" in err[0]
    assert digest(Paths(project)) == before
    assert sorted(p.name for p in (project / "data").iterdir()) == ["prepare"]  # no staging left behind
