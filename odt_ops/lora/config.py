"""LoraConfig: what to adapt and how (rank, alpha, dropout, targets)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from odt_ops.errors import LoraError

# the ops whose weight an adapter can sit beside; a target naming one of these selects them all
ADAPTABLE_OPS = ("MatMul", "Gemm", "Conv")


@dataclass(frozen=True)
class LoraConfig:
    """``y = x W + (alpha / rank) (dropout(x) A) B`` beside each targeted weight W.

    ``targets`` are op types (``"MatMul"``, ``"Gemm"``, ``"Conv"``: every such node with a
    weight initializer) or fnmatch globs on the weight's initializer name or the node's name
    (``"*attn*"``). A glob that matches nothing is an error that names it. ``seed`` draws A
    (Kaiming-uniform as in the LoRA paper and peft: U(-1/sqrt(fan_in), 1/sqrt(fan_in))); B
    starts at zero so the first forward equals the base model's."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: Sequence[str] = ("MatMul", "Gemm")
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise LoraError(f"LoraConfig(rank={self.rank!r}): the rank must be an integer >= 1")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or not self.alpha > 0:
            raise LoraError(f"LoraConfig(alpha={self.alpha!r}): alpha must be a number > 0 (the adapter's scale is alpha / rank)")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise LoraError(f"LoraConfig(dropout={self.dropout!r}): dropout must be a number in [0, 1)")
        if isinstance(self.targets, str):
            raise LoraError(f"LoraConfig(targets={self.targets!r}): give a list of op types or globs, e.g. [{self.targets!r}]")
        if not self.targets or not all(isinstance(t, str) and t for t in self.targets):
            raise LoraError(f"LoraConfig(targets={list(self.targets)!r}): give at least one op type ({', '.join(ADAPTABLE_OPS)}) or glob")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank
