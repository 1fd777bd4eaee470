"""The driver: prepare each configuration once, run every (thread count, configuration,
batch, peer, repeat) as a fresh worker process, alternating the peers' order between
repeats, and per configuration one personalization per peer and repeat (cold start, 200
train steps, export of the inference model), then summarize into one JSON document and
print the tables.

Nothing here is timed; only workers time themselves (see workers/harness.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from odt_ops.benchmark import configs as cfgs
from odt_ops.benchmark.peers import PEERS, PeerEnv, locate, repo_root, setup_peers
from odt_ops.benchmark.report import render_tables, summarize, summarize_personalization
from odt_ops.benchmark.workers.harness import RESULT_MARK
from odt_ops.kernels.parallel import cpu_name

SCHEMA = "odt-benchmark/2"  # 2: settings.threads is a list, results carry threads, "personalize" added
DEFAULT_JSON = "benchmark.json"
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                    "NUMEXPR_NUM_THREADS", "ODT_BENCH_THREADS")  # the last: the workers' own runtimes (harness.threads)


def thread_env(threads: int) -> dict[str, str]:
    """Every thread setting at ``threads``: BLAS and OpenMP read theirs when they load."""
    return dict.fromkeys(THREAD_VARIABLES, str(threads))


ONE_THREAD = thread_env(1)
NO_PERSONALIZATION = ("ort-inference",)  # runs our artifacts on an inference runtime: it exports nothing


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m odt_ops.benchmark", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", metavar="NAME", help=f"default: {' '.join(c.name for c in cfgs.resolve(None))}; "
                   f"known: {' '.join(cfgs.CONFIGS)}")
    p.add_argument("--batches", nargs="+", type=int, help="default: 16 64 256 (a zoo configuration: its own, e.g. resnet50: 4)")
    p.add_argument("--steps", type=int, default=100, help="timed train steps per process (default 100)")
    p.add_argument("--warmup", type=int, default=10, help="untimed train steps first, the first one included (default 10)")
    p.add_argument("--eval-steps", type=int, default=30, help="timed eval steps per process (default 30)")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per peer and configuration (default 3)")
    p.add_argument("--time-budget", type=float, default=20.0, metavar="SECONDS",
                   help="stop timing train steps after this long (at least 5 steps; eval gets half)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated, from {','.join(PEERS)} (default: all)")
    p.add_argument("--json", default=DEFAULT_JSON, metavar="PATH", help=f"results file (default {DEFAULT_JSON})")
    p.add_argument("--workdir", help="keep models, artifacts and job files here (default: a temporary directory)")
    p.add_argument("--worker-timeout", type=float, default=900.0, metavar="SECONDS")
    p.add_argument("--setup-peers", action="store_true", help="create .venv-bench-ort with ONNX Runtime training "
                   "(and torch if missing) and exit")
    p.add_argument("--threads", nargs="+", type=int, default=[1], metavar="N",
                   help="thread counts to run everything at (default 1; e.g. 1 2 4: the threads report)")
    p.add_argument("--personalize-steps", type=int, default=200, metavar="STEPS",
                   help="time to personalize: cold start + this many train steps + the export, per configuration "
                        "(its first batch) and peer (default 200; 0: skip)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args = p.parse_args(argv)
    args.peers = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in args.peers if s not in PEERS]
    if unknown:
        p.error(f"unknown peer(s) {unknown}; peers are {','.join(PEERS)}")
    if min(args.steps, args.warmup, args.eval_steps, args.repeats, *(args.batches or [1]), *args.threads) < 1:
        p.error("--steps, --warmup, --eval-steps, --repeats, --batches and --threads must be >= 1")
    if args.personalize_steps < 0:
        p.error("--personalize-steps must be >= 0")
    return args


def compile_bytecode(envs: dict[str, PeerEnv], package: Path) -> dict[str, str]:
    """Compile ``package`` (odt_ops: the engine and every peer's worker scripts) to bytecode with
    each peer's Python, untimed, so that every peer's cold start imports compiled modules.

    Why: pip compiles what it installs (torch, onnxruntime, numpy), and an ordinary Python caches
    what it compiles on first import, but a checkout run under PYTHONDONTWRITEBYTECODE (as CI
    machines and containers often set) would recompile odt_ops' ~100 modules in every worker
    process: about 200 ms of each odt cold start on an AMD EPYC Zen 4, a cost no user pays twice.
    Returns, per Python, "compiled" or why not (a read-only checkout: the figures then include it)."""
    done: dict[str, str] = {}
    for python in sorted({e.python for e in envs.values() if e.python}):
        try:
            proc = subprocess.run([python, "-m", "compileall", "-q", str(package)], capture_output=True, text=True, timeout=600)
            done[python] = "compiled" if proc.returncode == 0 else f"compileall failed: {(proc.stdout + proc.stderr)[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            done[python] = f"compileall failed: {exc}"
    return done


def run_worker(env: PeerEnv, job: dict, job_path: Path, timeout: float, threads: int = 1) -> dict:
    """Start one fresh worker process at ``threads`` threads and return its report (or why it has none)."""
    job_path.write_text(json.dumps(job))
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child_env.update(thread_env(threads))
    if env.name == "odt":  # the engine from this checkout, installed or not
        child_env["PYTHONPATH"] = str(repo_root())
    child_env["ODT_BENCH_SPAWN_TIME"] = repr(time.time())
    base = {"peer": env.name, "config": job["config"]["name"], "batch": job.get("batch")}
    try:
        proc = subprocess.run([env.python, str(env.script), str(job_path)], capture_output=True, text=True,
                              env=child_env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**base, "status": "failed", "reason": f"timed out after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        return {**base, "status": "failed", "reason": f"exit code {proc.returncode}, no report",
                "stderr": proc.stderr[-4000:]}
    return json.loads(lines[-1][len(RESULT_MARK):])


def prepare(config: cfgs.Config, workdir: Path, envs: dict[str, PeerEnv], timeout: float) -> dict[str, dict]:
    """Write the forward model and weights, then each runtime's artifacts (untimed).

    Returns, per peer, the job fields it needs, or a {"status": ...} saying why it cannot run.
    """
    d = workdir / config.name
    d.mkdir(parents=True, exist_ok=True)
    model = cfgs.forward_model(config)
    forward = d / "forward.onnx"
    onnx.save(model, forward)
    np.savez(d / "weights.npz", **{t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer})
    common = {"forward": str(forward), "weights": str(d / "weights.npz"), "trainable": cfgs.trainable(config, model),
              "frozen": list(config.frozen)}
    if config.zoo:  # PyTorch runs the graph itself (workers/torch_graph.py), read without onnx
        (d / "graph.json").write_text(json.dumps(graph_json(model)))
        common["graph"] = str(d / "graph.json")
    ready: dict[str, dict] = {}
    if any(envs[p].python for p in ("odt", "ort-inference") if p in envs):
        try:
            odt_artifacts(config, forward, d / "odt", common["trainable"])
            ready["odt"] = ready["ort-inference"] = {**common, "artifacts": str(d / "odt")}
        except Exception as exc:  # the engine cannot build this model: both columns say so
            ready["odt"] = ready["ort-inference"] = {"status": "failed", "reason": f"generate_artifacts: {type(exc).__name__}: {exc}"}
    for peer in ("torch",):
        ready[peer] = common
    if "ort-training" in envs and envs["ort-training"].python:
        fields = {**common, "artifacts": str(d / "ort-training")}
        job = {"peer": "ort-training", "mode": "prepare", "config": config.to_json(), **fields}
        res = run_worker(envs["ort-training"], job, d / "prepare-ort-training.json", timeout)
        ready["ort-training"] = fields if res["status"] == "ok" else {
            "status": res["status"], "reason": f"generate_artifacts: {res.get('reason')}"}
    return ready


def graph_json(model: onnx.ModelProto) -> dict:
    def value(attr):
        v = onnx.helper.get_attribute_value(attr)
        return v.decode() if isinstance(v, bytes) else list(v) if isinstance(v, (list, tuple)) or hasattr(v, "__len__") else v

    nodes = [{"op": n.op_type, "name": n.name, "inputs": list(n.input), "outputs": list(n.output),
              "attrs": {a.name: value(a) for a in n.attribute}} for n in model.graph.node]
    return {"input": model.graph.input[0].name, "output": model.graph.output[0].name, "nodes": nodes}


def odt_artifacts(config: cfgs.Config, forward: Path, out: Path, trainable: list[str]) -> None:
    from odt_ops import artifacts

    out.mkdir(exist_ok=True)
    optimizer = {"AdamW": artifacts.OptimType.AdamW, "SGD": artifacts.OptimType.SGD}[config.optimizer]
    artifacts.generate_artifacts(str(forward), requires_grad=trainable, frozen_params=list(config.frozen),
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer, artifact_directory=out)


def _batches(config: cfgs.Config, args: argparse.Namespace) -> list[int]:
    return args.batches or list(config.batches or (16, 64, 256))


def machine_info() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=repo_root())
    # the odt workers run the engine as it is in the work tree, uncommitted changes included
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "odt_ops"], capture_output=True, text=True, cwd=repo_root())
    return {"platform": platform.platform(), "cpu": cpu_name(), "cores": os.cpu_count(),
            "python": sys.version.split()[0], "git_commit": commit.stdout.strip() or None,
            "engine_modified": bool(dirty.stdout.strip()) if commit.returncode == 0 else None,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "load_average_start": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.setup_peers:
        return setup_peers()
    configs = cfgs.resolve(args.configs)
    envs = {p: locate(p) for p in args.peers}
    log = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr, flush=True))
    for env in envs.values():
        log(f"{env.name:14s} {env.python or 'missing: ' + env.reason}")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="odt-bench-"))
    doc = {"schema": SCHEMA, "machine": machine_info(),
           "settings": {"configs": [c.name for c in configs], "batches": {c.name: _batches(c, args) for c in configs}, "steps": args.steps,
                        "warmup": args.warmup, "eval_steps": args.eval_steps, "repeats": args.repeats,
                        "time_budget_s": args.time_budget, "peers": args.peers, "threads": args.threads,
                        "personalize_steps": args.personalize_steps},
           "peers": {p: {"available": e.python is not None, "python": e.python, "reason": e.reason or None}
                     for p, e in envs.items()},
           "configs": {c.name: c.description for c in configs},
           "results": [], "personalize": []}
    doc["settings"]["bytecode"] = compile_bytecode(envs, repo_root() / "odt_ops")
    try:
        readies = {config.name: prepare(config, workdir, envs, args.worker_timeout) for config in configs}
        for threads in args.threads:
            for config in configs:
                ready = readies[config.name]
                for batch in _batches(config, args):
                    job = {"mode": "run", "config": config.to_json(), "batch": batch, "seed": 1000 + batch, "steps": args.steps,
                           "warmup": args.warmup, "eval_steps": args.eval_steps, "time_budget_s": args.time_budget}
                    runs = _rotated_runs(args.peers, envs, ready, job, workdir / config.name, args, threads, log)
                    doc["results"].append({**summarize(config.name, batch, runs, envs, ready), "threads": threads})
                if args.personalize_steps:
                    batch = _batches(config, args)[0]
                    peers = [p for p in args.peers if p not in NO_PERSONALIZATION]
                    job = {"mode": "personalize", "config": config.to_json(), "batch": batch, "seed": 1000 + batch,
                           "personalize_steps": args.personalize_steps, "export_dir": str(workdir / config.name)}
                    runs = _rotated_runs(peers, envs, ready, job, workdir / config.name, args, threads, log)
                    doc["personalize"].append({**summarize_personalization(config.name, batch, runs, envs, ready), "threads": threads})
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    doc["machine"]["load_average_end"] = os.getloadavg()
    Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    print(render_tables(doc))
    print(f"\nwritten: {args.json}")
    return 0


def _rotated_runs(peers: list[str], envs: dict[str, PeerEnv], ready: dict[str, dict], job: dict, directory: Path,
                  args: argparse.Namespace, threads: int, log) -> dict[str, list[dict]]:
    """``job`` run by each peer ``args.repeats`` times, a fresh process each, rotating who goes first."""
    runs: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(args.repeats):
        k = r % len(peers)
        for peer in peers[k:] + peers[:k]:
            fields = ready.get(peer, {})
            if envs[peer].python is None or "status" in fields:
                continue
            path = directory / f"job-{job['mode']}-{peer}-{job['batch']}-t{threads}.json"
            res = run_worker(envs[peer], {**job, "peer": peer, **fields}, path, args.worker_timeout, threads)
            runs[peer].append(res)
            log(_progress(job["config"]["name"], job["batch"], r, res, threads))
    return runs


def _progress(config: str, batch: int, repeat: int, res: dict, threads: int = 1) -> str:
    head = f"{config} b{batch} t{threads} r{repeat} {res['peer']:14s}"
    if res["status"] != "ok":
        return f"{head} {res['status']}: {res.get('reason', '')}"
    if "personalize_ms" in res:
        return f"{head} personalize {res['personalize_ms']:9.1f} ms"
    train = sorted(res["train_ms"])[len(res["train_ms"]) // 2]
    return f"{head} train {train:8.3f} ms  rss {res['peak_rss_mib']:6.1f} MiB  cold {res['cold_start_ms']:7.1f} ms"
