"""What every peer worker shares: the job file, the data, the timed loop and the report.

A worker is run by path (``python .../run_PEER.py JOB.json``), never as part of the
odt_ops package, so the onnxruntime and torch workers import nothing of odt_ops and
can run in another environment (.venv-bench-ort) with other versions of numpy and
onnx. The worker prints one line, RESULT_MARK followed by JSON, as its last output.

Phases of a run, each timed with time.perf_counter: import the runtime, load the
model (artifacts or torch.nn with the given weights), the first train step (cold start
is the wall time from the worker's first line to the end of that step, less making the
random data), warm-up steps, timed train steps (forward + backward + optimizer step +
gradient reset, one batch each), then timed eval steps. Peak resident memory is the
process's high-water mark at the end.

A ``personalize`` job times what a user waits for instead: from the worker's first line
through the first train step (cold start), the remaining train steps up to
``personalize_steps``, and exporting the inference model (``session.export``), one wall
clock, less making the random data.

Every runtime runs ``threads()`` threads (``ODT_BENCH_THREADS``, set by the driver beside
the BLAS/OpenMP variables).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

RESULT_MARK = "ODT_BENCH_RESULT "
N_BATCHES = 4  # distinct random batches, cycled, so no peer trains on one cached batch
MIN_STEPS = 5  # the time budget never cuts a run below this many timed steps


def threads() -> int:
    """The thread count the driver asked for (the BLAS/OpenMP variables carry it too)."""
    return int(os.environ.get("ODT_BENCH_THREADS", "1"))


def report(result: dict) -> None:
    sys.stdout.flush()
    print(RESULT_MARK + json.dumps(result), flush=True)


def peak_rss_mib() -> float:
    """This process's peak resident memory. On Linux, VmHWM: ru_maxrss survives execve, so
    a worker would inherit the driver's peak (the driver spawns it from its own memory)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return kib / (1024 * 1024) if sys.platform == "darwin" else kib / 1024


def make_batches(job: dict):
    """Standard normal inputs and uniform labels, seeded: every peer sees the same data."""
    import numpy as np

    rng = np.random.default_rng(job["seed"])
    shape = (job["batch"], *job["config"]["input_shape"])
    return [(rng.standard_normal(shape, dtype=np.float32), rng.integers(0, job["config"]["classes"], job["batch"], dtype=np.int64))
            for _ in range(N_BATCHES)]


def timed_steps(step: Callable, batches: list, steps: int, budget_s: float) -> tuple[list[float], object]:
    times, out = [], None
    start = time.perf_counter()
    for i in range(steps):
        x, y = batches[i % len(batches)]
        t = time.perf_counter()
        out = step(x, y)
        times.append((time.perf_counter() - t) * 1000)
        if i + 1 >= MIN_STEPS and time.perf_counter() - start > budget_s:
            break
    return times, out


