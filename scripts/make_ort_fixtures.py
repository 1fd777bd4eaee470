"""Write tests/fixtures/ort/: ONNX Runtime training artifact directories and what ONNX Runtime did next.

Run with onnxruntime-training 1.19.2 (the last release), e.g.
``.venv-bench-ort/bin/python scripts/make_ort_fixtures.py``. CI has no ONNX Runtime
training build, so the tests replay these committed files: for each model this
generates ONNX Runtime's artifacts, trains a few steps with its Module and Optimizer,
saves the checkpoint with the optimizer state, then, as a resumed run does, loads that
checkpoint into a fresh Module and Optimizer and trains 3 more steps, recording the
batches, the losses, the eval loss and the final parameters in ``expected.npz`` (no
pickles) and the scalars in ``expected.json``.

Directories written:
  mlp/           8-16-4 MLP, CrossEntropyLoss, AdamW (weight decay, clipping); a property bag;
                 its nominal checkpoint as ``nominal_checkpoint``
  cnn/           Conv + BatchNormalization + Gemm, MSELoss, SGD, the logits as an additional output
  losses/KIND/   a small MLP with each of ONNX Runtime's losses (eval and optimizer models and the
                 checkpoint only): one training step's loss, the parameters after it (learning rate 0.5) and the eval loss
  mlp_external/  the MLP's trained checkpoint rewritten with its tensors in ``checkpoint.data``
                 (the layout ONNX Runtime 1.19 uses for large checkpoints; built with the
                 flatbuffers bindings ONNX Runtime ships, and checked by loading it in
                 ONNX Runtime and training from it)
Models are built with onnx.helper (no torch in the ONNX Runtime environment).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import types
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "ort"
OPSET = 17
RESUMED_STEPS = 3


def _import_ort_training():
    """onnxruntime.training's __init__ imports torch (for ORTModule) even though the
    on-device API does not use it; load the subpackages without running it."""
    if importlib.util.find_spec("torch") is None:
        package = types.ModuleType("onnxruntime.training")
        package.__path__ = [os.path.join(os.path.dirname(onnxruntime.__file__), "training")]
        sys.modules["onnxruntime.training"] = package
    from onnxruntime.training import api, artifacts, onnxblock

    return api, artifacts, onnxblock


api, artifacts, onnxblock = _import_ort_training()
onnxruntime.set_default_logger_severity(3)


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "model", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=8)


def mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 8)) * 0.4).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "fc1.bias"),
             numpy_helper.from_array((rng.standard_normal((4, 16)) * 0.3).astype(np.float32), "fc2.weight"),
             numpy_helper.from_array((rng.standard_normal(4) * 0.1).astype(np.float32), "fc2.bias")]
    nodes = [helper.make_node("Gemm", ["input", "fc1.weight", "fc1.bias"], ["h"], transB=1, name="fc1"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["output"], transB=1, name="fc2")]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 8])],
                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 4])], inits)


def cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array((rng.standard_normal((2, 1, 3, 3)) * 0.5).astype(np.float32), "conv.weight"),
             numpy_helper.from_array(np.zeros(2, np.float32), "conv.bias"),
             numpy_helper.from_array(np.array([1.0, 0.8], np.float32), "bn.weight"),
             numpy_helper.from_array(np.array([0.0, 0.1], np.float32), "bn.bias"),
             numpy_helper.from_array(np.array([0.1, -0.1], np.float32), "bn.running_mean"),
             numpy_helper.from_array(np.array([1.2, 0.9], np.float32), "bn.running_var"),
             numpy_helper.from_array((rng.standard_normal((3, 72)) * 0.15).astype(np.float32), "fc.weight"),
             numpy_helper.from_array(np.zeros(3, np.float32), "fc.bias")]
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"],
                              ["b"], name="bn"),
             helper.make_node("Relu", ["b"], ["r"], name="relu"),
             helper.make_node("Flatten", ["r"], ["f"], axis=1, name="flatten"),
             helper.make_node("Gemm", ["f", "fc.weight", "fc.bias"], ["output"], transB=1, name="fc")]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 1, 6, 6])],
                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])], inits)


def mlp_batch(rng):
    x = rng.standard_normal((6, 8)).astype(np.float32)
    return x, rng.integers(0, 4, 6).astype(np.int64)


def cnn_batch(rng):
    x = rng.standard_normal((4, 1, 6, 6)).astype(np.float32)
    return x, rng.standard_normal((4, 3)).astype(np.float32)


def _session(directory: Path, checkpoint: Path):
    state = api.CheckpointState.load_checkpoint(str(checkpoint))
    module = api.Module(str(directory / "training_model.onnx"), state, str(directory / "eval_model.onnx"))
    return state, module, api.Optimizer(str(directory / "optimizer_model.onnx"), module)


def _loss(result) -> float:
    """The loss of a Module call (the first output when there are additional outputs)."""
    return float(result[0] if isinstance(result, (list, tuple)) else result)


def _train(module, optimizer, batches) -> list[float]:
    module.train()
    losses = []
    for x, y in batches:
        losses.append(_loss(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    return losses


def _parameters(state) -> dict[str, np.ndarray]:
    return {name: np.array(p.data) for name, p in state.parameters}


def record(name: str, directory: Path, checkpoint: Path, batch, seed: int, extra: dict) -> None:
    """Resume from ``checkpoint`` as a fresh process would and record what ONNX Runtime does."""
    rng = np.random.default_rng(seed)
    batches = [batch(rng) for _ in range(RESUMED_STEPS)]
    eval_batch = batch(rng)
    state, module, optimizer = _session(directory, checkpoint)
    saved = _parameters(state)
    lr = optimizer.get_learning_rate()
    losses = _train(module, optimizer, batches)
    module.eval()
    eval_loss = _loss(module(*eval_batch))
    arrays = {}
    for i, (x, y) in enumerate(batches):
        arrays[f"batch{i}.x"], arrays[f"batch{i}.y"] = x, y
    arrays["eval.x"], arrays["eval.y"] = eval_batch
    arrays.update({f"saved/{n}": a for n, a in saved.items()})
    arrays.update({f"final/{n}": a for n, a in _parameters(state).items()})
    np.savez(directory / "expected.npz", allow_pickle=False, **arrays)
    info = {"onnxruntime": onnxruntime.__version__, "resumed_learning_rate": lr, "losses": losses,
            "eval_loss": eval_loss, "steps": RESUMED_STEPS, "properties": dict(state.properties), **extra}
    (directory / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
    print(f"{name}: losses {losses}, eval {eval_loss:.6f}, lr {lr}")


def build(name: str, model, requires_grad, frozen, loss, optimizer, batch, seed: int, *, warmup_steps: int,
          properties: dict | None = None, nominal: bool = False, extra: dict | None = None,
          additional_outputs: list[str] | None = None) -> Path:
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    artifacts.generate_artifacts(model, requires_grad=requires_grad, frozen_params=frozen, loss=loss, optimizer=optimizer,
                                 artifact_directory=str(directory), nominal_checkpoint=nominal,
                                 additional_output_names=additional_outputs)
    rng = np.random.default_rng(seed + 100)
    state, module, opt = _session(directory, directory / "checkpoint")
    opt.set_learning_rate(0.05)  # a resumed ONNX Runtime run restarts at the initial rate: the fixture shows it
    _train(module, opt, [batch(rng) for _ in range(warmup_steps)])
    for key, value in (properties or {}).items():
        state.properties[key] = value
    api.CheckpointState.save_checkpoint(state, str(directory / "checkpoint"), include_optimizer_state=True)
    record(name, directory, directory / "checkpoint", batch, seed, {"warmup_steps": warmup_steps, **(extra or {})})
    return directory


def external_copy(source: Path, name: str, seed: int, batch, extra: dict) -> None:
    """``source``'s checkpoint with every tensor's bytes moved to ``checkpoint.data``."""
    import flatbuffers
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py import fbs
    from onnxruntime.tools.ort_format_model.ort_flatbuffers_py.fbs import Checkpoint as fbs_checkpoint

    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        shutil.copy(source / f, directory / f)
    old = fbs_checkpoint.Checkpoint.GetRootAs(bytearray((source / "checkpoint").read_bytes()), 0)
    b = flatbuffers.Builder(1024)
    data = bytearray()

    def tensor(t) -> int:
        raw = t.RawDataAsNumpy().tobytes()
        data.extend(b"\0" * (-len(data) % 64))  # aligned, as a real writer would
        offset = len(data)
        data.extend(raw)
        name_ = b.CreateString(t.Name())
        fbs.Tensor.TensorStartDimsVector(b, t.DimsLength())
        for d in reversed(t.DimsAsNumpy().tolist()):
            b.PrependInt64(d)
        dims = b.EndVector()
        fbs.Tensor.TensorStart(b)
        fbs.Tensor.TensorAddName(b, name_)
        fbs.Tensor.TensorAddDims(b, dims)
        fbs.Tensor.TensorAddDataType(b, t.DataType())
        fbs.Tensor.TensorAddExternalDataOffset(b, offset)
        return fbs.Tensor.TensorEnd(b)

    def vector(items: list[int]) -> int:
        b.StartVector(4, len(items), 4)
        for item in reversed(items):
            b.PrependUOffsetTRelative(item)
        return b.EndVector()

    ms = old.ModuleState()
    trainable = vector([tensor(ms.RequiresGradParams(i)) for i in range(ms.RequiresGradParamsLength())])
    frozen = vector([tensor(ms.FrozenParams(i)) for i in range(ms.FrozenParamsLength())])
    fbs.ModuleState.ModuleStateStart(b)
    fbs.ModuleState.ModuleStateAddRequiresGradParams(b, trainable)
    fbs.ModuleState.ModuleStateAddFrozenParams(b, frozen)
    fbs.ModuleState.ModuleStateAddHasExternalData(b, True)
    module_state = fbs.ModuleState.ModuleStateEnd(b)
    groups = []
    for g in range(old.OptimizerGroupsLength()):
        group = old.OptimizerGroups(g)
        states = []
        for s in range(group.OptimizerStatesLength()):
            ps = group.OptimizerStates(s)
            moments = vector([tensor(ps.Momentums(m)) for m in range(ps.MomentumsLength())])
            pname = b.CreateString(ps.ParamName())
            fbs.ParameterOptimizerState.ParameterOptimizerStateStart(b)
            fbs.ParameterOptimizerState.ParameterOptimizerStateAddParamName(b, pname)
            fbs.ParameterOptimizerState.ParameterOptimizerStateAddMomentums(b, moments)
            states.append(fbs.ParameterOptimizerState.ParameterOptimizerStateEnd(b))
        states_vec = vector(states)
        gname = b.CreateString(group.GroupName())
        fbs.OptimizerGroup.OptimizerGroupStart(b)
        fbs.OptimizerGroup.OptimizerGroupAddGroupName(b, gname)
        fbs.OptimizerGroup.OptimizerGroupAddStep(b, group.Step())
        fbs.OptimizerGroup.OptimizerGroupAddInitialLearningRate(b, group.InitialLearningRate())
        fbs.OptimizerGroup.OptimizerGroupAddOptimizerStates(b, states_vec)
        groups.append(fbs.OptimizerGroup.OptimizerGroupEnd(b))
    groups_vec = vector(groups)
    fbs_checkpoint.CheckpointStart(b)
    fbs_checkpoint.CheckpointAddVersion(b, old.Version())
    fbs_checkpoint.CheckpointAddModuleState(b, module_state)
    fbs_checkpoint.CheckpointAddOptimizerGroups(b, groups_vec)
    b.Finish(fbs_checkpoint.CheckpointEnd(b), file_identifier=b"ODTC")
    (directory / "checkpoint").write_bytes(bytes(b.Output()))
    (directory / "checkpoint.data").write_bytes(bytes(data))
    record(name, directory, directory / "checkpoint", batch, seed, extra)


def small_mlp() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((3, 5)) * 0.8).astype(np.float32), "fc.weight"),
             numpy_helper.from_array((rng.standard_normal(3) * 0.2).astype(np.float32), "fc.bias")]
    nodes = [helper.make_node("Gemm", ["input", "fc.weight", "fc.bias"], ["logits"], transB=1, name="fc"),
             helper.make_node("Tanh", ["logits"], ["output"], name="tanh")]
    return _model(nodes, [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 5])],
                  [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 3])], inits)


def loss_zoo() -> None:
    """Each of ONNX Runtime's loss blocks as it writes it into the eval model; what it computes."""
    rng = np.random.default_rng(30)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    targets = {"MSELoss": rng.standard_normal((4, 3)).astype(np.float32),
               "L1Loss": rng.standard_normal((4, 3)).astype(np.float32),
               "BCEWithLogitsLoss": (rng.random((4, 3)) > 0.5).astype(np.float32),
               "CrossEntropyLoss": rng.integers(0, 3, 4).astype(np.int64)}
    for kind, y in targets.items():
        directory = OUT / "losses" / kind
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        artifacts.generate_artifacts(small_mlp(), requires_grad=["fc.weight", "fc.bias"], loss=getattr(artifacts.LossType, kind),
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=str(directory))
        state, module, optimizer = _session(directory, directory / "checkpoint")
        optimizer.set_learning_rate(0.5)  # one visible step (the checkpoint is not saved again)
        module.eval()
        eval_loss = _loss(module(x, y))
        (train_loss,) = _train(module, optimizer, [(x, y)])
        (directory / "training_model.onnx").unlink()  # the import does not read it; the fixtures stay small
        stepped = {f"final/{n}": a for n, a in _parameters(state).items()}
        np.savez(directory / "expected.npz", allow_pickle=False, x=x, y=y, **stepped)
        info = {"onnxruntime": onnxruntime.__version__, "loss": kind, "eval_loss": eval_loss, "train_loss": train_loss}
        (directory / "expected.json").write_text(json.dumps(info, indent=1) + "\n")
        print(f"losses/{kind}: eval {eval_loss:.6f}, train {train_loss:.6f}")


def main() -> None:
    print(f"onnxruntime {onnxruntime.__version__}")
    OUT.mkdir(parents=True, exist_ok=True)
    adamw = onnxblock.optim.AdamW(betas=(0.85, 0.99), eps=1e-7, weight_decay=0.02, clip_grad=onnxblock.optim.ClipGradNorm(2.5))
    mlp_extra = {"loss": "CrossEntropyLoss", "optimizer": "AdamW", "trainable": ["fc1.weight", "fc1.bias", "fc2.weight"],
                 "frozen": ["fc2.bias"], "hyperparameters": {"betas": [0.85, 0.99], "eps": 1e-7, "weight_decay": 0.02,
                                                              "max_norm": 2.5}}
    mlp_dir = build("mlp", mlp(), ["fc1.weight", "fc1.bias", "fc2.weight"], ["fc2.bias"], artifacts.LossType.CrossEntropyLoss,
                    adamw, mlp_batch, seed=10, warmup_steps=4, nominal=True,
                    properties={"epoch": 2, "best_accuracy": 0.75, "run": "fixture"}, extra=mlp_extra)
    build("cnn", cnn(), ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "fc.weight", "fc.bias"],
          ["bn.running_mean", "bn.running_var"], artifacts.LossType.MSELoss, artifacts.OptimType.SGD, cnn_batch, seed=20,
          warmup_steps=3, extra={"loss": "MSELoss", "optimizer": "SGD", "additional_outputs": ["output"]},
          additional_outputs=["output"])
    loss_zoo()
    external_copy(mlp_dir, "mlp_external", seed=10, batch=mlp_batch, extra={**mlp_extra, "external_data": True})
    total = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    print(f"{OUT}: {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
