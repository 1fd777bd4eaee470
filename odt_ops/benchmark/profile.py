"""Where odt's train step spends its time: ``python -m odt_ops.benchmark.profile --config mlp-adamw --batch 64``;
and how its memory grows with the batch: ``... --config cnn-adamw --memory 8 32 128``; and what
fine-tuning costs in memory by mode: ``... --config transformer-adamw --memory 32 --modes full lora``.

In one process (``--threads N`` BLAS and OpenMP threads, default 1, set before numpy loads;
compare two counts to see which nodes scale): the step split into
Module call (forward + backward plan), Optimizer.step and lazy_reset_grad; the time of
every node of the training plan (each kernel wrapped in a timer, so the rest of the
Module call is the engine's Python overhead); then cProfile's top functions. It reads
the Module's compiled plan (``module.compiled_train.plan``) and wraps its kernels, so it
is a diagnostic, not an API.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from odt_ops.benchmark.driver import thread_env
from odt_ops.kernels import parallel, products


def _session(config, directory: str, batch: int):
    import onnx

    from odt_ops.api import CheckpointState, Module, Optimizer
    from odt_ops.benchmark import configs as cfgs
    from odt_ops.benchmark.driver import odt_artifacts

    model = cfgs.forward_model(config)
    forward = Path(directory) / "forward.onnx"
    onnx.save(model, forward)
    out = Path(directory) / "odt"
    odt_artifacts(config, forward, out, cfgs.trainable(config, model))
    state = CheckpointState.load_checkpoint(f"{out}/checkpoint")
    module = Module(f"{out}/training_model.onnx", state, f"{out}/eval_model.onnx")
    optimizer = Optimizer(f"{out}/optimizer_model.onnx", module)
    optimizer.set_learning_rate(config.lr)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *config.input_shape), dtype=np.float32)
    y = rng.integers(0, config.classes, batch, dtype=np.int64)
    return module, optimizer, x, y


def _train_step(module, optimizer, x, y):
    def train_step():
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
    return train_step


def _median_ms(fn, steps: int) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1000)


def _node_times(plan, run, steps: int) -> dict[str, tuple[str, float]]:
    """Run with every kernel of ``plan`` wrapped in a timer; per node: (op, median ms)."""
    acc: dict[str, list] = {}
    ops: dict[str, str] = {}

    def wrap(step, fn):
        key = step.node.name or step.node.output[0]
        times = acc.setdefault(key, [])
        ops[key] = step.node.op_type

        def timed(*args, **kwargs):
            t = time.perf_counter()
            res = fn(*args, **kwargs)
            times.append(time.perf_counter() - t)
            return res
        return timed

    plan.instrument(wrap)
    try:
        for _ in range(steps):
            run()
    finally:
        plan.instrument(None)
    return {key: (ops[key], float(np.median(times)) * 1000) for key, times in acc.items()}


def profile(config_name: str, batch: int, steps: int, top: int) -> str:
    from odt_ops.benchmark import configs as cfgs

    config = cfgs.CONFIGS[config_name]
    lines = []
    with tempfile.TemporaryDirectory() as d:
        module, optimizer, x, y = _session(config, d, batch)
        train_step = _train_step(module, optimizer, x, y)
        for _ in range(min(20, steps)):  # warm-up
            train_step()
        step_ms = _median_ms(train_step, steps)
        call_ms = _median_ms(lambda: module(x, y), steps)
        opt_ms = _median_ms(optimizer.step, steps)
        reset_ms = _median_ms(module.lazy_reset_grad, steps)
        plan = module.compiled_train.plan
        nodes = _node_times(plan, lambda: module(x, y), steps)
        kernel_ms = sum(ms for _, ms in nodes.values())
        lines.append(f"{config.name} ({config.description}), batch {batch}, {steps} steps, {len(plan.steps)} plan nodes, "
                     f"{parallel.blas_threads()} BLAS thread(s)")
        lines.append(f"train step {step_ms:.3f} ms = Module call {call_ms:.3f} + Optimizer.step {opt_ms:.3f} "
                     f"+ lazy_reset_grad {reset_ms:.4f} (medians; the parts need not add up exactly)")
        lines.append(f"Module call: kernels {kernel_ms:.3f} ms (sum of node medians), the rest {call_ms - kernel_ms:.3f} ms "
                     f"(plan loop, feeds, gradient copies; {(call_ms - kernel_ms) / len(plan.steps) * 1000:.1f} us per node)")
        by_op: dict[str, float] = defaultdict(float)
        for op, ms in nodes.values():
            by_op[op] += ms
        module.eval()
        eval_ms = _median_ms(lambda: module(x, y), steps)
        eval_nodes = _node_times(module.compiled_eval.plan, lambda: module(x, y), steps)
        module.train()
        lines.append(f"eval step {eval_ms:.3f} ms: kernels {sum(ms for _, ms in eval_nodes.values()):.3f} ms in "
                     f"{len(eval_nodes)} nodes; top: " + ", ".join(
                         f"{op} {key[:30]} {ms:.3f}" for key, (op, ms) in sorted(eval_nodes.items(), key=lambda kv: -kv[1][1])[:4]))
        chosen = plan.formulations()
        lines.append(f"\nmatrix products' formulations (ODT_GEMM={products.rule()}; kernels/products.py):")
        lines += [f"  {node:40s} {'; '.join(choices)}" for node, choices in chosen.items()] or ["  (none)"]
        lines.append("\nby op type (sum of the nodes' median ms, % of the Module call):")
        for op, ms in sorted(by_op.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {op:28s} {ms:8.3f}  {ms / call_ms * 100:5.1f}%")
        lines.append("\ntop nodes (median ms):")
        for key, (op, ms) in sorted(nodes.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {op:24s} {key[:52]:52s} {ms:8.3f}")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            train_step()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        lines.append("\ncProfile, by own time (" + f"{steps} train steps):")
        lines.append("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
    return "\n".join(lines)


def memory_report(config_name: str, batches: list[int]) -> str:
    """Per batch: the peak of the engine's allocations during one train step (tracemalloc: numpy
    reports its buffers to it), and the bytes of the forward values the backward pass reads (the
    activations a training step must keep). Peak growth per sample against saved bytes per sample
    says whether memory grows with the batch no faster than those activations."""
    import tracemalloc

    from odt_ops.benchmark import configs as cfgs

    config = cfgs.CONFIGS[config_name]
    rows = []
    for batch in batches:
        with tempfile.TemporaryDirectory() as d:
            module, optimizer, x, y = _session(config, d, batch)
            train_step = _train_step(module, optimizer, x, y)
            train_step()  # first step: the plan's one-time work is not the step's memory
            step = module.compiled_train
            data = {spec.name: value for spec, value in zip(step.inputs, (x, y))}
            saved = _saved_activation_bytes(step.plan, data, lambda: module(x, y))  # noqa: B023 - called in this iteration
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            train_step()
            peak = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
        rows.append((batch, peak, saved))
    lines = [f"{config.name}: one train step's allocation peak (tracemalloc) and the forward values the backward reads",
             f"{'batch':>6} {'peak KiB':>10} {'saved KiB':>10} {'peak/saved':>11}"]
    lines += [f"{b:>6} {p / 1024:>10.1f} {sv / 1024:>10.1f} {p / sv:>11.2f}" for b, p, sv in rows]
    (b0, p0, s0), (b1, p1, s1) = rows[0], rows[-1]
    if b1 > b0:
        lines.append(f"growth per sample from batch {b0} to {b1}: peak {(p1 - p0) / (b1 - b0) / 1024:.1f} KiB, "
                     f"saved activations {(s1 - s0) / (b1 - b0) / 1024:.1f} KiB (ratio {(p1 - p0) / max(s1 - s0, 1):.2f})")
    return "\n".join(lines)


# LoRA as the memory comparison runs it: rank 4 beside every MatMul, Gemm and Conv weight whose
# shape allows rank 4 (a grouped or too-small Conv is left out by op-type selection or by the rank check)
MEMORY_LORA = {"rank": 4, "alpha": 8.0}


def mode_memory_report(config_name: str, batch: int, modes: list[str]) -> str:
    """Per fine-tuning mode, one process's view of a device doing it: from loading the
    checkpoint and the artifacts (parameters, gradients, optimizer state, the compiled plans)
    through two train steps, the peak of the engine's allocations (tracemalloc: numpy reports
    its buffers), and the trainable parameters with their optimizer state."""
    import tracemalloc

    from odt_ops.api import CheckpointState, Module, Optimizer
    from odt_ops.benchmark import configs as cfgs
    from odt_ops.export import model_diff, save_diff

    config = cfgs.CONFIGS[config_name]
    rows = []
    for mode in modes:
        with tempfile.TemporaryDirectory() as d:
            out = _mode_artifacts(config, Path(d), mode)
            rng = np.random.default_rng(0)
            x = rng.standard_normal((batch, *config.input_shape), dtype=np.float32)
            y = rng.integers(0, config.classes, batch, dtype=np.int64)
            tracemalloc.start()
            state = CheckpointState.load_checkpoint(f"{out}/checkpoint")
            module = Module(f"{out}/training_model.onnx", state, f"{out}/eval_model.onnx")
            optimizer = Optimizer(f"{out}/optimizer_model.onnx", module)
            optimizer.set_learning_rate(config.lr)
            step = _train_step(module, optimizer, x, y)
            step()
            step()
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            ckpt = state.checkpoint
            trainable = ckpt.trainable_names()
            n_train = int(sum(ckpt.parameters[n].size for n in trainable))
            n_all = int(sum(a.size for a in ckpt.parameters.values()))
            save_diff(model_diff(f"{out}/checkpoint", state), Path(d) / "up.odtdiff")  # what federated learning sends up
            rows.append((mode, n_train, n_all, peak, (Path(d) / "up.odtdiff").stat().st_size))
    full = next((row for row in rows if row[0] == "full"), None)
    lines = [f"{config.name}, batch {batch}: peak allocations from loading the artifacts through two train steps (tracemalloc), "
             "and the model difference a federated round sends up",
             f"{'mode':>6} {'trainable':>11} {'of params':>10} {'peak MiB':>9} {'vs full':>8} {'diff KiB':>9} {'vs full':>8}"]
    for mode, n_train, n_all, peak, up in rows:
        ratios = (f"{peak / full[3]:.2f}", f"{up / full[4]:.3f}") if full else ("-", "-")
        lines.append(f"{mode:>6} {n_train:>11} {n_train / max(n_all, 1):>10.1%} {peak / 2**20:>9.2f} {ratios[0]:>8} {up / 1024:>9.1f} {ratios[1]:>8}")
    return "\n".join(lines)


def _mode_artifacts(config, directory: Path, mode: str) -> Path:
    """The training artifacts of ``config`` for one mode: ``full`` trains every parameter,
    ``lora`` trains LoRA adapters only (MEMORY_LORA) with the base frozen, ``qat`` is
    quantization-aware fine-tuning of the model quantized to QDQ int8."""
    import onnx

    from odt_ops import artifacts
    from odt_ops.benchmark import configs as cfgs

    model = cfgs.forward_model(config)
    forward = directory / "forward.onnx"
    onnx.save(model, forward)
    out = directory / mode
    out.mkdir()
    names = cfgs.parameter_names(config, model)
    optimizer = {"AdamW": artifacts.OptimType.AdamW, "SGD": artifacts.OptimType.SGD}[config.optimizer]
    if mode == "full":
        kwargs = {"requires_grad": names, "frozen_params": []}
    elif mode == "lora":
        kwargs = {"frozen_params": names, "lora": _memory_lora(model)}
    elif mode == "qat":
        forward = _quantized(config, forward, directory)
        kwargs = {"qat": True}
    else:
        raise SystemExit(f"--modes: unknown mode {mode!r}; known: full, lora, qat")
    artifacts.generate_artifacts(str(forward), loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer, artifact_directory=out, **kwargs)
    return out


def _quantized(config, forward: Path, directory: Path) -> Path:
    """``forward`` quantized as users do: onnxruntime.quantization.quantize_static, QDQ, per-channel int8."""
    try:
        from onnxruntime import quantization
    except ImportError:
        raise SystemExit("--modes qat quantizes the model with onnxruntime.quantization: pip install onnxruntime") from None

    class Calibration(quantization.CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(1)
            self.batches = iter([{"input": rng.standard_normal((8, *config.input_shape), dtype=np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    out = directory / "qdq.onnx"
    quantization.quantize_static(str(forward), str(out), Calibration(), quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 activation_type=quantization.QuantType.QInt8, weight_type=quantization.QuantType.QInt8)
    return out


def _memory_lora(model):
    """MEMORY_LORA's targets: every adaptable weight whose shape allows its rank."""
    from odt_ops import load_model
    from odt_ops.lora import LoraConfig
    from odt_ops.lora.targets import find_candidates

    rank = MEMORY_LORA["rank"]
    fits = [t.weight for t in find_candidates(load_model(model).graph).values()
            if t.reason is None and t.rank_limit >= rank]
    return LoraConfig(rank=rank, alpha=MEMORY_LORA["alpha"], targets=fits)


def _saved_activation_bytes(plan, data: dict, run) -> int:
    """Bytes of the values the gradient nodes read that the forward pass made or the user fed
    (``data``: the batch's inputs and labels), in one run of ``plan``."""
    def is_gradient(node) -> bool:
        return node.name.startswith(("grad/", "fused/grad/"))

    read_by_backward = {n for step in plan.steps if is_gradient(step.node) for n in step.inputs if n}
    buffers: dict[int, np.ndarray] = {}  # by the array owning the memory: a Reshape's view is not counted twice

    def keep(value: np.ndarray) -> None:
        while isinstance(value.base, np.ndarray):
            value = value.base
        buffers[id(value)] = value

    for name, value in data.items():
        if name in read_by_backward:
            keep(value)

    def wrap(step, fn):
        if is_gradient(step.node):
            return fn

        def recorded(*args, **kwargs):
            outputs = fn(*args, **kwargs)
            for name, value in zip(step.outputs, outputs):
                if name in read_by_backward and isinstance(value, np.ndarray):
                    keep(value)
            return outputs
        return recorded

    plan.instrument(wrap)
    try:
        run()
    finally:
        plan.instrument(None)
    return sum(value.nbytes for value in buffers.values())


def main(argv: list[str] | None = None) -> int:
    from odt_ops.benchmark import configs as cfgs

    p = argparse.ArgumentParser(prog="python -m odt_ops.benchmark.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="mlp-adamw", choices=list(cfgs.CONFIGS))
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--memory", type=int, nargs="+", metavar="BATCH",
                   help="instead: the train step's allocation peak against the saved activations at these batches")
    p.add_argument("--modes", nargs="+", choices=["full", "lora", "qat"],
                   help="with --memory: peak memory of fine-tuning in each mode (full, lora, qat: a QDQ model from "
                        "onnxruntime.quantization with float master weights) at the first batch given")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="BLAS and OpenMP threads (default 1), as the benchmark's --threads sets them")
    args = p.parse_args(argv)
    if args.threads < 1:
        p.error("--threads must be >= 1")
    wanted = thread_env(args.threads)
    if any(os.environ.get(k) != v for k, v in wanted.items()):
        # BLAS reads its thread count when numpy loads (already, via odt_ops): start again with the count
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "odt_ops.benchmark.profile", *argv], {**os.environ, **wanted})
    if args.modes and not args.memory:
        p.error("--modes needs --memory BATCH")
    if args.modes:
        print(mode_memory_report(args.config, args.memory[0], args.modes))
    else:
        print(memory_report(args.config, args.memory) if args.memory else profile(args.config, args.batch, args.steps, args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
