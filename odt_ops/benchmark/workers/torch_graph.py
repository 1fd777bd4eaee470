"""A zoo configuration's ONNX graph run by PyTorch node by node with torch.nn.functional,
so PyTorch trains exactly the network odt and ONNX Runtime train (same weights, same
BatchNormalization statistics). Covers the ops of the onnx wheel's ResNet-50; any other
op fails with its name. The graph arrives as JSON (the driver writes it), so this
worker needs no onnx."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _pads(attrs: dict, spatial: int) -> tuple[int, ...] | None:
    """Symmetric ONNX pads as torch padding; None when asymmetric (pad explicitly)."""
    pads = attrs.get("pads", [0] * 2 * spatial)
    begin, end = pads[:spatial], pads[spatial:]
    return tuple(begin) if begin == end else None


class GraphModule(torch.nn.Module):
    def __init__(self, graph: dict, weights: dict, trainable: set[str]):
        super().__init__()
        self.graph = graph
        self.params = torch.nn.ParameterList()
        self.values: dict[str, torch.Tensor] = {}  # initializers: parameters, statistics, constants
        for name, array in weights.items():
            tensor = torch.from_numpy(array.copy())
            if name in trainable:
                tensor = torch.nn.Parameter(tensor)
                self.params.append(tensor)
            self.values[name] = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        env = dict(self.values)
        env[self.graph["input"]] = x
        for node in self.graph["nodes"]:
            outs = getattr(self, "op_" + node["op"], None)
            if outs is None:
                raise NotImplementedError(f"the torch graph runner has no {node['op']} (node {node['name']!r})")
            env[node["outputs"][0]] = outs([env[i] if i else None for i in node["inputs"]], node["attrs"])
        return env[self.graph["output"]]

    def op_Conv(self, ins, a):
        x, w, b = (ins + [None])[:3]
        pads = _pads(a, 2)
        if pads is None:
            p = a["pads"]
            x, pads = F.pad(x, (p[1], p[3], p[0], p[2])), 0
        return F.conv2d(x, w, b, stride=tuple(a.get("strides", (1, 1))), padding=pads,
                        dilation=tuple(a.get("dilations", (1, 1))), groups=a.get("group", 1))

    def op_BatchNormalization(self, ins, a):
        x, scale, bias, mean, var = ins
        # ONNX: running = momentum * running + (1 - momentum) * batch; torch's momentum is the other weight
        return F.batch_norm(x, mean, var, scale, bias, training=self.training, momentum=1 - a.get("momentum", 0.9),
                            eps=a.get("epsilon", 1e-5))

    def op_Relu(self, ins, a):
        return F.relu(ins[0])

    def op_Sum(self, ins, a):
        out = ins[0]
        for t in ins[1:]:
            out = out + t
        return out

    op_Add = op_Sum

    def op_MaxPool(self, ins, a):
        return F.max_pool2d(ins[0], tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"])), _pads(a, 2))

    def op_AveragePool(self, ins, a):
        return F.avg_pool2d(ins[0], tuple(a["kernel_shape"]), tuple(a.get("strides", a["kernel_shape"])), _pads(a, 2),
                            count_include_pad=bool(a.get("count_include_pad", 0)))

    def op_GlobalAveragePool(self, ins, a):
        return F.adaptive_avg_pool2d(ins[0], 1)

    def op_Reshape(self, ins, a):
        x, shape = ins
        return x.reshape([x.shape[i] if s == 0 else int(s) for i, s in enumerate(shape.tolist())])

    def op_Flatten(self, ins, a):
        x = ins[0]
        axis = a.get("axis", 1)
        return x.reshape(int(torch.tensor(x.shape[:axis]).prod()), -1)

    def op_Gemm(self, ins, a):
        x, w, b = (ins + [None])[:3]
        if a.get("transA") or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
            raise NotImplementedError("Gemm with transA, alpha or beta")
        return F.linear(x, w, b) if a.get("transB") else torch.addmm(b, x, w) if b is not None else x @ w
