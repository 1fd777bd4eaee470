"""Scale of a simulated federation: time per round and peak memory at 100, 1,000 and 10,000
clients, 100 of them sampled per round (training and evaluation), on Flower's simulation engine.

    python scripts/federated_scale.py                 # 100 1000 10000 clients, 3 rounds each; prints a table
    python scripts/federated_scale.py --clients 100 --rounds 5 --json scale.json

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
    from pipeline import config, convert, generate, prepare, pretrain, training, users
    from pipeline.paths import Paths

    cfg = config.load(["tracking=disabled"], root=ROOT)
    paths = Paths(workdir)
    gen = paths.artifacts
    if not gen.checkpoint.is_file():
        for stage in (prepare, convert, pretrain, generate):
            stage.run(cfg, paths)
    test = training.load_split(paths, "global_test")
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[100, 1000, 10000])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sampled", type=int, default=100)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one size
    ap.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
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
