"""The own test set: architectures from the library people fine-tune (Hugging Face transformers),
built from their configs with random weights (nothing downloads), tiny, for
tests/odt_ops/test_library_models.py.

timm is not among them: it requires torchvision, whose PyPI wheel pulls a CUDA build of torch
(checked with ``pip install --dry-run timm``: torch 2.14 plus the nvidia-* wheels), and the
project pins the CPU torch 2.13.0. Dropout and drop-path are 0 everywhere, so randomness never
enters; attention runs the "eager" implementation (the one the TorchScript exporter traces into
plain MatMul/Softmax).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

VOCAB, CLASSES = 50, 3
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


@dataclass(frozen=True)
class LibraryModel:
    name: str
    make: Callable[[], torch.nn.Module]  # unseeded; build() seeds it
    input_name: str
    input_shape: tuple[int, ...]  # without the batch
    slow: bool = False

    def build(self, seed: int = 0) -> torch.nn.Module:
        torch.manual_seed(seed)
        module = Logits(self.make())
        with torch.no_grad():  # norms' ones and zero biases made distinct, so each parameter is matchable by value
            for p in module.parameters():
                if p.numel() == 1 or bool((p == p.flatten()[0]).all()):
                    p.add_(torch.randn_like(p) * 0.1)
        return module.train()

    def batch(self, n: int, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(seed)
        if self.input_name == "input_ids":  # token 0 is the padding token: none in the batch
            x = rng.integers(2, VOCAB, (n, *self.input_shape)).astype(np.int64)
        else:
            x = rng.standard_normal((n, *self.input_shape)).astype(np.float32)
        return x, rng.integers(0, CLASSES, n).astype(np.int64)


class Logits(torch.nn.Module):
    """The model's classification logits as its one output (transformers return a ModelOutput)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def _text(config_cls, model_cls, **extra):
    import transformers

    def make():
        config = getattr(transformers, config_cls)(vocab_size=VOCAB, num_labels=CLASSES, attn_implementation="eager", **extra)
        return getattr(transformers, model_cls)(config)

    return make


def _vision(config_cls, model_cls, **extra):
    import transformers

    def make():
        config = getattr(transformers, config_cls)(num_channels=3, num_labels=CLASSES, **extra)
        return getattr(transformers, model_cls)(config)

    return make


_BERTISH = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, max_position_embeddings=16,
                **NO_DROPOUT)

MODELS = {m.name: m for m in [
    LibraryModel("bert", _text("BertConfig", "BertForSequenceClassification", **_BERTISH), "input_ids", (6,)),
    LibraryModel("roberta", _text("RobertaConfig", "RobertaForSequenceClassification", pad_token_id=1, **_BERTISH),
                 "input_ids", (6,)),
    LibraryModel("distilbert", _text("DistilBertConfig", "DistilBertForSequenceClassification", dim=16, n_layers=1, n_heads=2,
                                     hidden_dim=32, max_position_embeddings=16, dropout=0.0, attention_dropout=0.0,
                                     seq_classif_dropout=0.0), "input_ids", (6,)),
    LibraryModel("gpt2", _text("GPT2Config", "GPT2ForSequenceClassification", n_embd=16, n_layer=1, n_head=2, n_positions=16,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0), "input_ids", (6,)),
    LibraryModel("vit", _vision("ViTConfig", "ViTForImageClassification", image_size=8, patch_size=4, hidden_size=16,
                                num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, **NO_DROPOUT),
                 "pixel_values", (3, 8, 8)),
    LibraryModel("resnet", _vision("ResNetConfig", "ResNetForImageClassification", embedding_size=8, hidden_sizes=[8, 16],
                                   depths=[1, 1], layer_type="basic"), "pixel_values", (3, 16, 16)),
    LibraryModel("convnext", _vision("ConvNextConfig", "ConvNextForImageClassification", patch_size=2, hidden_sizes=[8, 16],
                                     depths=[1, 1], num_stages=2, image_size=8, drop_path_rate=0.0),
                 "pixel_values", (3, 8, 8)),
    LibraryModel("swin", _vision("SwinConfig", "SwinForImageClassification", image_size=8, patch_size=2, embed_dim=8,
                                 depths=[1, 1], num_heads=[2, 2], window_size=2, drop_path_rate=0.0, **NO_DROPOUT),
                 "pixel_values", (3, 8, 8), slow=True),
    LibraryModel("segformer", _vision("SegformerConfig", "SegformerForImageClassification", num_encoder_blocks=2, depths=[1, 1],
                                      sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[3, 3], strides=[2, 2],
                                      num_attention_heads=[1, 2], mlp_ratios=[2, 2], drop_path_rate=0.0,
                                      classifier_dropout_prob=0.0, **NO_DROPOUT), "pixel_values", (3, 8, 8)),
    LibraryModel("mobilevit", _vision("MobileViTConfig", "MobileViTForImageClassification", image_size=16, patch_size=2,
                                      hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 8, 8, 8, 16], num_attention_heads=2,
                                      classifier_dropout_prob=0.0, **NO_DROPOUT), "pixel_values", (3, 16, 16), slow=True),
]}
