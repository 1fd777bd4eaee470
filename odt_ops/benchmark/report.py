"""Summaries (medians, spreads, ratios) of the workers' reports, and the printed tables:
time to personalize first (what a user waits for), then the per-step tables, then, when
several thread counts ran, the threads report."""
from __future__ import annotations

import numpy as np

METRICS = ("train_ms", "eval_ms", "peak_rss_mib", "cold_start_ms")
TITLES = {"train_ms": "train step (forward + backward + optimizer step + gradient reset), median ms",
          "eval_ms": "eval step (forward + loss), median ms",
          "peak_rss_mib": "peak resident memory of the worker process, MiB (median over processes)",
          "cold_start_ms": "cold start (import + artifact or model load + first train step), median ms over processes"}
RATIOS = (("odt", "ort-training", "odt/ORT"), ("odt", "torch", "odt/torch"), ("odt", "ort-inference", "odt/ort-inf"))
PERSONALIZE_PARTS = ("cold_start", "train_steps", "export")
# a peer whose processes' train-step medians differ by more than this factor gets a * in the train
# step table: the ± of the pooled steps hides it. On this project's shared 2-core VMs one slow process
# of three (0.52 against 0.311 ms) moved mlp-adamw's odt/ORT at batch 16 from 1.56 to 1.66, and
# two-thread runs differ by up to 1.3x between processes of one peer (runs of 2026-11-27, README)
PROCESS_SPREAD = 1.15


def stats(values) -> dict:
    a = np.asarray(values, dtype=np.float64)
    q10, q25, q50, q75, q90 = np.percentile(a, [10, 25, 50, 75, 90])
    return {"n": int(a.size), "median": float(q50), "mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
            "q10": float(q10), "q25": float(q25), "q75": float(q75), "q90": float(q90),
            "iqr_pct": float((q75 - q25) / q50 * 100) if q50 else None}


def summarize_peer(runs: list[dict]) -> dict:
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        return {"status": "failed", "reason": failed[0].get("reason"), "runs": runs}
    if any(r["status"] == "missing" for r in runs):
        return {"status": "missing", "reason": next(r["reason"] for r in runs if r["status"] == "missing")}
    out = {
        "status": "ok",
        "processes": len(runs),
        # step times pooled over processes; memory and cold start: one value per process
        "train_ms": stats([t for r in runs for t in r["train_ms"]]),
        "eval_ms": stats([t for r in runs for t in r["eval_ms"]]),
        "peak_rss_mib": stats([r["peak_rss_mib"] for r in runs]),
        "cold_start_ms": stats([r["cold_start_ms"] for r in runs]),
        "cold_start_parts_ms": {k: float(np.median([r["cold_start_parts_ms"][k] for r in runs]))
                                for k in runs[0]["cold_start_parts_ms"]},
        "train_ms_per_process": [float(np.median(r["train_ms"])) for r in runs],
        "first_loss": runs[0]["first_loss"],
        "last_loss": runs[0]["last_loss"],
        "eval_loss": runs[0]["eval_loss"],
        "imports_torch": any(r["imports_torch"] for r in runs),
        "load_average": float(np.median([r.get("load_average", np.nan) for r in runs])),
        "versions": runs[0]["versions"],
    }
    starts = [r["process_start_ms"] for r in runs if r.get("process_start_ms") is not None]
    if starts:
        out["process_start_ms"] = float(np.median(starts))  # interpreter start, before the worker's first line
    return out


def summarize(config: str, batch: int, runs: dict[str, list[dict]], envs: dict, ready: dict) -> dict:
    peers = {}
    for peer, peer_runs in runs.items():
        if envs[peer].python is None:
            peers[peer] = {"status": "missing", "reason": envs[peer].reason}
        elif "status" in ready.get(peer, {}):
            peers[peer] = dict(ready[peer])
        else:
            peers[peer] = summarize_peer(peer_runs)
    ratios = {}
    for a, b, label in RATIOS:
        if a in peers and b in peers:
            ratios[label] = {m: (peers[a][m]["median"] / peers[b][m]["median"]
                                 if peers[a]["status"] == peers[b]["status"] == "ok" and peers[b][m]["median"] else None)
                             for m in METRICS}
    first = {p: s["first_loss"] for p, s in peers.items() if s["status"] == "ok"}
    # same weights and data everywhere: the first losses must agree, or the peers train different things
    spread = (max(first.values()) - min(first.values())) / max(abs(min(first.values())), 1e-12) if len(first) > 1 else 0.0
    return {"config": config, "batch": batch, "peers": peers, "ratios": ratios,
            "first_loss_rel_spread": spread}


