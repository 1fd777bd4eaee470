"""PyTorch's side of the configurations that are not a layer list.

A zoo configuration's ONNX graph run by PyTorch node by node with torch.nn.functional,
so PyTorch trains exactly the network odt and ONNX Runtime train (same weights, same
BatchNormalization statistics). Covers the ops of the onnx wheel's ResNet-50; any other
op fails with its name. The graph arrives as JSON (the driver writes it), so this
worker needs no onnx.

A torch configuration's network, defined here in torch.nn (NETWORKS): the driver
exports it to the forward ONNX model (configs.torch_model) and the torch worker builds
it again with the exported initializers as its state_dict, so every peer starts from
the same weights. This module imports only torch: the driver imports it as
odt_ops.benchmark.workers.torch_graph, the worker by path."""
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


# ---- torch-defined networks (configs.Config.torch names one) -----------------------------------

class LSTMClassifier(torch.nn.Module):
    """A sequence of 20 frames of 16 features, one LSTM layer of 64, the last step's state into 10 classes."""

    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(16, 64, batch_first=True)
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


class SqueezeExcite(torch.nn.Module):
    def __init__(self, channels: int, squeezed: int):
        super().__init__()
        self.reduce = torch.nn.Conv2d(channels, squeezed, 1)
        self.expand = torch.nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(torch.nn.Module):
    """MobileNetV3's block: expand 1x1, depthwise 3x3, squeeze-excitation, project 1x1; BatchNorm, HardSwish."""

    def __init__(self, c_in: int, expanded: int, c_out: int, stride: int):
        super().__init__()
        self.expand = torch.nn.Conv2d(c_in, expanded, 1, bias=False)
        self.bn1 = torch.nn.BatchNorm2d(expanded)
        self.dw = torch.nn.Conv2d(expanded, expanded, 3, stride=stride, padding=1, groups=expanded, bias=False)
        self.bn2 = torch.nn.BatchNorm2d(expanded)
        self.se = SqueezeExcite(expanded, expanded // 4)
        self.project = torch.nn.Conv2d(expanded, c_out, 1, bias=False)
        self.bn3 = torch.nn.BatchNorm2d(c_out)
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        y = F.hardswish(self.bn1(self.expand(x)))
        y = self.se(F.hardswish(self.bn2(self.dw(y))))
        y = self.bn3(self.project(y))
        return x + y if self.residual else y


class MobileNetV3Small(torch.nn.Module):
    """A MobileNetV3-small-like network for 3x32x32 images: stem, four inverted residuals, 1x1, head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False)
        self.bn = torch.nn.BatchNorm2d(16)
        self.blocks = torch.nn.Sequential(InvertedResidual(16, 64, 24, 2), InvertedResidual(24, 72, 24, 1),
                                          InvertedResidual(24, 96, 40, 2), InvertedResidual(40, 120, 40, 1))
        self.last = torch.nn.Conv2d(40, 128, 1)
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        x = self.blocks(F.hardswish(self.bn(self.stem(x))))
        return self.head(F.hardswish(self.last(F.adaptive_avg_pool2d(x, 1))).flatten(1))


class TransformerClassifier(torch.nn.Module):
    """16 frames of 32 features projected to 64, learned positions, two nn.TransformerEncoderLayer
    (4 heads, feed-forward 128, no dropout), mean over time, 10 classes."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(32, 64)
        self.pos = torch.nn.Parameter(torch.randn(1, 16, 64) * 0.1)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
                                          for _ in range(2))
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = self.embed(x) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(1))


class MBConv(torch.nn.Module):
    """EfficientNet's block: expand 1x1, depthwise 3x3, Sigmoid-gated squeeze-excitation, project 1x1;
    BatchNorm and SiLU; a residual when the shape allows."""

    def __init__(self, c_in: int, expand: int, c_out: int, stride: int):
        super().__init__()
        mid = c_in * expand
        self.expand = torch.nn.Sequential(torch.nn.Conv2d(c_in, mid, 1, bias=False), torch.nn.BatchNorm2d(mid), torch.nn.SiLU())
        self.dw = torch.nn.Sequential(torch.nn.Conv2d(mid, mid, 3, stride=stride, padding=1, groups=mid, bias=False),
                                      torch.nn.BatchNorm2d(mid), torch.nn.SiLU())
        squeezed = max(1, c_in // 4)
        self.se = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Conv2d(mid, squeezed, 1), torch.nn.SiLU(),
                                      torch.nn.Conv2d(squeezed, mid, 1), torch.nn.Sigmoid())
        self.project = torch.nn.Sequential(torch.nn.Conv2d(mid, c_out, 1, bias=False), torch.nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x):
        y = self.dw(self.expand(x))
        y = self.project(y * self.se(y))
        return x + y if self.residual else y


class EfficientNetSmall(torch.nn.Module):
    """An EfficientNet-B0-like network for 3x32x32 images: stem, five MBConv blocks, 1x1, head."""

    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), torch.nn.BatchNorm2d(16),
                                        torch.nn.SiLU())
        self.blocks = torch.nn.Sequential(MBConv(16, 1, 16, 1), MBConv(16, 6, 24, 2), MBConv(24, 6, 24, 1),
                                          MBConv(24, 6, 40, 2), MBConv(40, 6, 40, 1))
        self.last = torch.nn.Sequential(torch.nn.Conv2d(40, 128, 1, bias=False), torch.nn.BatchNorm2d(128), torch.nn.SiLU())
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.last(self.blocks(self.stem(x))).mean((2, 3)))


def _conv_gn(c_in: int, c_out: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.GroupNorm(4, c_out), torch.nn.ReLU())


class UNetSmall(torch.nn.Module):
    """A small UNet on 1x32x32: two levels down by max pooling, up once by ConvTranspose and once by
    bilinear upsampling (Resize), skips concatenated, GroupNorm; the decoder's map averaged into 10 classes."""

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2, self.mid = _conv_gn(1, 16), _conv_gn(16, 32), _conv_gn(32, 32)
        self.up1 = torch.nn.ConvTranspose2d(32, 32, 2, stride=2)
        self.dec1 = _conv_gn(64, 16)
        self.up2 = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec2 = _conv_gn(32, 16)
        self.head = torch.nn.Linear(16, 10)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d1 = self.dec1(torch.cat([self.up1(m), e2], dim=1))
        d2 = self.dec2(torch.cat([self.up2(d1), e1], dim=1))
        return self.head(d2.mean((2, 3)))


NETWORKS = {"lstm": LSTMClassifier, "mobilenetv3": MobileNetV3Small, "transformer": TransformerClassifier,
            "efficientnet": EfficientNetSmall, "unet": UNetSmall}


def torch_network(name: str, weights: dict | None = None) -> torch.nn.Module:
    """NETWORKS[name] in training mode; ``weights`` (numpy arrays by state_dict name, e.g. the
    exported model's initializers) replace every floating-point tensor of its state_dict."""
    module = NETWORKS[name]()
    if weights is not None:
        state = module.state_dict()
        missing = [k for k, v in state.items() if v.is_floating_point() and k not in weights]
        if missing:
            raise KeyError(f"torch network {name!r}: the weights lack {missing}")
        module.load_state_dict({k: torch.from_numpy(weights[k].copy()) if v.is_floating_point() else v
                                for k, v in state.items()})
    return module.train()
