"""Small, seeded PyTorch versions of the architectures people train on devices, for
tests/odt_ops/test_architectures.py (and the benchmark's torch-defined configurations).

Every ``build()`` returns the same weights on every call (seeded; parameters that a
constructor fills with one value, norms' weights and zero biases, are perturbed so that
each parameter is distinct and an exporter cannot merge two equal initializers), and
every ``batch()`` the same data. Dropout is 0 everywhere: randomness never enters.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Architecture:
    name: str
    make: Callable[[], nn.Module]  # unseeded constructor; build() seeds it
    batch: Callable[[np.random.Generator], tuple[list[np.ndarray], np.ndarray]]  # (user inputs, labels)
    input_names: tuple[str, ...]
    loss: str = "ce"  # "ce": mean cross-entropy on logits; "mse": mean squared error
    # "13", "17": the TorchScript exporter at that opset, as ONNX Runtime's training docs export
    # (TrainingMode.TRAINING, do_constant_folding=False); "17-folded": with the exporter's default
    # constant folding (weights renamed, recurrent gates reordered, reshaped copies); "dynamo":
    # the dynamo exporter, batch axis dynamic; "dynamo-unoptimized": the same with optimize=False
    exporters: tuple[str, ...] = ("17",)
    slow: bool = False
    ops: frozenset[str] = frozenset()  # what its TorchScript export at opset 17 must contain: what the case is about
    sequence_lens: bool = False  # its recurrent node is given per-sample lengths

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        module = self.make()
        with torch.no_grad():
            for p in module.parameters():
                if p.numel() == 1 or bool((p == p.flatten()[0]).all()):
                    p.add_(torch.randn_like(p) * 0.1)
        return module.train()

    def data(self, seed: int = 1) -> tuple[list[np.ndarray], np.ndarray]:
        return self.batch(np.random.default_rng(seed))

    def torch_loss(self, output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, labels) if self.loss == "ce" else F.mse_loss(output, labels)


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _labels(rng, classes, *shape):
    return rng.integers(0, classes, shape).astype(np.int64)


# ---- recurrent ---------------------------------------------------------------------------------

class LSTMClassifier(nn.Module):
    """Two stacked bidirectional LSTM layers; the head reads the last step of both directions."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(24, 4)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y[:, -1])


class GRULengths(nn.Module):
    """Per-sample lengths: pack_padded_sequence (lengths sorted, enforce_sorted=True) and
    pad_packed_sequence around the GRU. The TorchScript exporter turns exactly that pair into
    the GRU node's sequence_lens (its peephole pass removes PackPadded/PadPacked together;
    pack_padded_sequence alone, or enforce_sorted=False, fails to export)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 10, bidirectional=True, batch_first=True)
        self.head = nn.Linear(20, 3)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=True)
        y, h = self.rnn(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(y, batch_first=True, total_length=x.shape[1])
        return self.head(torch.cat([h[0], h[1]], dim=1) + y.mean(1))


def _sequence_batch(rng):
    return [_normal(rng, 4, 6, 8)], _labels(rng, 4, 4)


def _lengths_batch(rng):
    return [_normal(rng, 4, 6, 8), np.array([6, 5, 3, 2], np.int64)], _labels(rng, 3, 4)


# ---- convolutional -----------------------------------------------------------------------------

class KeywordSpotter(nn.Module):
    """1-D CNN over 10 MFCC coefficients x 24 frames (a DS-CNN-like keyword spotter)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv1d(10, 16, 3, padding=1), nn.BatchNorm1d(16)
        self.dw, self.bn2 = nn.Conv1d(16, 16, 3, stride=2, padding=1, groups=16), nn.BatchNorm1d(16)
        self.pw, self.bn3 = nn.Conv1d(16, 24, 1), nn.BatchNorm1d(24)
        self.head = nn.Linear(24, 6)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.dw(x)))
        x = F.relu(self.bn3(self.pw(x)))
        return self.head(F.adaptive_avg_pool1d(x, 1).flatten(1))


