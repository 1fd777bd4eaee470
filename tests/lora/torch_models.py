"""Small torch models for the LoRA and quantization oracles, exported with torch's own names."""
from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch", reason="the LoRA oracles need torch (pip install -e '.[dev]')")
nn = torch.nn


class Block(nn.Module):
    """One pre-norm transformer encoder block with separate q, k, v, o projections (peft targets them by name)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.norm1(x)

        def split(z):
            return z.reshape(b, t, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        x = x + self.o((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.relu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, features: int = 6, d: int = 16, heads: int = 2, classes: int = 4):
        super().__init__()
        self.embed = nn.Linear(features, d)
        self.block = Block(d, heads)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.block(self.embed(x)).mean(dim=1))


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 12, 3, stride=2, padding=1)
        self.fc = nn.Linear(12 * 4 * 4, classes)

    def forward(self, x):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(h.flatten(1))


def export(module: nn.Module, example: np.ndarray, *, folded: bool = False) -> onnx.ModelProto:
    """The legacy exporter; without constant folding initializers keep torch's names, with it
    (``folded``) a Linear's weight is stored transposed, as onnxruntime.quantization quantizes it."""
    buffer = io.BytesIO()
    torch.onnx.export(module.eval(), (torch.from_numpy(example),), buffer, input_names=["x"], output_names=["logits"], opset_version=17,
                      dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}}, do_constant_folding=folded, dynamo=False)
    return onnx.load_from_string(buffer.getvalue())


def data(kind: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (n, 5, 6) if kind == "transformer" else (n, 1, 8, 8)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 4, n).astype(np.int64)


def make(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyTransformer() if kind == "transformer" else TinyCNN()
