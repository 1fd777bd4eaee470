"""What the device trains: the ``trainable`` section resolved to parameter names.

- ``select: all``: every float parameter (not BatchNormalization running statistics);
- ``select: last_n``: the parameters of the last ``last_n`` layers, a layer being a
  node that uses parameters (Gemm, Conv, BatchNormalization, ...), counted from the
  output back in graph order. ``last_n: 1`` is the classification head: the default
  personalization;
- ``select: globs``: parameters matching any of ``params`` (fnmatch globs on
  initializer names, e.g. ``"*.bias"``, ``"head.*"``);
- ``select: qat``: quantization-aware fine-tuning: generate quantizes the pretrained
  model to int8 QDQ (pipeline/quantize.py) and trains a float master copy of every
  quantized weight (plus any ``params`` globs still float); export writes the
  re-quantized QDQ model;
- ``select: lora``: LoRA adapters (``lora``: rank, alpha, dropout, targets: op types or
  globs, see odt_ops.lora.LoraConfig) beside the targeted weights; the adapters train,
  plus any ``params`` globs (peft's ``modules_to_save``), and every base weight is frozen.

``frozen`` globs then remove parameters whatever the selection said. Every parameter
not trained is frozen: it stays in the checkpoint (so the checkpoint is the whole
model) but gets no gradient.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import Enum
from typing import Optional

import odt_ops
from odt_ops import artifacts
from odt_ops.lora import LoraConfig
from pipeline.config import MISSING, Section
from pipeline.errors import ConfigError


class Select(Enum):
    last_n = "last_n"
    all = "all"
    globs = "globs"
    lora = "lora"
    qat = "qat"


@dataclass
class LoraSection(Section):
    """``trainable.lora``: the adapters' shape (conf/trainable/lora.yaml)."""

    rank: int = MISSING
    alpha: float = MISSING
    dropout: float = MISSING
    targets: list[str] = MISSING  # checked by TrainableConfig, so errors name trainable.lora.<key>

    def engine(self) -> LoraConfig:
        return LoraConfig(rank=self.rank, alpha=float(self.alpha), dropout=float(self.dropout), targets=list(self.targets))


@dataclass
class TrainableConfig(Section):
    """The ``trainable`` section (generate's)."""

    select: Select = MISSING
    last_n: int = MISSING
    params: list[str] = MISSING
    frozen: list[str] = MISSING
    lora: Optional[LoraSection] = None  # noqa: UP045 (OmegaConf reads Optional, not the | form)

    def check(self) -> None:
        self.need(self.last_n >= 1, "last_n", "an integer >= 1")
        self.need(self.select is not Select.lora or self.lora is not None, "lora",
                  "a mapping (rank, alpha, dropout, targets) when trainable.select=lora (see conf/trainable/lora.yaml)")
        if self.lora is not None:
            self.need(self.lora.rank >= 1, "lora.rank", "an integer >= 1")
            self.need(self.lora.alpha > 0, "lora.alpha", "a number > 0 (the adapters' scale is alpha / rank)")
            self.need(0 <= self.lora.dropout < 1, "lora.dropout", "a number in [0, 1)")
            self.need(len(self.lora.targets) > 0, "lora.targets", "at least one op type (MatMul, Gemm, Conv) or glob on weight or node names")
        self.need(self.select is not Select.globs or len(self.params) > 0, "params", "at least one glob when trainable.select=globs")


@dataclass(frozen=True)
class Selection:
    trainable: list[str]
    frozen: list[str]
    layers: list[tuple[str, list[str]]]  # (node name, its parameters), in graph order

    def trained_layers(self) -> list[str]:
        chosen = set(self.trainable)
        return [name for name, params in self.layers if chosen & set(params)]


def layers(model: odt_ops.Model, candidates: list[str]) -> list[tuple[str, list[str]]]:
    """Nodes that use parameters, in graph order, each with its parameters (first use)."""
    pool, seen, out = set(candidates), set(), []
    for node in model.graph.node:
        params = [i for i in node.input if i in pool and i not in seen]
        if params:
            seen.update(params)
            out.append((node.name or node.op_type, params))
    return out


def select(model: odt_ops.Model, cfg) -> Selection:
    """Resolve ``cfg`` (the ``trainable`` section) against the model's parameters."""
    candidates = artifacts.default_trainable(model)
    found = layers(model, candidates)
    if cfg.select in (Select.lora, Select.qat):  # adapters and master weights are named once generate has made them
        _no_unmatched(cfg.params, candidates, "trainable.params")
        _no_unmatched(cfg.frozen, candidates, "trainable.frozen")
        chosen = [c for c in candidates if any(fnmatch.fnmatchcase(c, g) for g in cfg.params)
                  and not any(fnmatch.fnmatchcase(c, g) for g in cfg.frozen)]
        return Selection(chosen, [c for c in candidates if c not in set(chosen)], found)
    if cfg.select is Select.all:
        chosen = list(candidates)
    elif cfg.select is Select.last_n:
        if cfg.last_n > len(found):
            raise ConfigError(
                f"trainable.last_n={cfg.last_n}: the model has {len(found)} layer(s) with parameters "
                f"({'; '.join(f'{n}: ' + ', '.join(ps) for n, ps in found)}); use a smaller last_n or trainable=all"
            )
        chosen = [p for _, params in found[-cfg.last_n:] for p in params]
    else:
        _no_unmatched(cfg.params, candidates, "trainable.params")
        chosen = [c for c in candidates if any(fnmatch.fnmatchcase(c, g) for g in cfg.params)]
    _no_unmatched(cfg.frozen, candidates, "trainable.frozen")
    chosen = [c for c in chosen if not any(fnmatch.fnmatchcase(c, g) for g in cfg.frozen)]
    if not chosen:
        raise ConfigError(
            f"trainable: select={cfg.select.value} with frozen={list(cfg.frozen)} leaves nothing to train; "
            f"the model's parameters are {_preview(candidates)}"
        )
    return Selection(chosen, [c for c in candidates if c not in set(chosen)], found)


def _no_unmatched(globs: list[str], candidates: list[str], key: str) -> None:
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(c, g) for c in candidates)]
    if unmatched:
        raise ConfigError(f"{key}: {unmatched} match no parameter of the model; its parameters are {_preview(candidates)}")


def _preview(names: list[str], n: int = 10) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")
