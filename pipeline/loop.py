"""The training loop: onnxruntime's on-device training loop (train step, optimizer step,
lazy_reset_grad) within the device's limits (epochs, steps, seconds, BLAS threads), with a
progress bar on a terminal and nothing on a pipe."""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

TOTAL_STEPS = "odt.pipeline.total_steps"  # checkpoint property: steps behind it, over continued runs


@contextlib.contextmanager
def limit_threads(threads: int) -> Iterator[None]:
    """At most ``threads`` BLAS/OpenMP threads inside the block (threadpoolctl, when installed)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=int(threads)):
        yield


@dataclass
class FitResult:
    steps: int
    epochs: float
    stopped_by: str  # epochs | max_steps | max_seconds
    seconds: float
    losses: list[float]


def steps_per_epoch(n: int, batch_size: int) -> int:
    return max(1, math.ceil(n / batch_size))


def fit(module, optimizer, x: np.ndarray, t: np.ndarray, *, epochs: int, batch_size: int, shuffle: bool, rng: np.random.Generator,
        lr_scheduler=None, max_steps: int | None = None, max_seconds: float | None = None,
        on_step: Callable[[int, int, float, float], None] | None = None, desc: str = "train") -> FitResult:
    """Mini-batch training: ``epochs`` passes over (x, t), stopping early at ``max_steps``
    optimizer steps or ``max_seconds`` of wall time. ``on_step(step, epoch, loss, lr)``
    sees every step (1-based), with the rate that step used."""
    n = len(x)
    per_epoch = steps_per_epoch(n, batch_size)
    total = epochs * per_epoch if max_steps is None else min(epochs * per_epoch, max_steps)
    bar = _progress(total, desc)
    losses_seen: list[float] = []
    step, stopped, t0 = 0, "epochs", time.monotonic()
    try:
        for epoch in range(epochs):
            module.train()
            order = rng.permutation(n) if shuffle else np.arange(n)
            for i in range(0, n, batch_size):
                idx = order[i : i + batch_size]
                lr = optimizer.get_learning_rate()
                out = module(x[idx], t[idx])  # loss, or [loss, *extra outputs]
                loss = float(out[0] if isinstance(out, list) else out)
                optimizer.step()
                module.lazy_reset_grad()
                if lr_scheduler is not None:
                    lr_scheduler.step()
                step += 1
                losses_seen.append(loss)
                if on_step is not None:
                    on_step(step, epoch, loss, lr)
                if bar is not None:
                    bar.update(1)
                    if step % 10 == 0 or step == total:
                        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
                if max_steps is not None and step >= max_steps:
                    stopped = "max_steps"
                    break
                if max_seconds is not None and time.monotonic() - t0 >= max_seconds:
                    stopped = "max_seconds"
                    break
            if stopped != "epochs":
                break
    finally:
        if bar is not None:
            bar.close()
    return FitResult(step, step / per_epoch, stopped, time.monotonic() - t0, losses_seen)


def _progress(total: int, desc: str):
    """A tqdm bar on a terminal (stderr is a TTY, as under an interactive `dvc repro`),
    None otherwise (pipes, `dvc queue`, CI): one summary line is printed at the end."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    bar = tqdm(total=total, desc=desc, unit="step", disable=None, leave=False, dynamic_ncols=True)
    if bar.disable:
        bar.close()
        return None
    return bar
