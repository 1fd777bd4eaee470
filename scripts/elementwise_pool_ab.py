"""One benchmark configuration's train step with and without the elementwise thread pool
(odt_ops/kernels/parallel.py), in one process, alternating, so load hits both alike:

    OPENBLAS_NUM_THREADS=2 python scripts/elementwise_pool_ab.py efficientnet-adamw 32 --pool 2

prints the median train step (forward, backward, AdamW step, gradient reset) of each over
``--steps`` steps. The README's Performance section quotes it.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.benchmark import configs
from odt_ops.benchmark.driver import odt_artifacts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("batch", type=int)
    p.add_argument("--pool", default="blas", help="ODT_ELEMENTWISE_THREADS for the pool's side (default: blas)")
    p.add_argument("--steps", type=int, default=60)
    args = p.parse_args()
    config = configs.resolve([args.config])[0]
    work = Path(tempfile.mkdtemp(prefix="odt-pool-ab-"))
    model = configs.torch_model(config) if config.torch else configs.forward_model(config)
    onnx.save(model, work / "forward.onnx")
    odt_artifacts(config, work / "forward.onnx", work / "artifacts", configs.trainable(config, model))
    art = work / "artifacts"
    module = Module(art / "training_model.onnx", CheckpointState.load_checkpoint(art / "checkpoint"), art / "eval_model.onnx")
    optimizer = Optimizer(art / "optimizer_model.onnx", module)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, *config.input_shape)).astype(np.float32)
    y = rng.integers(0, config.classes, args.batch).astype(np.int64)

    def step() -> float:
        t = time.perf_counter()
        module(x, y)
        optimizer.step()
        module.lazy_reset_grad()
        return time.perf_counter() - t

    times: dict[str, list[float]] = {"without the pool": [], f"ODT_ELEMENTWISE_THREADS={args.pool}": []}
    for _ in range(5):
        step()
    for _ in range(args.steps):
        for side in times:  # alternate, so a burst of load falls on both
            if side.startswith("ODT_"):
                os.environ["ODT_ELEMENTWISE_THREADS"] = args.pool
            else:
                os.environ.pop("ODT_ELEMENTWISE_THREADS", None)
            times[side].append(step())
    print(f"{args.config} batch {args.batch}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}:")
    for side, t in times.items():
        print(f"  {side:32s} median {np.median(t) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
