"""Every loss and every optimizer the engine offers is a conf/ option, and each one, composed
from the real conf/, builds its block, generates artifacts and trains."""
from __future__ import annotations

import inspect
import json

import numpy as np
import onnx
import pytest

from odt_ops.api import CheckpointState, ConstantLRScheduler, Module, Optimizer
from odt_ops.onnxblock import Block, loss, optim
from pipeline import generate, inputs, models
from pipeline.paths import Paths
from tests.pipeline.conftest import REPO, load_cfg

LOSSES = sorted(p.stem for p in (REPO / "conf" / "loss").glob("*.yaml"))
OPTIMIZERS = sorted(p.stem for p in (REPO / "conf" / "optimizer").glob("*.yaml"))


def _engine_classes(module, root: type) -> set[str]:
    return {f"{module.__name__}.{name}" for name, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, root) and cls is not root and cls.__module__ == module.__name__}


def test_conf_offers_exactly_the_engines_losses_and_optimizers():
    """A new engine class without a conf/ option (or an option naming no engine class) fails here."""
    assert {load_cfg(f"loss={o}").loss["_target_"] for o in LOSSES} == _engine_classes(loss, Block)
    assert {load_cfg(f"optimizer={o}").optimizer.block["_target_"] for o in OPTIMIZERS} == _engine_classes(optim, optim.Optimizer)
    assert {"cross_entropy", "mse", "l1", "bce_with_logits"} <= set(LOSSES)
    assert {"adam", "adamw", "sgd"} <= set(OPTIMIZERS)


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    return rng.random((16, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 16)


@pytest.mark.parametrize("loss_option,optimizer_option", [*((lo, "adamw") for lo in LOSSES), *(("cross_entropy", o) for o in OPTIMIZERS)])
def test_each_option_generates_artifacts_that_train(loss_option, optimizer_option, batch, tmp_path):
    cfg = load_cfg(f"loss={loss_option}", f"optimizer={optimizer_option}", "optimizer.lr=0.01")
    paths = Paths(tmp_path)
    paths.out("pretrain").mkdir(parents=True)
    onnx.save(models.mlp([1, 8, 8], 10, [16], seed=0), paths.pretrained_model)
    generate.run(cfg, paths)

    gen = paths.artifacts
    (meta,) = [json.loads(p.value) for p in onnx.load(str(gen.optimizer_model)).metadata_props]
    block = dict(cfg.optimizer.block)
    assert meta["kind"] == block.pop("_target_").rsplit(".", 1)[1]  # the configured class built the graph ...
    assert {k: meta["hyperparameters"][k] for k in block} == block  # ... with conf/'s arguments baked in
    x, y = batch
    t = inputs.target_encoder(gen.training_model)(y)
    assert (t.ndim == 1) == (loss_option == "cross_entropy")  # class ids for cross-entropy, one-hot rows otherwise
    state = CheckpointState.load_checkpoint(gen.checkpoint)
    module = Module(gen.training_model, state, gen.eval_model)
    optimizer = Optimizer(gen.optimizer_model, module)
    ConstantLRScheduler(optimizer, cfg.optimizer.lr)
    before = {n: p.data.copy() for n, p in state.parameters.items()}
    losses = []
    for _ in range(3):
        out = module(x, t)
        losses.append(float(out[0] if isinstance(out, list) else out))
        optimizer.step()
        module.lazy_reset_grad()
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses  # descent on the batch it steps on
    assert not np.array_equal(before["head.weight"], state.parameters["head.weight"].data)
