"""PyTorch eager: the same layers as torch.nn modules with the same initial weights (a
zoo network: its ONNX graph run with torch.nn.functional; a torch configuration: its
torch.nn network with the exported weights; see torch_graph.py),
mean cross-entropy, torch.optim.AdamW (onnxruntime's defaults: eps 1e-6, no weight
decay) or plain torch.optim.SGD, zero_grad() as the gradient reset; harness.threads() threads. Its
inference model is exported as the torch configurations are (the TorchScript exporter,
eval mode, a dynamic batch axis)."""
import time

T0 = time.perf_counter()

import harness


def import_runtime() -> dict:
    global np, torch, F
    import numpy as np
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(harness.threads())
    torch.set_num_interop_threads(1)
    return {"torch": torch.__version__, "numpy": np.__version__}


def build(config: dict, weights) -> "torch.nn.Module":
    layers = []
    for layer in config["layers"]:
        op = layer["op"]
        if op == "linear":
            m = torch.nn.Linear(layer["in"], layer["out"])
        elif op == "conv":
            m = torch.nn.Conv2d(layer["in"], layer["out"], layer["k"], padding=layer["pad"])
        elif op == "relu":
            m = torch.nn.ReLU()
        elif op == "maxpool":
            m = torch.nn.MaxPool2d(layer["k"])
        elif op == "flatten":
            m = torch.nn.Flatten()
        else:
            raise ValueError(f"unknown layer op {op!r}")
        if "name" in layer:
            with torch.no_grad():
                for p in ("weight", "bias"):
                    getattr(m, p).copy_(torch.from_numpy(weights[f"{layer['name']}.{p}"]))
                    getattr(m, p).requires_grad_(f"{layer['name']}.{p}" not in config["frozen"])
        layers.append(m)
    return torch.nn.Sequential(*layers)


class Session:
    def __init__(self, job: dict):
        config = job["config"]
        with np.load(job["weights"]) as w:
            weights = {k: w[k] for k in w.files}
        if config.get("torch"):  # defined in torch.nn; the other peers train its export
            from torch_graph import torch_network

            self.model = torch_network(config["torch"], weights)
        elif config["zoo"]:  # the zoo network's own ONNX graph, node by node
            import json

            from torch_graph import GraphModule

            with open(job["graph"]) as f:
                self.model = GraphModule(json.load(f), weights, set(job["trainable"]))
        else:
            self.model = build(config, weights)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if config["optimizer"] == "AdamW":
            self.optimizer = torch.optim.AdamW(params, lr=config["lr"], betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0)
        elif config["optimizer"] == "SGD":
            self.optimizer = torch.optim.SGD(params, lr=config["lr"])
        else:
            raise ValueError(f"unknown optimizer {config['optimizer']!r}")

    def convert(self, x, y):
        return torch.from_numpy(x), torch.from_numpy(y)

    def train_step(self, x, y):
        if not self.model.training:
            self.model.train()
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def export(self, path: str, x) -> None:
        self.model.eval()
        torch.onnx.export(self.model, (x,), path, dynamo=False, input_names=["input"], output_names=["output"],
                          dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}})
        self.model.train()

    def eval_step(self, x, y):
        if self.model.training:
            self.model.eval()
        with torch.no_grad():
            return F.cross_entropy(self.model(x), y)

    @staticmethod
    def loss(out) -> float:
        return float(out.detach())


if __name__ == "__main__":
    raise SystemExit(harness.main(T0, import_runtime, Session))