def summarize_personalization(config: str, batch: int, runs: dict[str, list[dict]], envs: dict, ready: dict) -> dict:
    """Per peer: the median time to personalize over its processes, with the median of each part."""
    peers: dict[str, dict] = {}
    for peer, peer_runs in runs.items():
        failed = [r for r in peer_runs if r["status"] != "ok"]
        if envs[peer].python is None:
            peers[peer] = {"status": "missing", "reason": envs[peer].reason}
        elif "status" in ready.get(peer, {}):
            peers[peer] = dict(ready[peer])
        elif failed or not peer_runs:
            peers[peer] = {"status": failed[0]["status"] if failed else "failed",
                           "reason": failed[0].get("reason") if failed else "no run", "runs": failed}
        else:
            peers[peer] = {"status": "ok", "processes": len(peer_runs),
                           "personalize_ms": stats([r["personalize_ms"] for r in peer_runs]),
                           "parts_ms": {k: float(np.median([r["personalize_parts_ms"][k] for r in peer_runs]))
                                        for k in PERSONALIZE_PARTS},
                           "cold_start_parts_ms": {k: float(np.median([r["cold_start_parts_ms"][k] for r in peer_runs]))
                                                   for k in peer_runs[0]["cold_start_parts_ms"]},
                           "imports_torch": any(r["imports_torch"] for r in peer_runs),
                           "load_average": float(np.median([r["load_average"] for r in peer_runs]))}
    ratios = {label: (peers[a]["personalize_ms"]["median"] / peers[b]["personalize_ms"]["median"]
                      if peers[a]["status"] == peers[b]["status"] == "ok" else None)
              for a, b, label in RATIOS if a in peers and b in peers}
    return {"config": config, "batch": batch, "peers": peers, "ratios": ratios}


def _cell(summary: dict | None, metric: str) -> str:
    if summary is None:
        return "-"
    if summary["status"] != "ok":
        return summary["status"]
    s = summary[metric]
    digits = 3 if s["median"] < 10 else 1 if s["median"] < 1000 else 0
    text = f"{s['median']:.{digits}f}"
    if metric in ("train_ms", "eval_ms") and s["iqr_pct"] is not None:
        text += f" ±{s['iqr_pct'] / 2:.0f}%"
    if metric == "train_ms" and (process_spread(summary) or 0) > PROCESS_SPREAD:
        text += "*"
    return text


def _table(rows: list[list[str]], left: int) -> str:
    """Columns padded to their widest cell; the first ``left`` columns left-aligned, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def render_personalization(doc: dict) -> str:
    """Time to personalize per configuration, thread count and peer, with odt's parts."""
    rows_in = doc.get("personalize") or []
    if not rows_in:
        return ""
    peers = [p for p in doc["settings"]["peers"] if any(p in r["peers"] for r in rows_in)]
    labels = [label for a, b, label in RATIOS if a in peers and b in peers]
    rows = [["config", "batch", "threads", *peers, *labels, "odt: cold + steps + export"]]
    for res in rows_in:
        odt = res["peers"].get("odt", {})
        parts = " + ".join(f"{odt['parts_ms'][k]:.0f}" for k in PERSONALIZE_PARTS) if odt.get("status") == "ok" else "-"
        rows.append([res["config"], str(res["batch"]), str(res["threads"]),
                     *(_cell(res["peers"].get(p), "personalize_ms") for p in peers),
                     *(_ratio(res["ratios"][label]) for label in labels), parts])
    steps = doc["settings"]["personalize_steps"]
    return (f"time to personalize: {steps} train steps from a fresh process (cold start: import, load, the first step; "
            f"then {steps - 1} more) + exporting the inference model, one wall clock per process, median ms over processes\n"
            + _table(rows, 3))


def render_threads(doc: dict) -> str:
    """Train step at each thread count for odt and torch: odt/torch at each, and each one's speed-up over one thread."""
    counts = doc["settings"]["threads"]
    if len(counts) < 2:
        return ""
    by_key: dict[tuple, dict[int, dict]] = {}
    for res in doc["results"]:
        by_key.setdefault((res["config"], res["batch"]), {})[res["threads"]] = res

    def median(res: dict | None, peer: str) -> float | None:
        s = (res or {}).get("peers", {}).get(peer)
        return s["train_ms"]["median"] if s and s["status"] == "ok" else None

    head = ["config", "batch", *(f"{p} t{n}" for p in ("odt", "torch") for n in counts),
            *(f"odt/torch t{n}" for n in counts), *(f"{p} x{n}" for p in ("odt", "torch") for n in counts[1:])]
    rows = [head]
    for (config, batch), at in by_key.items():
        times = {(p, n): median(at.get(n), p) for p in ("odt", "torch") for n in counts}
        cells = ["-" if times[p, n] is None else f"{times[p, n]:.3f}" for p in ("odt", "torch") for n in counts]
        ratios = [_ratio(times["odt", n] / times["torch", n] if times["odt", n] and times["torch", n] else None) for n in counts]
        speedups = [_ratio(times[p, counts[0]] / times[p, n] if times[p, counts[0]] and times[p, n] else None)
                    for p in ("odt", "torch") for n in counts[1:]]
        rows.append([config, str(batch), *cells, *ratios, *speedups])
    cores = doc["machine"]["cores"]
    over = [n for n in counts if n > cores]
    note = (f"\n{cores} cores: {', '.join(map(str, over))} thread(s) oversubscribe them (threads share cores; the times "
            "say what an app gets when it asks for more threads than the device has)") if over else ""
    return ("threads: train step median ms at each thread count (tN), odt/torch at each, and each runtime's speed-up "
            f"over {counts[0]} thread(s) (xN)\n" + _table(rows, 2) + note)


def process_spread(summary: dict) -> float | None:
    """Largest over smallest of a peer's per-process train-step medians (None with one process)."""
    medians = summary.get("train_ms_per_process") or []
    return max(medians) / min(medians) if len(medians) > 1 and min(medians) > 0 else None


def render_tables(doc: dict) -> str:
    peers = doc["settings"]["peers"]
    ratio_labels = [label for a, b, label in RATIOS if a in peers and b in peers]
    several = len(doc["settings"]["threads"]) > 1
    head = ["config", "batch", *(["threads"] if several else []), *peers, *ratio_labels]
    blocks = [b for b in (render_personalization(doc),) if b]
    for metric in METRICS:
        rows = [head]
        for res in doc["results"]:
            row = [res["config"], str(res["batch"]), *([str(res["threads"])] if several else []),
                   *(_cell(res["peers"].get(p), metric) for p in peers)]
            row += [_ratio(res["ratios"][label][metric]) for label in ratio_labels]
            rows.append(row)
        blocks.append(f"{TITLES[metric]}\n" + _table(rows, 3 if several else 2))
    blocks += [b for b in (render_threads(doc),) if b]
    m = doc["machine"]
    notes = ["± is half the interquartile range of all timed steps, relative to the median; "
             "ratios are odt's median over the peer's (below 1: odt is faster or smaller).",
             f"{m['cores']} cores; 1-minute load average {m['load_average_start'][0]:.1f} at the start, "
             f"{m.get('load_average_end', [float('nan')])[0]:.1f} at the end (above ~1, other processes skew the times)."]
    for peer, info in doc["peers"].items():
        if not info["available"]:
            notes.append(f"{peer}: missing ({info['reason']})")
    for res in doc.get("personalize", []):
        notes += [f"{res['config']} batch {res['batch']} {peer} (time to personalize): failed: {s.get('reason')}"
                  for peer, s in res["peers"].items() if s["status"] == "failed"]
    if any((process_spread(s) or 0) > PROCESS_SPREAD for res in doc["results"] for s in res["peers"].values()):
        notes.append(f"* after a train step: that peer's processes' own medians differ by more than {PROCESS_SPREAD}x "
                     "(largest over smallest; train_ms_per_process in the JSON), so the row's ratios rest on which "
                     "process ran slow: compare with more --repeats.")
    for res in doc["results"]:
        for peer, s in res["peers"].items():
            if s["status"] == "failed":
                notes.append(f"{res['config']} batch {res['batch']} {peer}: failed: {s.get('reason')}")
        if res["first_loss_rel_spread"] > 1e-3:
            notes.append(f"{res['config']} batch {res['batch']}: the peers' first losses differ by "
                         f"{res['first_loss_rel_spread']:.1e} (relative): they do not train the same function")
    return "\n\n".join(blocks) + "\n\n" + "\n".join(notes)
