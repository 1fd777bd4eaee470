"""ONNX Runtime training (onnxruntime-training-cpu 1.19.2, its last release): its own
generate_artifacts on the same forward model, then onnxruntime.training.api; harness.threads() threads.

The package's onnxruntime/training/__init__.py imports its optim subpackage, which
imports torch (~280 MiB resident). Neither the API nor generate_artifacts needs it, so
the worker registers a bare package object for onnxruntime.training and imports the
submodules directly: torch stays out of the process (the report says imports_torch).
"""
import time

T0 = time.perf_counter()

import harness


def import_runtime() -> dict:
    global np, ort, api
    import os
    import sys
    import types

    import numpy as np
    import onnxruntime as ort

    training_dir = os.path.join(os.path.dirname(ort.__file__), "training")
    if not os.path.isdir(os.path.join(training_dir, "api")):
        raise ImportError(f"onnxruntime {ort.__version__} at {ort.__file__} is the inference build; "
                          "ORT training needs onnxruntime-training-cpu==1.19.2 (python -m odt_ops.benchmark --setup-peers)")
    if "onnxruntime.training" not in sys.modules:  # skip the package __init__ that imports torch
        package = types.ModuleType("onnxruntime.training")
        package.__path__ = [training_dir]
        sys.modules["onnxruntime.training"] = package
    import onnxruntime.training.api as api

    ort.set_default_logger_severity(3)
    return {"onnxruntime-training": ort.__version__, "numpy": np.__version__}


def prepare(job: dict) -> None:
    import os

    import onnx
    from onnxruntime.training import artifacts

    os.makedirs(job["artifacts"], exist_ok=True)
    config = job["config"]
    optimizers = {"AdamW": artifacts.OptimType.AdamW, "SGD": artifacts.OptimType.SGD}
    artifacts.generate_artifacts(
        onnx.load(job["forward"]),
        requires_grad=job["trainable"],
        frozen_params=job["frozen"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=optimizers[config["optimizer"]],
        artifact_directory=job["artifacts"],
    )


class Session(harness.TrainingApiSession):
    def __init__(self, job: dict):
        art = job["artifacts"]
        options = ort.SessionOptions()
        options.intra_op_num_threads = harness.threads()
        options.inter_op_num_threads = 1
        state = api.CheckpointState.load_checkpoint(f"{art}/checkpoint")
        self.module = api.Module(f"{art}/training_model.onnx", state, f"{art}/eval_model.onnx", session_options=options)
        self.optimizer = api.Optimizer(f"{art}/optimizer_model.onnx", self.module)
        self.optimizer.set_learning_rate(job["config"]["lr"])


if __name__ == "__main__":
    raise SystemExit(harness.main(T0, import_runtime, Session, prepare))
