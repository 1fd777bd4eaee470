"""evaluate: the base model (pretrain's) against the personalized one (train's
checkpoint in generate's eval model, through odt_ops.api.Module in eval mode) on the
user's holdout (did personalization pay off?) and on the global test set (what did
it forget?).

Outputs (data/evaluate/):

- ``metrics.json`` (``dvc metrics show``): per split and model the accuracy and the
  cross-entropy loss, plus ``personalization_gain`` (holdout accuracy, personalized
  minus base) and ``forgetting`` (global-test accuracy, base minus personalized);
- ``confusion_base.json``, ``confusion_personalized.json`` (``dvc plots``, confusion
  template): one ``{actual, predicted}`` row per holdout sample.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path

import odt_ops
from odt_ops.api import CheckpointState, Module
from pipeline import inputs, scoring
from pipeline.config import MISSING, Section
from pipeline.io import flatten, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

SPLITS = ("user_holdout", "global_test")
MODELS = ("base", "personalized")

# headline.json (dvc metrics show, dvc exp show; the README's `dvc exp show --keep` names them)
HEADLINE = {"user_holdout.personalized.accuracy": "user_holdout.personalized.accuracy",
            "personalization_gain": "personalization_gain", "forgetting": "forgetting"}


@dataclass
class EvaluateConfig(Section):
    batch_size: int = MISSING

    def check(self) -> None:
        self.need(self.batch_size >= 1, "batch_size", "an integer >= 1")


CONFIG = {"evaluate": EvaluateConfig}


def confusion(paths: Paths, model: str) -> Path:
    """The holdout's ``{actual, predicted}`` rows of ``model`` (base or personalized)."""
    return paths.out("evaluate") / f"confusion_{model}.json"


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    gen = inputs.generated(paths)
    base_path = inputs.upstream(paths.pretrained_model, "pretrain", paths)
    ckpt = inputs.upstream(paths.trained_checkpoint, "train", paths)
    encode = inputs.target_encoder(gen.eval_model)
    base = odt_ops.InferenceSession(base_path)
    (inp,) = base.input_names()
    module = Module(gen.training_model, CheckpointState.load_checkpoint(ckpt), gen.eval_model)
    module.eval()
    predict = {
        "base": lambda x, t: base.run(None, {inp: x})[0],
        "personalized": lambda x, t: module(x, t)[1],
    }
    bs = cfg.evaluate.batch_size
    n = cfg.data.num_classes
    results: dict = {}
    for name in SPLITS:
        split = inputs.load_split(paths, name)
        inputs.check_fits(split, gen.eval_model, paths)
        t = encode(split.y)
        results[name] = {"n": len(split)}
        for model in MODELS:
            r = scoring.classification(scoring.batched(predict[model], split.x, t, bs), split.y, n)
            results[name][model] = {"accuracy": r["accuracy"], "loss": r["loss"]}
            if name == "user_holdout":
                rows = [{"actual": int(a), "predicted": int(p)} for a, p in zip(split.y, r["predicted"])]
                write_json(confusion(paths, model), rows)
    h, g = results["user_holdout"], results["global_test"]
    results["personalization_gain"] = h["personalized"]["accuracy"] - h["base"]["accuracy"]
    results["forgetting"] = g["base"]["accuracy"] - g["personalized"]["accuracy"]
    write_json(paths.metrics("evaluate"), results)
    return {k: v for k, v in flatten(results).items() if not k.endswith(".n")}


def summary(metrics: dict) -> str:
    """One line for people: the demo's headline numbers."""
    m = flatten(metrics) if any(isinstance(v, dict) for v in metrics.values()) else metrics
    return (f"user holdout: base {m['user_holdout.base.accuracy']:.3f} -> personalized {m['user_holdout.personalized.accuracy']:.3f} "
            f"({100 * m['personalization_gain']:+.1f} points); global test: base {m['global_test.base.accuracy']:.3f} -> "
            f"personalized {m['global_test.personalized.accuracy']:.3f} (forgetting {100 * m['forgetting']:.1f} points)")


def after(cfg, paths: Paths, tracker) -> None:
    import json

    metrics = json.loads(paths.metrics("evaluate").read_text())
    tracker.log_parent_metrics({k: v for k, v in flatten(metrics).items() if not k.endswith(".n")})
    tracker.log_plot("confusion", "confusion_user_holdout.png",
                     {"title": "the user's holdout: base vs personalized", "num_classes": cfg.data.num_classes, "models": list(MODELS)},
                     {m: confusion(paths, m) for m in MODELS})


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("evaluate", run, argv, after=after, describe=summary, datasets={"user_holdout": "evaluation", "global_test": "evaluation"},
                      headline=HEADLINE)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
