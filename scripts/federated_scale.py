"""Scale of a simulated federation: time per round and peak memory at 100, 1,000 and 10,000
clients, 100 of them sampled per round (training and evaluation), on Flower's simulation engine.

    python scripts/federated_scale.py                 # 100 1000 10000 clients, 3 rounds each; prints a table
    python scripts/federated_scale.py --clients 100 --rounds 5 --json scale.json
    python scripts/federated_scale.py --supernodes 32   # one SuperLink, 32 SuperNode processes on 127.0.0.1

Each size runs in a fresh process (its own Ray instance) on the demo's artifacts (the MLP
64-64-10 with its head trainable, as the pipeline generates it) and the demo's population
(users made on demand from (seed, client id): no process ever holds every client's data).
Reported per size: the one-time query of every node's client id (it includes Ray's start),
the mean time of rounds 2.. (round 1 starts the workers' engines), and peak resident memory:
the driver's (server + simulation engine), the largest Ray worker's (the ClientApp actors,
each playing one sampled client after another) and the sum over the driver and its Ray
processes. Flat in the population size is the claim this measures.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(clients: int, rounds: int, sampled: int, workdir: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    import psutil

    from odt_ops.federated.settings import FederationSettings
    from odt_ops.federated.simulation import simulate
    from odt_ops.federated.task import central_evaluation
    from pipeline import config, convert, generate, inputs, prepare, pretrain, users
    from pipeline.paths import Paths

    cfg = config.load(["tracking=disabled"], root=ROOT)
    paths = Paths(workdir)
    gen = paths.artifacts
    if not gen.checkpoint.is_file():
        for stage in (prepare, convert, pretrain, generate):
            stage.run(cfg, paths)
    test = inputs.load_split(paths, "global_test")
    population = users.population(cfg, paths)
    fraction = min(1.0, sampled / clients)
    settings = FederationSettings(rounds=rounds, clients=clients, fraction_train=fraction, fraction_evaluate=fraction,
                                  min_train_clients=sampled, min_evaluate_clients=sampled, local_epochs=3, lr=0.005,
                                  seed=0, round_timeout=3600, connect_timeout=600)
    me = psutil.Process()
    peak = {"driver": 0, "worker": 0, "total": 0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                procs = [me, *me.children(recursive=True)]
                rss = {p.pid: p.memory_info().rss for p in procs if p.is_running()}
                actors = [rss[p.pid] for p in procs if p.pid in rss and "ClientAppActor" in " ".join(p.cmdline())]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            peak["driver"] = max(peak["driver"], rss.get(me.pid, 0))
            peak["worker"] = max([peak["worker"], *actors])
            peak["total"] = max(peak["total"], sum(rss.values()))
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.monotonic()
    result = simulate(gen.directory, population.data, settings, evaluate_fn=central_evaluation(gen.directory, test.x, test.y),
                      num_cpus=os.cpu_count())
    wall = time.monotonic() - t0
    stop.set()
    t.join()
    later = [r.seconds for r in result.rounds[1:]] or [r.seconds for r in result.rounds]
    return {
        "clients": clients, "sampled_per_round": sampled, "rounds": rounds,
        "query_seconds": round(result.query_seconds, 2),
        "round_seconds": [round(r.seconds, 3) for r in result.rounds],
        "seconds_per_round": round(sum(later) / len(later), 3),
        "wall_seconds": round(wall, 1),
        "peak_rss_driver_mb": round(peak["driver"] / 2**20, 1),
        "peak_rss_worker_mb": round(peak["worker"] / 2**20, 1),
        "peak_rss_total_mb": round(peak["total"] / 2**20, 1),
        "participants": [r.participants for r in result.rounds],
        "global_test_accuracy": [round(r.server_eval.get("accuracy", float("nan")), 4) for r in result.rounds],
    }


NODE_BYTES = 480 * 2**20  # one SuperNode with its SuperExec and ClientApp processes, as measured here (257-467 MB)


def deployment(supernodes: int, rounds: int, workdir: Path) -> dict:
    """One SuperLink and ``supernodes`` SuperNode processes on 127.0.0.1 (insecure, as the
    README's recipe), the app run with 10% of them sampled per round: whether every node
    registered and took part, and the resident memory of the SuperLink and of the nodes
    (each SuperNode with the SuperExec and ClientApp processes it starts)."""
    import socket

    import psutil

    def free_port() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    bin_dir = Path(sys.executable).parent
    port = free_port()
    home = workdir / "flwr_home"
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(f'[superlink]\ndefault = "fleet"\n\n[superlink.fleet]\naddress = "127.0.0.1:{port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    procs: list[subprocess.Popen] = []

    def start(name: str, *cmd: str) -> subprocess.Popen:
        p = subprocess.Popen([str(bin_dir / cmd[0]), *cmd[1:]], env=env, cwd=ROOT,
                             stdout=open(logs / f"{name}.log", "w"),  # noqa: SIM115 - the child holds it open
                             stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(p)
        return p

    def tree_rss(p: subprocess.Popen) -> int:
        try:
            pp = psutil.Process(p.pid)
            return sum(q.memory_info().rss for q in [pp, *pp.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    t0 = time.monotonic()
    try:
        link = start("superlink", "flower-superlink", "--insecure", "--host", "127.0.0.1", "--port", str(port),
                     "--disable-runtime-dependency-installation")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "Uvicorn running" not in (logs / "superlink.log").read_text():
            time.sleep(0.5)
        nodes = [start(f"supernode{i}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{port}", "--port", str(free_port()),
                       "--node-config", f"partition-id={i}") for i in range(supernodes)]
        fraction = max(0.1, 1 / supernodes)
        overrides = f"federated.clients={supernodes} federated.rounds={rounds} federated.fraction_train={fraction} " \
                    f"federated.fraction_evaluate={fraction} federated.min_successful_clients=1 federated.connect_timeout=600"
        run = subprocess.run([str(bin_dir / "flwr"), "run", str(ROOT), "fleet", "--stream", "--run-config", f"overrides='{overrides}'"],
                             env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600)
        started = time.monotonic() - t0
        link_rss, node_rss = tree_rss(link), [tree_rss(n) for n in nodes]
        lines = [line for line in run.stdout.splitlines() if "clients succeeded" in line]
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):  # already gone
                os.killpg(p.pid, 15)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
    return {"supernodes": supernodes, "returncode": run.returncode, "rounds": [line[line.index("round "):] for line in lines],
            "wall_seconds": round(started, 1), "superlink_rss_mb": round(link_rss / 2**20, 1),
            "supernode_rss_mb_mean": round(sum(node_rss) / len(node_rss) / 2**20, 1), "supernodes_rss_total_mb": round(sum(node_rss) / 2**20, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sampled", type=int, default=100)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--supernodes", type=int, help="instead: one SuperLink and this many SuperNode processes (needs dvc repro generate)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one size
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.supernodes:
        import psutil

        need = args.supernodes * NODE_BYTES
        if need > psutil.virtual_memory().available:
            print(f"{args.supernodes} SuperNodes need about {need / 2**30:.1f} GiB here ({NODE_BYTES / 2**20:.0f} MiB each, measured), "
                  f"more than the {psutil.virtual_memory().available / 2**30:.1f} GiB available; use fewer", file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="odt-fl-fleet-") as tmp:
            r = deployment(args.supernodes, args.rounds, Path(tmp))
        print(json.dumps(r, indent=1))
        if args.json:
            args.json.write_text(json.dumps(r, indent=1))
        return 0 if r["returncode"] == 0 else 1
    if args.one:
        print("RESULT " + json.dumps(measure(args.clients[0], args.rounds, args.sampled, args.workdir)), flush=True)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="odt-fl-scale-") as tmp:
        for n in args.clients:
            proc = subprocess.run([sys.executable, __file__, "--one", "--clients", str(n), "--rounds", str(args.rounds), "--sampled",
                                   str(args.sampled), "--workdir", tmp], capture_output=True, text=True, timeout=3600)
            line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"{n} clients: failed\n{proc.stderr[-3000:]}", file=sys.stderr)
                return 1
            results.append(json.loads(line[len("RESULT "):]))
            r = results[-1]
            print(f"{r['clients']:>5} clients, {r['sampled_per_round']} per round: {r['seconds_per_round']:.2f} s per round "
                  f"(rounds {r['round_seconds']}), client-id query {r['query_seconds']:.1f} s, peak RSS driver {r['peak_rss_driver_mb']:.0f} MB, "
                  f"largest worker {r['peak_rss_worker_mb']:.0f} MB, "
                  f"driver + Ray {r['peak_rss_total_mb']:.0f} MB", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
