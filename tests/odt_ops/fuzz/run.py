"""Run fuzz cases: damage one real file, use the folder as a user would, judge what happened.

Each case copies the originals into a fresh folder, replaces one file by a damaged version
(mutate.py), then runs the use step for that file: load the checkpoint and train a step,
take an optimizer step, evaluate and save; fill a nominal checkpoint and train; apply a model
difference; load a forward model, run it and generate artifacts from it; read ONNX Runtime's
checkpoint. The working directory is a decoy folder outside the case holding files named like
the ones a model may point at, so a read relative to it is seen too.

Outcomes: ``ok`` (it worked, or training diverged: a legitimate outcome of damaged weights),
``typed`` (an odt_ops error naming the file), and the failures: ``unnamed`` (ours, not naming
the file), ``untyped:<class>``, ``outside`` (a file outside the case folder was opened, seen by
the audit hook), ``slow`` and ``memory`` (over the per-case bounds).

    python -m tests.odt_ops.fuzz.run --cases 5000 --seed 20   # the release run; prints counts
"""
from __future__ import annotations

import argparse
import collections
import os
import shutil
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tests.odt_ops.fuzz import mutate, originals
from tests.odt_ops.fuzz.watch import outside, watching

# CPU seconds a case may take (a clean case takes ~10-100 ms); CPU time, not wall time, so that a
# machine loaded by other work does not fail a case, while a bomb being inflated still does
TIME_LIMIT = 5.0
MEMORY_LIMIT = 48 << 20  # bytes a case may allocate (tracemalloc's peak); the originals are a few KiB


@dataclass
class Result:
    index: int
    target: str
    what: str
    outcome: str
    detail: str = ""


class Fuzzer:
    """One set of originals, outside files and a decoy working directory; cases run one by one."""

    def __init__(self, root: Path, seed: int):
        self.root, self.seed = root, seed
        self.trace = False  # print each error's traceback (one case rerun by hand)
        self.originals = originals.build(root / "originals")
        self.outside = root / "outside"
        self.outside.mkdir()
        self.decoy = root / "cwd"
        self.decoy.mkdir()
        for name in ("forward.data", "secret.data", "linked.data", "nothere.data", "ort_checkpoint.data"):
            (self.decoy / name).write_bytes(b"\x7f" * 4096)
        from odt_ops.api import CheckpointState, Module

        state = CheckpointState.load_checkpoint(self.originals / "trained")
        module = Module(self.originals / "training_model.onnx", state)
        self.weights = np.array(module.get_contiguous_parameters())  # what fills the nominal checkpoint

    def run(self, index: int) -> Result:
        target, kind, use = TARGETS[index % len(TARGETS)]
        rng = np.random.default_rng([self.seed, index])
        case = self.root / f"case{index}"
        shutil.copytree(self.originals, case)
        damage = mutate.MUTATORS[kind]((self.originals / target).read_bytes(), rng, str(self.outside))
        (case / target).write_bytes(damage.data)
        self._place(case, damage)
        named = {str(case / target), str(case / target.replace(".data", ""))}
        cwd = os.getcwd()
        os.chdir(self.decoy)
        tracemalloc.start()
        start = time.process_time()
        error: BaseException | None = None
        try:
            with watching() as opened:
                try:
                    use(self, case)
                except Exception as exc:
                    error = exc
                    if self.trace:
                        import traceback

                        traceback.print_exc()
        finally:
            elapsed = time.process_time() - start
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            os.chdir(cwd)
        result = Result(index, target, damage.what, *self._judge(error, named, outside(opened, case), elapsed, peak))
        shutil.rmtree(case, ignore_errors=True)
        return result

    def _place(self, case: Path, damage: mutate.Damage) -> None:
        for name, data in damage.outside.items():
            (self.outside / name).write_bytes(data)
        for name, spec in damage.extras.items():
            path = case / name
            if path.exists() or path.is_symlink():
                path.unlink()
            if spec[0] == "symlink":
                os.symlink(spec[1].replace("OUTSIDE", str(self.outside)), path)
            elif spec[0] == "dir":
                path.mkdir()
            elif spec[0] == "fifo":
                os.mkfifo(path)
            elif spec[0] == "truncate":
                path.write_bytes((self.originals / name).read_bytes()[:100])

    @staticmethod
    def _judge(error, named: set[str], out: list[str], elapsed: float, peak: int) -> tuple[str, str]:
        from odt_ops.errors import OdtError, TrainingDivergedError

        if out:
            return "outside", f"opened {out[:3]}"
        if elapsed > TIME_LIMIT:
            return "slow", f"{elapsed:.1f} s of CPU; {type(error).__name__ if error else 'no error'}"
        if peak > MEMORY_LIMIT:
            return "memory", f"{peak >> 20} MiB; {type(error).__name__ if error else 'no error'}"
        if error is None or isinstance(error, TrainingDivergedError):
            return "ok", ""
        message = str(error)
        if not isinstance(error, OdtError):
            return f"untyped:{type(error).__name__}", message[:300]
        if not any(n in message for n in named):
            return "unnamed", f"{type(error).__name__}: {message[:300]}"
        return "typed", type(error).__name__


# ---- the use steps ---------------------------------------------------------------------------
def _train(case: Path, state) -> None:
    from odt_ops.api import CheckpointState, Module, Optimizer

    module = Module(case / "training_model.onnx", state, case / "eval_model.onnx")
    optimizer = Optimizer(case / "optimizer_model.onnx", module)
    module(*originals.batch())
    optimizer.step()
    module.eval()
    module(*originals.batch())
    CheckpointState.save_checkpoint(state, case / "resaved", include_optimizer_state=True)
    return module


def use_checkpoint(name: str) -> Callable:
    def use(fuzzer: Fuzzer, case: Path) -> None:
        from odt_ops.api import CheckpointState

        _train(case, CheckpointState.load_checkpoint(case / name))
    return use


def use_nominal(fuzzer: Fuzzer, case: Path) -> None:
    from odt_ops.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(case / "nominal_checkpoint")
    module = Module(case / "training_model.onnx", state, case / "eval_model.onnx")
    module.copy_buffer_to_parameters(fuzzer.weights, trainable_only=False)
    optimizer = Optimizer(case / "optimizer_model.onnx", module)
    module(*originals.batch())
    optimizer.step()


def use_diff(fuzzer: Fuzzer, case: Path) -> None:
    from odt_ops.export import aggregate, apply_diff, load_diff

    aggregate([load_diff(case / "update.odtdiff")] * 2)
    apply_diff(case / "checkpoint", case / "update.odtdiff")


def use_artifacts(fuzzer: Fuzzer, case: Path) -> None:
    from odt_ops.api import CheckpointState

    module = _train(case, CheckpointState.load_checkpoint(case / "trained"))
    module.export_model_for_inferencing(case / "inference.onnx")


def use_forward(fuzzer: Fuzzer, case: Path) -> None:
    import odt_ops
    from odt_ops import artifacts

    model = odt_ops.load_model(case / "forward.onnx")
    odt_ops.InferenceSession(model).run(None, {"input": originals.batch()[0]})
    artifacts.generate_artifacts(case / "forward.onnx", requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=case / "generated", opset=21)


def use_ort(fuzzer: Fuzzer, case: Path) -> None:
    from odt_ops.checkpoint import load_checkpoint

    ckpt = load_checkpoint(case / "ort_checkpoint")
    for array in ckpt.parameters.values():
        float(np.asarray(array, dtype=np.float64).sum())


# (file damaged, its mutator, how it is used)
TARGETS: list[tuple[str, str, Callable[[Fuzzer, Path], None]]] = [
    ("trained", "tensorfile", use_checkpoint("trained")),
    ("checkpoint", "tensorfile", use_checkpoint("checkpoint")),
    ("nominal_checkpoint", "tensorfile", use_nominal),
    ("update.odtdiff", "tensorfile", use_diff),
    ("training_model.onnx", "onnx", use_artifacts),
    ("eval_model.onnx", "onnx", use_artifacts),
    ("optimizer_model.onnx", "onnx", use_artifacts),
    ("forward.onnx", "onnx", use_forward),
    ("ort_checkpoint", "ort", use_ort),
]


def fuzz(cases: int, seed: int, root: Path | None = None) -> list[Result]:
    with tempfile.TemporaryDirectory(prefix="odt-fuzz-") as tmp:
        fuzzer = Fuzzer(Path(root or tmp), seed)
        return [fuzzer.run(i) for i in range(cases)]


def summary(results: list[Result]) -> str:
    counts = collections.Counter(r.outcome for r in results)
    lines = [f"{len(results)} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))]
    bad = [r for r in results if r.outcome not in ("ok", "typed")]
    by_kind = collections.Counter((r.outcome, r.target, r.what) for r in bad)
    lines += [f"  {n:4d}  {outcome:28s} {target:22s} {what}" for (outcome, target, what), n in by_kind.most_common()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=5000)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--show", type=int, default=0, help="print the first N failures in full")
    parser.add_argument("--case", type=int, help="rerun this one case and print its traceback")
    args = parser.parse_args()
    if args.case is not None:
        with tempfile.TemporaryDirectory(prefix="odt-fuzz-") as tmp:
            fuzzer = Fuzzer(Path(tmp), args.seed)
            fuzzer.trace = True
            print(fuzzer.run(args.case))
        return
    start = time.perf_counter()
    results = fuzz(args.cases, args.seed)
    print(summary(results))
    for r in [r for r in results if r.outcome not in ("ok", "typed")][: args.show]:
        print(f"case {r.index} {r.target} [{r.what}] {r.outcome}: {r.detail}")
    print(f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
