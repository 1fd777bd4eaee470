"""Our artifacts on onnxruntime's ordinary inference build: training_model.onnx then
optimizer_model.onnx with onnxruntime.InferenceSession, parameters, buffers and
optimizer states fed back by name (the roles are read from the models' odt metadata, not from
odt_ops, which this worker does not import); harness.threads() threads."""
import time

T0 = time.perf_counter()

import harness


def import_runtime() -> dict:
    global np, ort
    import numpy as np
    import onnxruntime as ort

    ort.set_default_logger_severity(3)
    return {"onnxruntime": ort.__version__, "numpy": np.__version__}


def _session(path: str):
    import json

    options = ort.SessionOptions()
    options.intra_op_num_threads = harness.threads()
    options.inter_op_num_threads = 1
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    meta = {k: json.loads(v) for k, v in sess.get_modelmeta().custom_metadata_map.items() if k.startswith("odt.")}
    return sess, meta


class Session:
    def __init__(self, job: dict):
        art = job["artifacts"]
        self.train_sess, meta = _session(f"{art}/training_model.onnx")
        self.eval_sess, _ = _session(f"{art}/eval_model.onnx")
        self.opt_sess, opt_meta = _session(f"{art}/optimizer_model.onnx")
        info = meta["odt.artifact"]
        self.data_names = [*info["user_inputs"], *info["labels"]]
        with np.load(job["weights"]) as w:
            self.params = {n: w[n] for n in [*info["trainable"], *info["frozen"], *info["buffers"]]}
        self.grad_outputs = [info["gradients"][p] for p in info["trainable"]]
        self.buffers = list(info["buffer_updates"])  # BatchNormalization statistics, updated each step
        self.train_outputs = [info["loss"], *self.grad_outputs, *(info["buffer_updates"][b] for b in self.buffers)]
        self.slots = opt_meta["odt.optimizer"]["parameters"]  # per parameter: value, grad, states, outputs
        self.opt_outputs = [o for p in self.slots for o in p["outputs"]]  # new value, then new states
        self.states = {p["name"]: {s: np.zeros_like(self.params[p["name"]]) for s in p["states"]} for p in self.slots}
        self.lr = np.array(job["config"]["lr"], np.float32)
        self.step = 0

    def convert(self, x, y):
        return x, y

    def train_step(self, x, y):
        feeds = dict(zip(self.data_names, (x, y)))
        feeds.update(self.params)
        loss, *rest = self.train_sess.run(self.train_outputs, feeds)
        grads = rest[: len(self.grad_outputs)]
        self.params.update(zip(self.buffers, rest[len(self.grad_outputs):]))
        self.step += 1
        opt_feeds = {"learning_rate": self.lr, "step": np.array(self.step, np.int64)}
        for p, g in zip(self.slots, grads):
            name = p["name"]
            opt_feeds[p["value"]] = self.params[name]
            opt_feeds[p["grad"]] = g
            for s, feed in p["states"].items():
                opt_feeds[feed] = self.states[name][s]
        outs = iter(self.opt_sess.run(self.opt_outputs, opt_feeds))
        for p in self.slots:
            self.params[p["name"]] = next(outs)
            for s in p["states"]:  # in the order of p["outputs"][1:]
                self.states[p["name"]][s] = next(outs)
        return loss

    def eval_step(self, x, y):
        feeds = dict(zip(self.data_names, (x, y)))
        feeds.update(self.params)
        return self.eval_sess.run(self.train_outputs[:1], feeds)[0]

    @staticmethod
    def loss(out) -> float:
        return float(out)


if __name__ == "__main__":
    raise SystemExit(harness.main(T0, import_runtime, Session))
