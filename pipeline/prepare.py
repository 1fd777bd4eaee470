"""prepare: the cloud's data and one device owner's data, as .npz files.

Outputs (data/prepare/): ``global_train.npz``, ``global_test.npz`` (the cloud's),
``user_train.npz``, ``user_holdout.npz`` (the device's), each with ``x`` float32
[N, *data.input_shape] in [0, 1] and ``y`` int64 [N]; ``summary.json`` (counts, the
user's style, a shift probe).

The demo (scikit-learn's real handwritten digits) is split, seeded, into the cloud's
part and ``data.user_samples`` digits for the user, which are re-rendered in the
user's handwriting (``data.style``: a slant and a heavier pen, see
``datasets.render_style``). The user labels ``data.user_train_per_class`` digits per
class on the device; the rest is the holdout that measures personalization. With
``data.user_data`` set, the user's own samples replace the simulated user and about
``data.user_holdout_fraction`` of them are the holdout, each sample's side fixed by a hash
of its pixels (``repeatable_split``: a sample keeps its side as data is added, which the
scheduled retraining relies on). With ``data.user_data`` null,
files dropped into data/user are used the same way when their format is clear; when it
is not, one line says why and which key to set.

The probe is a nearest-centroid classifier fit on global_train: its accuracy on the
global test set versus the user's holdout shows how far the user is from the crowd.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import sys
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from pipeline import datasets
from pipeline.config import MISSING, Section
from pipeline.errors import ConfigError, DataError
from pipeline.io import save_npz, write_digests, write_json
from pipeline.paths import SPLITS, Paths
from pipeline.tracking import NO_TRACKING, NullRun


class DataName(Enum):
    digits = "digits"


class UserFormat(Enum):
    auto = "auto"
    npz = "npz"
    csv = "csv"
    images = "images"


class Ink(Enum):
    auto = "auto"
    light_on_dark = "light_on_dark"
    dark_on_light = "dark_on_light"


@dataclass
class StyleConfig(Section):
    """The simulated user's handwriting, applied to 32x32 bitmaps (see datasets.render_style)."""

    slant_deg: float = MISSING
    stroke: int = MISSING
    jitter_deg: float = MISSING
    shift: list[float] = MISSING

    def check(self) -> None:
        self.need(self.stroke >= 0, "stroke", "an integer >= 0 (pixels at 32x32)")
        self.need(-60 <= self.slant_deg <= 60, "slant_deg", "degrees in [-60, 60]")
        self.need(self.jitter_deg >= 0, "jitter_deg", "degrees >= 0")
        self.need(len(self.shift) == 2, "shift", "two numbers [down, right] in 8x8 pixels")


@dataclass
class DataConfig(Section):
    name: DataName = MISSING
    input_shape: list[int] = MISSING
    num_classes: int = MISSING
    test_fraction: float = MISSING
    user_samples: int = MISSING
    user_train_per_class: int = MISSING
    style: StyleConfig = field(default_factory=StyleConfig)
    user_data: str | None = MISSING
    user_format: UserFormat = MISSING
    user_holdout_fraction: float = MISSING
    label_column: str = MISSING
    pixel_max: float | None = MISSING
    ink: Ink = MISSING

    def check(self) -> None:
        self.need(len(self.input_shape) >= 1 and all(n >= 1 for n in self.input_shape), "input_shape", "a list of positive integers")
        self.need(self.num_classes >= 2, "num_classes", "an integer >= 2")
        self.need(0 < self.test_fraction < 1, "test_fraction", "a fraction strictly between 0 and 1")
        self.need(0 < self.user_holdout_fraction < 1, "user_holdout_fraction", "a fraction strictly between 0 and 1")
        self.need(self.user_samples >= 2 * self.num_classes, "user_samples", f"an integer >= 2 * data.num_classes ({2 * self.num_classes})")
        self.need(self.user_train_per_class >= 1, "user_train_per_class", "an integer >= 1")
        self.need(self.user_train_per_class * self.num_classes < self.user_samples, "user_train_per_class",
                  f"fewer than data.user_samples / data.num_classes ({self.user_samples / self.num_classes:g}) so a holdout remains")
        self.need(self.pixel_max is None or 0 < self.pixel_max < math.inf, "pixel_max", "null or a finite number > 0")
        self.need(bool(self.label_column), "label_column", "a non-empty column name")


