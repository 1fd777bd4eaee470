"""One client's part of a federated round, in terms of the training API alone.

``LocalTrainer(artifacts_dir)`` loads the artifacts once (training, eval and optimizer
models, checkpoint) and then serves any number of rounds, for any number of clients
in turn, so a process that plays many clients holds one model:

    trainer = LocalTrainer("artifacts/")
    result = trainer.train_round(global_params, x, y, RoundConfig(epochs=2, learning_rate=0.05, proximal_mu=0.01))
    result.update            # the model difference, encoded as asked (or the trained arrays)
    result.num_examples, result.metrics
    trainer.evaluate(global_params, x_holdout, y_holdout).accuracy

Each round starts from the global parameters (given as arrays, or as a model
difference against a base both sides know, by default the artifacts' checkpoint),
with a fresh optimizer state (step 0, zero moments) and a generator seeded from
``(seed, client, round)`` for shuffling and Dropout, so a round's result depends on
its inputs only, not on which process ran it or what it ran before. FedProx's
proximal term is added to the gradient before each optimizer step (``proximal``).

Nothing here knows about a federated framework: ``odt_ops.federated.flower`` wraps it
for Flower.
"""
from __future__ import annotations

import numbers
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from odt_ops import meta
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import ArgumentError, ArgumentTypeError, InputError, ModelDiffError
from odt_ops.export import ModelDiff, apply_diff
from odt_ops.federated.encoding import ENCODINGS, EncodedDiff, check_encoding, clip_update, encode_diff, fingerprint
from odt_ops.federated.proximal import ProximalTerm
from odt_ops.ir.load import read_model
from odt_ops.scalars import as_real, finite_at_least_zero

UPDATE_KINDS = ("diff", "arrays")


