"""PNG plots for MLflow (the loss curve, confusion matrices), drawn with matplotlib's
Agg backend when matplotlib is installed (it comes with mlflow); skipped otherwise.

DVC draws its own plots from the CSV/JSON files the stages write (``dvc plots show``),
so nothing here is a DVC output: the PNGs are rendered into a temporary directory
and logged as MLflow artifacts.
"""
from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # Agg, no pyplot: no display, no global state
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    return path


def loss_curve(curve_csv: Path, path: Path, title: str = "on-device training") -> Path:
    """Loss per step (left axis) and learning rate (right axis) from train's curve.csv."""
    with open(curve_csv, newline="") as f:
        rows = list(csv.DictReader(f))
    step = np.array([int(r["step"]) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows])
    lr = np.array([float(r["lr"]) for r in rows])
    fig = _figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(step, loss, lw=0.8, alpha=0.5, color="tab:blue", label="loss (step)")
    if len(loss) >= 10:
        k = max(2, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(step[k - 1:], smooth, lw=2, color="tab:blue", label=f"loss ({k}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax2 = ax.twinx()
    ax2.plot(step, lr, lw=1.2, color="tab:orange", label="learning rate")
    ax2.set_ylabel("learning rate")
    ax2.set_ylim(bottom=0, top=max(float(lr.max()) * 1.1, 1e-12))
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper right", fontsize=8)
    return _save(fig, path)


def confusion(matrices: Sequence[tuple[str, np.ndarray]], path: Path, title: str) -> Path:
    """Confusion matrices side by side (rows: actual class, columns: predicted)."""
    fig = _figure(4.2 * len(matrices), 4.2)
    for i, (name, m) in enumerate(matrices, start=1):
        m = np.asarray(m)
        ax = fig.add_subplot(1, len(matrices), i)
        ax.imshow(m, cmap="Blues")
        acc = np.trace(m) / max(1, m.sum())
        ax.set_title(f"{name}: accuracy {acc:.3f}", fontsize=10)
        ax.set_xlabel("predicted")
        ax.set_ylabel("actual")
        ax.set_xticks(range(m.shape[1]))
        ax.set_yticks(range(m.shape[0]))
        top = m.max() if m.size else 0
        for (r, c), v in np.ndenumerate(m):
            if v:
                ax.text(c, r, str(v), ha="center", va="center", fontsize=7, color="white" if v > top / 2 else "black")
    fig.suptitle(title, fontsize=11)
    return _save(fig, path)


def confusion_from_rows(rows_json: Path, num_classes: int | None = None) -> np.ndarray:
    """The matrix of a DVC confusion file (a JSON list of {actual, predicted})."""
    rows = json.loads(Path(rows_json).read_text())
    n = num_classes or 1 + max(max(r["actual"], r["predicted"]) for r in rows)
    m = np.zeros((n, n), dtype=np.int64)
    for r in rows:
        m[r["actual"], r["predicted"]] += 1
    return m


def draw(kind: str, path: Path, spec: dict) -> Path:
    """The plot a tracking record describes (pipeline.tracking.RecordingRun.log_plot): ``kind``
    loss_curve (``curve_csv``, ``title``) or confusion (``models``, a rows file per model,
    ``num_classes``, ``title``)."""
    if kind == "loss_curve":
        return loss_curve(Path(spec["curve_csv"]), path, title=spec["title"])
    if kind == "confusion":
        matrices = [(m, confusion_from_rows(Path(spec[m]), spec["num_classes"])) for m in spec["models"]]
        return confusion(matrices, path, spec["title"])
    raise ValueError(f"unknown plot kind {kind!r}: loss_curve or confusion")