CONFIG = {"data": DataConfig}
SUMMARY = "summary.json"  # counts, the user's style, the probe (the only file worth a copy in MLflow)


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    d = cfg.data
    rng = np.random.default_rng(cfg.seed)
    x, y = datasets.load_digits_demo()
    if list(d.input_shape) != list(x.shape[1:]) or d.num_classes != 10:
        raise ConfigError(
            f"data.input_shape={list(d.input_shape)}, data.num_classes={d.num_classes}: the digits demo is "
            f"{list(x.shape[1:])} with 10 classes (the user's own data must fit it too)"
        )
    if d.user_samples >= len(x) // 2:
        raise ConfigError(f"data.user_samples={d.user_samples}: expected fewer than half of the demo's {len(x)} digits")
    order = rng.permutation(len(x))
    user_idx, cloud_idx = order[: d.user_samples], order[d.user_samples:]
    n_test = int(round(d.test_fraction * len(cloud_idx)))
    splits = {"global_train": (x[cloud_idx[n_test:]], y[cloud_idx[n_test:]]), "global_test": (x[cloud_idx[:n_test]], y[cloud_idx[:n_test]])}

    user_data = d.user_data or _dropped_files(d, paths)
    if user_data:
        ux, uy = datasets.load_user_data(paths.resolve(user_data), d, shown=user_data)
        train_idx, hold_idx = repeatable_split(ux, cfg.seed, d.user_holdout_fraction)
        source = f"own data: {user_data}"
    else:
        style = d.style
        ux = datasets.render_style(
            x[user_idx], slant_deg=style.slant_deg, stroke=style.stroke, jitter_deg=style.jitter_deg, shift=list(style.shift), rng=rng
        )
        uy = y[user_idx]
        train_idx, hold_idx = _split_per_class(uy, rng, train_per_class=d.user_train_per_class)
        source = "simulated: digits demo in the user's style"
    splits["user_train"] = (ux[train_idx], uy[train_idx])
    splits["user_holdout"] = (ux[hold_idx], uy[hold_idx])

    out = paths.out("prepare")
    for name in SPLITS:
        sx, sy = splits[name]
        save_npz(paths.split(name), x=np.ascontiguousarray(sx, np.float32), y=sy.astype(np.int64))
    probe = _nearest_centroid(*splits["global_train"], d.num_classes)
    metrics = {f"n_{name}": int(len(splits[name][1])) for name in SPLITS}
    metrics["probe_acc_global_test"] = probe(*splits["global_test"])
    metrics["probe_acc_user_holdout"] = probe(*splits["user_holdout"])
    write_json(out / SUMMARY, {
        "source": source,
        "style": dataclasses.asdict(d.style) if not user_data else None,
        "classes": {name: np.bincount(splits[name][1], minlength=d.num_classes).tolist() for name in SPLITS},
        "metrics": metrics,
        "probe": "nearest centroid fit on global_train",
    })
    write_digests(out)
    return metrics


def _dropped_files(d, paths: Paths) -> str | None:
    """With ``data.user_data`` null, files dropped into data/user are the user's data when
    their format is clear (one line says so); otherwise one line says why not and which key
    to set, and the simulated user stays."""
    folder = paths.user_folder
    files = datasets.user_files(folder)
    if not files:
        return None
    shown = paths.show(folder)
    try:
        fmt = datasets.folder_format(folder, d.user_format.value, shown=shown)
    except DataError as exc:
        print(f"prepare: not using the {len(files)} file(s) in {shown}: {exc}; meanwhile the simulated user stands in", file=sys.stderr)
        return None
    if fmt is None:
        print(f"prepare: not using the {len(files)} file(s) in {shown}: none is {d.user_format.value} data (data.user_format); "
              "set data.user_format=auto, or data.user_data to your data", file=sys.stderr)
        return None
    print(f"prepare: data.user_data is null, so the {len(files)} file(s) in {shown} ({fmt}) are the user's data "
          f"(set data.user_data to choose other data)", file=sys.stderr)
    return shown


def _split_per_class(y: np.ndarray, rng: np.random.Generator, *, train_per_class: int):
    """The simulated user's indices (train, holdout): ``train_per_class`` of each class, seeded."""
    train, hold = [], []
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        k = min(train_per_class, len(idx) - 1) if len(idx) > 1 else len(idx)
        train.extend(idx[:k])
        hold.extend(idx[k:])
    return np.sort(np.array(train)), np.sort(np.array(hold))


def repeatable_split(x: np.ndarray, seed: int, holdout_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The user's own samples' indices (train, holdout): each sample's side is decided by a hash of
    its pixels and the seed alone (holdout when the hash, as a fraction, is below
    ``holdout_fraction``), never by which other samples are there.

    Why not a shuffle: the scheduled job (pipeline/retrain.py) splits the whole inbox again on
    every run, and a shuffle of the grown inbox moved samples a promoted model had trained on
    into the new holdout, on which that model and its successor were then compared. With a
    hash, a sample keeps its side as files are added (and a duplicate sits with its copy), so
    a holdout never holds a sample any earlier split trained on. The price: the holdout is
    ``holdout_fraction`` of the samples on average, not per class exactly. Another seed is
    another split."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
    key = str(int(seed)).encode()
    fraction = np.array([int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8, key=key).digest(), "little")
                         for row in flat], dtype=np.float64) / 2.0 ** 64
    hold = fraction < holdout_fraction
    if hold.all() or not hold.any():
        raise DataError(f"the user's data has {len(x)} sample(s), all of which fell on one side of the split "
                        f"(data.user_holdout_fraction={holdout_fraction}): add samples so both a training set and a holdout remain")
    return np.flatnonzero(~hold), np.flatnonzero(hold)


def _nearest_centroid(x: np.ndarray, y: np.ndarray, num_classes: int):
    flat = x.reshape(len(x), -1)
    centroids = np.stack([flat[y == c].mean(axis=0) if np.any(y == c) else np.full(flat.shape[1], np.inf) for c in range(num_classes)])

    def accuracy(xs: np.ndarray, ys: np.ndarray) -> float:
        dist = ((xs.reshape(len(xs), -1)[:, None, :] - centroids[None]) ** 2).sum(-1)
        return float(np.mean(dist.argmin(axis=1) == ys))

    return accuracy


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("prepare", run, argv, artifacts=lambda paths: [paths.out("prepare") / SUMMARY])


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