class SqueezeExcite(nn.Module):
    """Global average, reduce 1x1, activation, expand 1x1, gate, rescale the channels."""

    def __init__(self, channels, squeezed, act, gate):
        super().__init__()
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
        self.act, self.gate = act, gate

    def forward(self, x):
        return x * self.gate(self.expand(self.act(self.reduce(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """Expand 1x1, depthwise 3x3, squeeze-excitation, project 1x1, residual; BatchNorm after each conv."""

    def __init__(self, channels, expanded, act, se_act, gate, stride=1):
        super().__init__()
        self.expand, self.bn1 = nn.Conv2d(channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded)
        self.dw = nn.Conv2d(expanded, expanded, 3, stride=stride, padding=1, groups=expanded, bias=False)
        self.bn2 = nn.BatchNorm2d(expanded)
        self.se = SqueezeExcite(expanded, max(4, expanded // 4), se_act, gate)
        self.project, self.bn3 = nn.Conv2d(expanded, channels, 1, bias=False), nn.BatchNorm2d(channels)
        self.act, self.residual = act, stride == 1

    def forward(self, x):
        y = self.act(self.bn1(self.expand(x)))
        y = self.se(self.act(self.bn2(self.dw(y))))
        y = self.bn3(self.project(y))
        return x + y if self.residual else y


class MobileNetV3ish(nn.Module):
    """Stem conv (stride 2) + HardSwish, two inverted residuals with HardSigmoid-gated SE, 1x1 + HardSwish, head."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(InvertedResidual(8, 16, nn.Hardswish(), nn.ReLU(), nn.Hardsigmoid()),
                                    InvertedResidual(8, 24, nn.Hardswish(), nn.ReLU(), nn.Hardsigmoid()))
        self.last = nn.Conv2d(8, 32, 1)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        x = self.blocks(F.hardswish(self.bn(self.stem(x))))
        return self.head(F.hardswish(self.last(F.adaptive_avg_pool2d(x, 1))).flatten(1))


class EfficientNetish(nn.Module):
    """Stem conv + SiLU, two MBConv blocks (SiLU, Sigmoid-gated SE), global pool, head."""

    def __init__(self):
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.blocks = nn.Sequential(InvertedResidual(8, 32, nn.SiLU(), nn.SiLU(), nn.Sigmoid()),
                                    InvertedResidual(8, 32, nn.SiLU(), nn.SiLU(), nn.Sigmoid()))
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        x = self.blocks(F.silu(self.bn(self.stem(x))))
        return self.head(x.mean((2, 3)))


def _image_batch(rng):
    return [_normal(rng, 4, 3, 16, 16)], _labels(rng, 5, 4)


# ---- attention ---------------------------------------------------------------------------------

class ViT(nn.Module):
    """4x4 patches of a 16x16 image, a class token, learned positions, two pre-norm GELU encoder layers."""

    def __init__(self, dim=16):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pos = nn.Parameter(torch.randn(1, 17, dim) * 0.1)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 32, dropout=0.0, activation="gelu", batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x[:, 0]))


class BertLike(nn.Module):
    """Token + position embeddings, LayerNorm, a post-norm encoder layer and an attention
    pooler (nn.MultiheadAttention with a learned query), both given the key padding mask."""

    def __init__(self, vocab=30, dim=16, length=7):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(1, length, dim) * 0.1)
        self.norm = nn.LayerNorm(dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 4, 32, dropout=0.0, batch_first=True)
        self.query = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.pool = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids, padding):
        x = self.norm(self.tokens(ids) + self.pos)
        x = self.encoder(x, src_key_padding_mask=padding)
        pooled, _ = self.pool(self.query.expand(x.shape[0], -1, -1), x, x, key_padding_mask=padding, need_weights=False)
        return self.head(pooled[:, 0])


def _bert_batch(rng):
    ids = rng.integers(1, 30, (4, 7)).astype(np.int64)
    padding = np.zeros((4, 7), bool)
    for row, n in enumerate([7, 5, 3, 6]):  # True marks padding (torch's convention)
        padding[row, n:] = True
        ids[row, n:] = 0
    return [ids, padding], _labels(rng, 3, 4)


class GPTLike(nn.Module):
    """Decoder-only: token embedding tied to the output projection, learned positions, two
    pre-norm layers under a causal mask; next-token logits for every position, [B*T, vocab]."""

    def __init__(self, vocab=24, dim=16, length=8):
        super().__init__()
        self.vocab = vocab
        self.tokens = nn.Embedding(vocab, dim)
        nn.init.normal_(self.tokens.weight, std=0.1)  # small, as GPT-2's 0.02: tied logits stay moderate
        self.pos = nn.Parameter(torch.randn(1, length, dim) * 0.1)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(dim, 4, 32, dropout=0.0, activation="gelu", batch_first=True,
                                                               norm_first=True) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.register_buffer("causal", nn.Transformer.generate_square_subsequent_mask(length), persistent=False)

    def forward(self, ids):
        x = self.tokens(ids) + self.pos
        for layer in self.layers:
            x = layer(x, src_mask=self.causal, is_causal=True)
        return F.linear(self.norm(x), self.tokens.weight).reshape(-1, self.vocab)


def _gpt_batch(rng):
    ids = rng.integers(0, 24, (3, 9)).astype(np.int64)
    return [ids[:, :-1].copy()], ids[:, 1:].reshape(-1).copy()


# ---- recommender -------------------------------------------------------------------------------

class Recommender(nn.Module):
    """A user embedding and the mean of each user's item bag (nn.EmbeddingBag with offsets), then an MLP."""

    def __init__(self):
        super().__init__()
        self.users = nn.Embedding(10, 8)
        self.items = nn.EmbeddingBag(40, 8, mode="mean")
        self.mlp = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, user, items, offsets):
        return self.mlp(torch.cat([self.users(user), self.items(items, offsets)], dim=1))


def _recommender_batch(rng):
    user = rng.integers(0, 10, 4).astype(np.int64)
    items = rng.integers(0, 40, 11).astype(np.int64)
    return [user, items, np.array([0, 3, 5, 9], np.int64)], _labels(rng, 2, 4)


# ---- dense prediction, reconstruction, sequences -----------------------------------------------

def _conv_gn(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(2, c_out), nn.ReLU())


class UNet(nn.Module):
    """Two levels down (max pooling), up once by ConvTranspose and once by bilinear upsampling,
    skip connections concatenated, GroupNorm; per-pixel logits for 3 classes."""

    def __init__(self):
        super().__init__()
        self.enc1, self.enc2, self.mid = _conv_gn(1, 8), _conv_gn(8, 16), _conv_gn(16, 16)
        self.up1 = nn.ConvTranspose2d(16, 16, 2, stride=2)
        self.dec1 = _conv_gn(32, 8)
        self.up2 = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.dec2 = _conv_gn(16, 8)
        self.out = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        m = self.mid(F.max_pool2d(e2, 2))
        d1 = self.dec1(torch.cat([self.up1(m), e2], dim=1))
        return self.out(self.dec2(torch.cat([self.up2(d1), e1], dim=1)))


def _unet_batch(rng):
    return [_normal(rng, 2, 1, 16, 16)], _labels(rng, 3, 2, 16, 16)


class AutoEncoder(nn.Module):
    """Convolutional: two stride-2 convs down to 8x4x4, two ConvTranspose up, Sigmoid; MSE to the input."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, padding=1), nn.ReLU(),
                                     nn.Conv2d(4, 8, 3, stride=2, padding=1), nn.Tanh())
        self.decoder = nn.Sequential(nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1), nn.ReLU(),
                                     nn.ConvTranspose2d(4, 1, 3, stride=2, padding=1, output_padding=1), nn.Sigmoid())

    def forward(self, x):
        return self.decoder(self.encoder(x))


def _autoencoder_batch(rng):
    x = rng.uniform(0, 1, (4, 1, 16, 16)).astype(np.float32)
    return [x], x.copy()


class CausalBlock(nn.Module):
    def __init__(self, c_in, c_out, dilation):
        super().__init__()
        self.pad = 2 * dilation  # kernel 3: (k - 1) * dilation on the left only
        self.conv1 = nn.Conv1d(c_in, c_out, 3, dilation=dilation)
        self.conv2 = nn.Conv1d(c_out, c_out, 3, dilation=dilation)
        self.skip = nn.Conv1d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x):
        y = F.relu(self.conv1(F.pad(x, (self.pad, 0))))
        y = F.relu(self.conv2(F.pad(y, (self.pad, 0))))
        return F.relu(y + (x if self.skip is None else self.skip(x)))


class TCN(nn.Module):
    """Temporal convolutional network: residual blocks of dilated causal conv1d (dilations 1, 2, 4)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(CausalBlock(4, 12, 1), CausalBlock(12, 12, 2), CausalBlock(12, 12, 4))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.blocks(x)[:, :, -1])


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("lstm_bidirectional", LSTMClassifier, _sequence_batch, ("x",), exporters=("17", "13", "17-folded", "dynamo"),
                 ops=frozenset({"LSTM"})),
    Architecture("gru_lengths", GRULengths, _lengths_batch, ("x", "lengths"), exporters=("17", "13", "17-folded"),
                 ops=frozenset({"GRU"}), sequence_lens=True),
    Architecture("keyword_spotter", KeywordSpotter, lambda rng: ([_normal(rng, 4, 10, 24)], _labels(rng, 6, 4)), ("x",),
                 ops=frozenset({"Conv", "BatchNormalization"})),
    Architecture("mobilenetv3", MobileNetV3ish, _image_batch, ("x",), exporters=("17", "13", "dynamo-unoptimized"),
                 ops=frozenset({"HardSwish", "HardSigmoid", "BatchNormalization"})),
    Architecture("efficientnet", EfficientNetish, _image_batch, ("x",),
                 ops=frozenset({"Sigmoid", "Mul", "BatchNormalization"})),
    Architecture("vit", ViT, _image_batch, ("x",), exporters=("17", "dynamo"),
                 ops=frozenset({"LayerNormalization", "Softmax", "Erf", "Mod"})),
    Architecture("bert", BertLike, _bert_batch, ("ids", "padding"), exporters=("17", "dynamo"),
                 ops=frozenset({"Gather", "Where", "Softmax", "Mod"})),
    Architecture("gpt", GPTLike, _gpt_batch, ("ids",),
                 ops=frozenset({"Gather", "Trilu", "Softmax"})),
    Architecture("recommender", Recommender, _recommender_batch, ("user", "items", "offsets"),
                 ops=frozenset({"Loop"})),
    Architecture("unet", UNet, _unet_batch, ("x",), exporters=("17", "13", "17-folded"),
                 ops=frozenset({"ConvTranspose", "Resize", "InstanceNormalization", "MaxPool"})),
    Architecture("autoencoder", AutoEncoder, _autoencoder_batch, ("x",), loss="mse",
                 ops=frozenset({"ConvTranspose", "Sigmoid"})),
    Architecture("tcn", TCN, lambda rng: ([_normal(rng, 4, 4, 32)], _labels(rng, 3, 4)), ("x",),
                 ops=frozenset({"Pad", "Conv"})),
)}