@dataclass(frozen=True)
class RoundConfig:
    """How a client trains in one round."""

    epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 1e-3
    proximal_mu: float = 0.0
    seed: int = 0
    client_id: int = 0
    server_round: int = 0
    shuffle: bool = True
    max_steps: int | None = None
    update: str = "diff"  # diff: an (encoded) model difference; arrays: the trained parameters
    encoding: str = "float32"  # float32 | float16 | int8 (for update="diff")
    clip_norm: float | None = None  # client-side clipping of the update's L2 norm (DP with client-side clipping)

    def __post_init__(self):
        """Every field checked (an ArgumentTypeError or ArgumentError naming it), ints and floats
        normalized to Python's: a wrong value fails here, not inside numpy mid-round."""
        problems: list[str] = []
        wrong_type: list[str] = []

        def integer(name: str, low: int, *, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                wrong_type.append(f"{name}={v!r} is {type(v).__name__}, expected an int >= {low}" + (" or None" if optional else ""))
            elif v < low:
                problems.append(f"{name}={v} (expected an int >= {low}" + (" or None)" if optional else ")"))
            else:
                object.__setattr__(self, name, int(v))

        def real(name: str, *, positive: bool = False, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            want = "a finite number " + ("> 0" if positive else ">= 0") + (" or None" if optional else "")
            f = as_real(v)
            if f is None:
                wrong_type.append(f"{name}={v!r} is {type(v).__name__}, expected {want}")
            elif not finite_at_least_zero(f, positive=positive):
                problems.append(f"{name}={v!r} (expected {want})")
            else:
                object.__setattr__(self, name, f)

        integer("epochs", 1)
        integer("batch_size", 1)
        real("learning_rate")  # as odt_ops.api.optimizer.checked_learning_rate
        real("proximal_mu")
        integer("seed", 0)  # with client_id and server_round, the entropy of numpy's SeedSequence: non-negative ints
        integer("client_id", 0)
        integer("server_round", 0)
        if not isinstance(self.shuffle, bool):
            wrong_type.append(f"shuffle={self.shuffle!r} is {type(self.shuffle).__name__}, expected True or False")
        integer("max_steps", 0, optional=True)
        if not isinstance(self.update, str):
            wrong_type.append(f"update={self.update!r} is {type(self.update).__name__}, expected one of {UPDATE_KINDS}")
        elif self.update not in UPDATE_KINDS:
            problems.append(f"update={self.update!r} (expected one of {UPDATE_KINDS})")
        if not isinstance(self.encoding, str):
            wrong_type.append(f"encoding={self.encoding!r} is {type(self.encoding).__name__}, expected one of {ENCODINGS}")
        real("clip_norm", positive=True, optional=True)
        hint = _POSITIONAL_HINT if isinstance(self.seed, str) else ""  # RoundConfig(3, 16, 5e-3, 0.1, "int8")
        if wrong_type:
            raise ArgumentTypeError("RoundConfig: " + "; ".join(wrong_type + problems) + hint)
        if problems:
            raise ArgumentError("RoundConfig: " + "; ".join(problems))
        check_encoding(self.encoding)


# RoundConfig's positional order, said when seed is a string: the fifth field is seed, not encoding
_POSITIONAL_HINT = (" (RoundConfig's positional fields are epochs, batch_size, learning_rate, proximal_mu, seed; "
                    "pass the others, encoding among them, by keyword)")


@dataclass
class RoundResult:
    """What a client sends back: the update, how many examples it saw, and metrics."""

    update: EncodedDiff | dict[str, np.ndarray]
    num_examples: int
    num_steps: int
    metrics: dict[str, float]
    diff: ModelDiff  # the exact float32 difference (the client keeps it; ``update`` is what travels)
    parameters: dict[str, np.ndarray] = field(repr=False, default_factory=dict)  # the trained parameters


@dataclass
class EvalResult:
    loss: float
    accuracy: float  # NaN when the eval model gives no logits
    num_examples: int

    def as_dict(self) -> dict[str, float]:
        return {"loss": self.loss, "accuracy": self.accuracy, "num_examples": self.num_examples}


class LocalTrainer:
    """The artifacts of one model, loaded once, training rounds for one client at a time."""

    def __init__(self, artifacts_dir: str | os.PathLike, *, checkpoint: str | os.PathLike | None = None):
        d = Path(artifacts_dir)
        self.artifacts_dir = d
        self.state = CheckpointState.load_checkpoint(checkpoint or d / "checkpoint")
        self.module = Module(d / "training_model.onnx", self.state, d / "eval_model.onnx")
        self._optimizer_model = read_model(d / "optimizer_model.onnx").proto
        eval_info = meta.read(read_model(d / "eval_model.onnx").proto, str(d / "eval_model.onnx"))
        self.has_logits = bool(eval_info.extra_outputs)
        self.trainable = list(self.module.training_state.roles.trainable)
        self.base = self.parameters()  # the artifacts' trainable weights: the base every client has

    # ---- parameters --------------------------------------------------------------------------
    def parameters(self) -> dict[str, np.ndarray]:
        """A copy of the trainable parameters, C-ordered, by name."""
        return {n: np.ascontiguousarray(self.state.parameters[n].data).copy() for n in self.trainable}

    def specs(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {n: (tuple(self.state.parameters[n].data.shape), self.state.parameters[n].data.dtype) for n in self.trainable}

    def set_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Load the trainable parameters (every one, nothing else, finite values)."""
        missing = [n for n in self.trainable if n not in params]
        unknown = [n for n in params if n not in self.trainable]
        if missing or unknown:
            raise InputError(f"global parameters: missing {missing}, not trainable here {unknown}; the trainable parameters are {self.trainable}")
        for name in self.trainable:
            a = np.asarray(params[name])
            if not np.all(np.isfinite(a)):
                raise InputError(f"global parameter {name!r} holds NaN or infinite values")
            self.state.parameters[name].data = a

    def resolve_global(self, global_params: Mapping[str, np.ndarray] | ModelDiff | None, *,
                       base: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The global parameters as arrays: given as arrays, or as a model difference against
        ``base`` (default: the artifacts' checkpoint), refused if made from another base."""
        if global_params is None:
            return {n: a.copy() for n, a in self.base.items()}
        if isinstance(global_params, ModelDiff):
            from odt_ops.checkpoint import Checkpoint

            b = dict(base if base is not None else self.base)
            ck = Checkpoint(parameters=b, requires_grad={n: True for n in b})
            try:
                applied = apply_diff(ck, global_params)
            except ModelDiffError as exc:
                raise ModelDiffError(f"global model as a difference: {exc}") from None
            return {n: np.asarray(applied.parameters[n]) for n in self.trainable}
        return {n: np.asarray(a) for n, a in global_params.items()}

    # ---- one round -----------------------------------------------------------------------------
    def train_round(self, global_params, x: np.ndarray, y: np.ndarray, config: RoundConfig = RoundConfig(), *,
                    base: Mapping[str, np.ndarray] | None = None) -> RoundResult:
        """Train from the global parameters on (x, y) as ``config`` says; the update out."""
        t0 = time.perf_counter()
        anchor = self.resolve_global(global_params, base=base)
        self.set_parameters(anchor)
        anchor = self.parameters()  # as loaded (the dtype the model holds)
        base_hash = fingerprint(anchor, self.trainable)
        x, y = np.asarray(x), np.asarray(y)
        if len(x) != len(y):
            raise InputError(f"client data: {len(x)} samples but {len(y)} labels")
        n = len(x)
        self._reseed(config)
        rng = np.random.default_rng([config.seed, config.client_id, config.server_round])
        optimizer = self._fresh_optimizer()
        optimizer.set_learning_rate(config.learning_rate)
        prox = ProximalTerm(self.state, anchor, config.proximal_mu) if config.proximal_mu > 0 else None
        module = self.module
        module.train()
        module.lazy_reset_grad()
        losses: list[float] = []
        steps = 0
        limit = config.max_steps
        done = n == 0 or limit == 0
        for _ in range(config.epochs if not done else 0):
            order = rng.permutation(n) if config.shuffle else np.arange(n)
            for i in range(0, n, config.batch_size):
                idx = order[i : i + config.batch_size]
                out = module(x[idx], y[idx])
                losses.append(float(np.asarray(out[0] if isinstance(out, list) else out)))
                if prox is not None:
                    prox.add_gradient()
                optimizer.step()
                module.lazy_reset_grad()
                steps += 1
                if limit is not None and steps >= limit:
                    done = True
                    break
            if done:
                break
        trained = self.parameters()
        deltas = {k: trained[k] - anchor[k] for k in self.trainable}
        metrics: dict[str, float] = {"train_loss": float(np.mean(losses)) if losses else float("nan"),
                                     "train_loss_last": losses[-1] if losses else float("nan")}
        if prox is not None:
            metrics["proximal_term"] = prox.value()
        if config.clip_norm is not None:
            deltas, norm = clip_update(deltas, config.clip_norm)
            metrics["update_norm_before_clipping"] = norm
            trained = {k: anchor[k] + deltas[k] for k in self.trainable}
        diff = ModelDiff(deltas, base_hash, n, steps, {"client_id": int(config.client_id), "server_round": int(config.server_round)})
        if config.update == "arrays":
            update: EncodedDiff | dict[str, np.ndarray] = trained
            metrics["update_bytes"] = float(sum(a.nbytes for a in trained.values()))
        else:
            update = encode_diff(diff, config.encoding)
            metrics["update_bytes"] = float(update.nbytes)
        metrics["update_norm"] = float(np.sqrt(sum(float(np.sum(np.asarray(d, np.float64) ** 2)) for d in deltas.values())))
        metrics["seconds"] = time.perf_counter() - t0
        return RoundResult(update, n, steps, metrics, diff, trained)

    def evaluate(self, params, x: np.ndarray, y: np.ndarray, *, batch_size: int = 256,
                 base: Mapping[str, np.ndarray] | None = None) -> EvalResult:
        """Loss (mean over the samples) and accuracy of ``params`` (arrays, a difference, or
        None for the current parameters) on (x, y)."""
        if params is not None:
            self.set_parameters(self.resolve_global(params, base=base))
        x, y = np.asarray(x), np.asarray(y)
        n = len(x)
        if n == 0:
            return EvalResult(float("nan"), float("nan"), 0)
        self.module.eval()
        total, correct = 0.0, 0
        labels = y if y.ndim == 1 else y.argmax(axis=-1)
        for i in range(0, n, batch_size):
            out = self.module(x[i : i + batch_size], y[i : i + batch_size])
            if isinstance(out, list):
                loss, logits = out[0], out[1]
                correct += int(np.sum(np.asarray(logits).argmax(axis=-1) == labels[i : i + batch_size]))
            else:
                loss = out
            total += float(np.asarray(loss)) * len(x[i : i + batch_size])
        self.module.train()
        return EvalResult(total / n, correct / n if self.has_logits else float("nan"), n)

    # ---- internals -------------------------------------------------------------------------------
    def _fresh_optimizer(self) -> Optimizer:
        """An optimizer with step 0 and zero moments: every round starts its own."""
        self.state.checkpoint.optimizer = None
        return Optimizer(self._optimizer_model, self.module)

    def _reseed(self, config: RoundConfig) -> None:
        """The Module's generator (Dropout) seeded from (seed, client, round)."""
        seeded = np.random.default_rng([config.seed, config.client_id, config.server_round, 1])
        self.module.training_state.rng.bit_generator.state = seeded.bit_generator.state


__all__ = ["EvalResult", "LocalTrainer", "RoundConfig", "RoundResult"]
