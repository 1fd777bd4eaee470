"""Summaries (medians, spreads, ratios) of the workers' reports, and the printed tables."""
from __future__ import annotations

import numpy as np

METRICS = ("train_ms", "eval_ms", "peak_rss_mib", "cold_start_ms")
TITLES = {"train_ms": "train step (forward + backward + optimizer step + gradient reset), median ms",
          "eval_ms": "eval step (forward + loss), median ms",
          "peak_rss_mib": "peak resident memory of the worker process, MiB (median over processes)",
          "cold_start_ms": "cold start (import + artifact or model load + first train step), median ms over processes"}
RATIOS = (("odt", "ort-training", "odt/ORT"), ("odt", "torch", "odt/torch"), ("odt", "ort-inference", "odt/ort-inf"))


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
    return text


def render_tables(doc: dict) -> str:
    peers = doc["settings"]["peers"]
    ratio_labels = [label for a, b, label in RATIOS if a in peers and b in peers]
    head = ["config", "batch", *peers, *ratio_labels]
    blocks = []
    for metric in METRICS:
        rows = [head]
        for res in doc["results"]:
            row = [res["config"], str(res["batch"]), *(_cell(res["peers"].get(p), metric) for p in peers)]
            for label in ratio_labels:
                value = res["ratios"][label][metric]
                row.append("-" if value is None else f"{value:.2f}")
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        blocks.append(f"{TITLES[metric]}\n" + "\n".join(lines))
    m = doc["machine"]
    notes = ["± is half the interquartile range of all timed steps, relative to the median; "
             "ratios are odt's median over the peer's (below 1: odt is faster or smaller).",
             f"{m['cores']} cores; 1-minute load average {m['load_average_start'][0]:.1f} at the start, "
             f"{m.get('load_average_end', [float('nan')])[0]:.1f} at the end (above ~1, other processes skew the times)."]
    for peer, info in doc["peers"].items():
        if not info["available"]:
            notes.append(f"{peer}: missing ({info['reason']})")
    for res in doc["results"]:
        for peer, s in res["peers"].items():
            if s["status"] == "failed":
                notes.append(f"{res['config']} batch {res['batch']} {peer}: failed: {s.get('reason')}")
        if res["first_loss_rel_spread"] > 1e-3:
            notes.append(f"{res['config']} batch {res['batch']}: the peers' first losses differ by "
                         f"{res['first_loss_rel_spread']:.1e} (relative): they do not train the same function")
    return "\n\n".join(blocks) + "\n\n" + "\n".join(notes)