def main(t0: float, import_runtime: Callable[[], dict], load: Callable[[dict], object],
         prepare: Callable[[dict], None] | None = None) -> int:
    """Run one job. ``load(job)`` returns a session with ``convert(x, y)``,
    ``train_step(x, y)``, ``eval_step(x, y)`` (each returning the loss) and ``loss(out)``."""
    if sys.argv[1:] == ["--check"]:  # is the runtime importable here? (used by --setup-peers)
        try:
            print(json.dumps({**import_runtime(), "imports_torch": "torch" in sys.modules}))
        except ImportError as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        return 0
    job = json.loads(Path(sys.argv[1]).read_text())
    result: dict = {"peer": job["peer"], "config": job["config"]["name"], "batch": job.get("batch"), "pid": os.getpid(),
                    "python": sys.version.split()[0], "executable": sys.executable}
    try:
        t = time.perf_counter()
        result["versions"] = import_runtime()
        import_ms = (time.perf_counter() - t) * 1000
    except ImportError as exc:
        report({**result, "status": "missing", "reason": f"{type(exc).__name__}: {exc}"})
        return 0
    try:
        if job["mode"] == "prepare":
            prepare(job)
            report({**result, "status": "ok"})
            return 0
        t = time.perf_counter()
        raw = make_batches(job)
        data_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        session = load(job)
        load_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        batches = [session.convert(x, y) for x, y in raw]
        data_ms += (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        first = session.train_step(*batches[0])
        first_ms = (time.perf_counter() - t) * 1000
        cold_ms = (time.perf_counter() - t0) * 1000 - data_ms
        if job["mode"] == "personalize":
            parts = {"import": import_ms, "load": load_ms, "first_step": first_ms}
            report({**result, **personalize(session, batches, job, t0, data_ms, cold_ms), "cold_start_parts_ms": parts})
            return 0
        spawn = os.environ.get("ODT_BENCH_SPAWN_TIME")  # the driver's time.time() just before starting us
        warm = time.perf_counter()
        for i in range(1, job["warmup"]):  # a slow model (a zoo network) warms up for a quarter of the budget at most
            if time.perf_counter() - warm > job["time_budget_s"] / 4:
                break
            session.train_step(*batches[i % len(batches)])
        train_ms, last = timed_steps(session.train_step, batches, job["steps"], job["time_budget_s"])
        session.eval_step(*batches[0])  # warm the eval path
        eval_ms, eval_out = timed_steps(session.eval_step, batches, job["eval_steps"], job["time_budget_s"] / 2)
        result.update(
            status="ok",
            train_ms=train_ms,
            eval_ms=eval_ms,
            peak_rss_mib=peak_rss_mib(),
            cold_start_ms=cold_ms,
            cold_start_parts_ms={"import": import_ms, "load": load_ms, "first_step": first_ms},
            process_start_ms=((time.time() - (time.perf_counter() - t0)) - float(spawn)) * 1000 if spawn else None,
            first_loss=session.loss(first),
            last_loss=session.loss(last),
            eval_loss=session.loss(eval_out),
            imports_torch="torch" in sys.modules,
            load_average=os.getloadavg()[0],  # other processes on the machine skew the times
            threads=threads(),
        )
    except Exception as exc:  # reported, so one broken peer does not stop the run
        report({**result, "status": "failed", "reason": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:]})
        return 1
    report(result)
    return 0


def personalize(session, batches: list, job: dict, t0: float, data_ms: float, cold_ms: float) -> dict:
    """The rest of a personalization after the cold start (which ran the first step): the other
    train steps, then the inference model's export; the total is one wall clock from ``t0``."""
    t = time.perf_counter()
    last = None
    for i in range(1, job["personalize_steps"]):
        last = session.train_step(*batches[i % len(batches)])
    steps_ms = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    session.export(os.path.join(job["export_dir"], f"{job['peer']}-inference.onnx"), batches[0][0])
    export_ms = (time.perf_counter() - t) * 1000
    total_ms = (time.perf_counter() - t0) * 1000 - data_ms
    return {"status": "ok", "personalize_ms": total_ms, "threads": threads(),
            "personalize_parts_ms": {"cold_start": cold_ms, "train_steps": steps_ms, "export": export_ms},
            "last_loss": None if last is None else session.loss(last),
            "imports_torch": "torch" in sys.modules, "load_average": os.getloadavg()[0]}


class TrainingApiSession:
    """The training loop both on-device APIs share, call for call (onnxruntime.training.api and
    odt_ops.api): subclasses set ``self.module`` and ``self.optimizer`` in ``__init__``."""

    def convert(self, x, y):
        return x, y

    def train_step(self, x, y):
        if not self.module.training:
            self.module.train()
        loss = self.module(x, y)
        self.optimizer.step()
        self.module.lazy_reset_grad()
        return loss

    def eval_step(self, x, y):
        if self.module.training:
            self.module.eval()
        return self.module(x, y)

    def export(self, path: str, x) -> None:
        """The inference model (logits 'output'), as both APIs export it."""
        self.module.export_model_for_inferencing(path, ["output"])

    @staticmethod
    def loss(out) -> float:
        return float(out)
