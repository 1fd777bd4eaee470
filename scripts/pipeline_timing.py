"""How long the pipeline takes, as a new user meets it: the README's `dvc repro` in a fresh
clone, then a learning-rate change (`dvc exp run -S optimizer.lr=...`: train, evaluate, export).

    python scripts/pipeline_timing.py [--json timing.json] [--keep DIR] [--lr 1e-2] [--source CHECKOUT]
    python scripts/pipeline_timing.py --compare a.json b.json   # same outputs, bit for bit?

The working tree's project files (git-tracked and untracked-but-not-ignored, so uncommitted
changes count; no outputs, caches, stores or venvs) are copied into a temporary directory and
committed there as a new git repository: what `git clone` gives, without the network. DVC then
runs there with this interpreter (ODT_PYTHON, see pipeline/stage.sh) and MLflow tracking as
configured (on by default, into the copy's own mlflow.db).

Reported: wall time and CPU time (user + system, of DVC and every process it waited for) of
each DVC command, and the wall time until its tracking is complete (``python -m
pipeline.mlflow_logger --wait`` returns: the stages' MLflow runs are written by one logging
process per DVC command, which may finish a moment after DVC returns); per stage, the wall time from DVC's "Running stage" line to the next (the
process's start, imports, tracking and DVC's own hashing included), the stage's own clock and
its process's CPU time (its "done in" line); CPU time depends much less on other load on the
machine than wall time does. And the SHA-256 of every output DVC records in dvc.lock,
so two runs (for example under two OPENBLAS_CORETYPE values in the caller's environment) can be
compared bit for bit (`--json` both, then compare their "outputs").

Timings depend on the machine and its load; say which when quoting them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from odt_ops.kernels.parallel import cpu_name

ROOT = Path(__file__).resolve().parents[1]
RUNNING = re.compile(r"Running stage '(\w+)'")
LOGGER = re.compile(r"run\(s\) written, ([0-9.]+) s CPU")  # the logging process's last line (pipeline/mlflow_logger.py)
DONE = re.compile(r"^(\w+): done in ([0-9.]+) s(?: \(([0-9.]+) s CPU\))?")


def clone_like(source: Path, dest: Path) -> Path:
    """``source``'s project files in ``dest``, committed as a fresh repository."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=source,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src = source / name
        if src.is_file():  # a deleted, not yet committed file is listed but absent
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    git = ["git", "-c", "user.name=odt-timing", "-c", "user.email=odt-timing@localhost", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q", "-b", "main"], cwd=dest, check=True)
    subprocess.run(["git", "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "fresh clone"], cwd=dest, check=True)
    return dest


def timed_dvc(repo: Path, env: dict, *args: str) -> dict:
    """Run ``dvc ARGS`` streaming its output; wall time, per-stage wall and own times."""
    log = repo / ".mlflow-spool" / "logger.log"
    logged_before = len(log.read_text(encoding="utf-8").splitlines()) if log.is_file() else 0
    t0 = time.perf_counter()
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    starts: list[tuple[str, float]] = []
    own: dict[str, float] = {}
    own_cpu: dict[str, float] = {}
    lines = []
    for line in proc.stdout:
        now = time.perf_counter() - t0
        lines.append(line)
        m = RUNNING.search(line)
        if m:
            starts.append((m.group(1), now))
        m = DONE.match(line.strip())
        if m:
            own[m.group(1)] = float(m.group(2))
            if m.group(3):
                own_cpu[m.group(1)] = float(m.group(3))
    proc.wait()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stdout.write("".join(lines))
        raise SystemExit(f"dvc {' '.join(args)} failed (exit {proc.returncode})")
    waited = None
    if (repo / "pipeline" / "mlflow_logger.py").is_file():  # (an older checkout's stages write MLflow themselves)
        waited = subprocess.run([sys.executable, "-m", "pipeline.mlflow_logger", "--wait", "--timeout", "600"], cwd=repo, env=env,
                                capture_output=True, text=True)
    tracked = time.perf_counter() - t0
    if waited is not None and waited.returncode != 0:
        raise SystemExit(f"tracking of dvc {' '.join(args)} incomplete: {waited.stderr.strip()}")
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    log = repo / ".mlflow-spool" / "logger.log"
    logger_lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    logger_cpu = sum(float(m.group(1)) for m in map(LOGGER.search, logger_lines[logged_before:]) if m)
    ends = [t for _, t in starts[1:]] + [wall]
    stages = {name: {"wall_s": round(end - start, 2), "own_s": own.get(name), "cpu_s": own_cpu.get(name)}
              for (name, start), end in zip(starts, ends)}
    return {"command": "dvc " + " ".join(args), "wall_s": round(wall, 2), "tracked_wall_s": round(tracked, 2), "cpu_s": round(cpu, 2),
            "logger_cpu_s": round(logger_cpu, 2), "stages": stages}


def output_digests(repo: Path) -> dict[str, str]:
    """SHA-256 of every file under the outputs and metrics dvc.lock records."""
    import yaml

    lock = yaml.safe_load((repo / "dvc.lock").read_text(encoding="utf-8"))
    digests = {}
    for stage in lock["stages"].values():
        for out in stage.get("outs", []):
            path = repo / out["path"]
            files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
            for f in files:
                digests[f.relative_to(repo).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return digests


def compare(first: Path, second: Path) -> int:
    """Exit 0 when two reports' output digests are the same, file for file; list the differences."""
    a, b = (json.loads(p.read_text(encoding="utf-8"))["outputs"] for p in (first, second))
    differ = sorted(f for f in a.keys() | b.keys() if a.get(f) != b.get(f))
    for f in differ:
        print(f"differs: {f}")
    print(f"{len(a.keys() & b.keys()) - len(differ)} of {len(a.keys() | b.keys())} output files identical")
    return 1 if differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the figures (and output digests) here")
    ap.add_argument("--keep", type=Path, help="make the copy here and keep it (default: a temporary directory, removed)")
    ap.add_argument("--lr", default="1e-2", help="the learning rate of the second command (default 1e-2)")
    ap.add_argument("--source", type=Path, default=ROOT,
                    help="the work tree to copy (default: this repository's; another checkout measures its code)")
    ap.add_argument("--no-lr-change", action="store_true", help="only the first `dvc repro`")
    ap.add_argument("--compare", nargs=2, type=Path, metavar="JSON", help="compare two reports' output digests and exit")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*args.compare)

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "ODT_", "MLFLOW_"))}
    env.update(ODT_PYTHON=sys.executable, DVC_NO_ANALYTICS="1", MLFLOW_DISABLE_TELEMETRY="true",
               GIT_AUTHOR_NAME="odt-timing", GIT_AUTHOR_EMAIL="t@localhost", GIT_COMMITTER_NAME="odt-timing",
               GIT_COMMITTER_EMAIL="t@localhost")
    tmp = None
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=False)
        repo = clone_like(args.source.resolve(), args.keep.resolve())
    else:
        tmp = tempfile.TemporaryDirectory(prefix="odt-timing-")
        repo = clone_like(args.source.resolve(), Path(tmp.name))
    try:
        report = {"source": str(args.source.resolve()), "cpu": cpu_name(), "cpus": os.cpu_count(), "load_before": os.getloadavg(),
                  "openblas_coretype": os.environ.get("OPENBLAS_CORETYPE"),
                  "npy_disable_cpu_features": os.environ.get("NPY_DISABLE_CPU_FEATURES"), "runs": []}
        report["runs"].append(timed_dvc(repo, env, "repro", "-f"))
        report["outputs"] = output_digests(repo)
        if not args.no_lr_change:
            report["runs"].append(timed_dvc(repo, env, "exp", "run", "-S", f"optimizer.lr={args.lr}"))
        report["load_after"] = os.getloadavg()
    finally:
        if tmp is not None:
            tmp.cleanup()
    print(f"{report['cpu']}, {report['cpus']} CPUs, load average {report['load_before'][0]:.1f} before, "
          f"{report['load_after'][0]:.1f} after")
    for run in report["runs"]:
        print(f"{run['command']}: {run['wall_s']:.1f} s wall ({run['tracked_wall_s']:.1f} s until its tracking is complete), "
              f"{run['cpu_s']:.1f} s CPU (DVC and every process it waited for) + {run['logger_cpu_s']:.1f} s CPU (the MLflow logging process)")
        for name, t in run["stages"].items():
            own = f"{t['own_s']:.1f} s" if t["own_s"] is not None else "-"
            cpu = f"{t['cpu_s']:.1f} s" if t.get("cpu_s") is not None else "-"
            print(f"  {name:<10} {t['wall_s']:6.1f} s wall   {own:>8} own clock   {cpu:>8} CPU (the stage's process)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
