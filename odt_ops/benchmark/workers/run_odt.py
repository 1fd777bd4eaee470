"""odt: the engine's own Module and Optimizer on the artifacts odt_ops generated."""
import time

T0 = time.perf_counter()

import harness


def import_runtime() -> dict:
    global np, CheckpointState, Module, Optimizer
    import numpy as np

    import odt_ops
    from odt_ops.api import CheckpointState, Module, Optimizer

    return {"odt_ops": odt_ops.__version__, "numpy": np.__version__}


class Session(harness.TrainingApiSession):
    def __init__(self, job: dict):
        art = job["artifacts"]
        state = CheckpointState.load_checkpoint(f"{art}/checkpoint")
        self.module = Module(f"{art}/training_model.onnx", state, f"{art}/eval_model.onnx")
        self.optimizer = Optimizer(f"{art}/optimizer_model.onnx", self.module)
        self.optimizer.set_learning_rate(job["config"]["lr"])


if __name__ == "__main__":
    raise SystemExit(harness.main(T0, import_runtime, Session))
