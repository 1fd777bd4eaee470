"""Optimizers, each in two forms kept side by side so they cannot drift apart:

- ``build(b, params)`` emits the optimizer graph in standard ONNX (the artifact any
  runtime can execute): inputs learning_rate (float scalar), step (int64 scalar, the
  1-based number of this update), then per parameter the value, its gradient and its
  state tensors; outputs the new values and states.
- ``update(params, grads, states, lr, step)`` is the same arithmetic as one in-place
  numpy pass per parameter, which the runtime runs instead of the graph. Tests hold
  the two equal.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from odt_ops import meta
from odt_ops.errors import ArgumentError, ArtifactError
from odt_ops.ir.builder import GraphBuilder
from odt_ops.ir.model import TARGET_IR_VERSION
from odt_ops.training_models import finish

F32 = np.float32


@dataclass(frozen=True)
class ParamSlots:
    """Value names of one parameter inside the optimizer graph."""

    name: str
    value: str
    grad: str
    states: tuple[str, ...]


def clip_coefficient_graph(b, grads: Sequence[str], max_norm: float) -> str:
    """coef = min(max_norm / (||g||_2 + 1e-6), 1) over all gradients, as torch's clip_grad_norm_."""
    squares = [b.op("ReduceSumSquare", [g], keepdims=0) for g in grads]
    total = squares[0] if len(squares) == 1 else b.op("Sum", squares)
    norm = b.op("Sqrt", [total])
    coef = b.op("Div", [b.constant(F32(max_norm)), b.op("Add", [norm, b.constant(F32(1e-6))])])
    return b.op("Min", [coef, b.constant(F32(1.0))])


def clip_coefficient(grads: Sequence[np.ndarray], max_norm: float) -> np.float32:
    total = F32(0)
    for g in grads:
        total = total + np.dot(g.ravel(), g.ravel())
    return np.minimum(F32(max_norm) / (np.sqrt(total) + F32(1e-6)), F32(1.0))


@dataclass(frozen=True)
class ClipGradNorm:
    """Scale every gradient by min(max_norm / (||all gradients||_2 + 1e-6), 1), as torch's
    clip_grad_norm_. Pass it as ``clip_grad=`` to an optimizer (ONNX Runtime's spelling, the
    same as ``max_norm=``), or call it in a block on gradient names to get the clipped ones."""

    max_norm: float

    def __call__(self, *grads: str) -> list[str]:
        from odt_ops.onnxblock.base import current_builder

        b = current_builder()
        coef = clip_coefficient_graph(b, list(grads), self.max_norm)
        return [b.op("Mul", [g, coef]) for g in grads]


@dataclass(frozen=True)
class Optimizer:
    """Shared surface: state names per parameter and gradient clipping.

    Calling an optimizer on a TrainingBlock's ``parameters()`` inside ``onnxblock.base`` or
    ``empty_base`` builds its graph into that model, as ONNX Runtime's optimizer blocks do."""

    max_norm: float | None = None
    clip_grad: ClipGradNorm | None = None  # ONNX Runtime's spelling of max_norm; folded into it

    state_names: tuple[str, ...] = field(default=(), init=False)  # set by each optimizer, never by callers
    kind = "Optimizer"

    def __post_init__(self):
        if self.clip_grad is not None:
            if self.max_norm is not None and self.max_norm != self.clip_grad.max_norm:
                raise ArgumentError(f"{type(self).__name__}: max_norm={self.max_norm} and clip_grad={self.clip_grad} disagree; give one")
            object.__setattr__(self, "max_norm", float(self.clip_grad.max_norm))
            object.__setattr__(self, "clip_grad", None)

    def hyperparameters(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("state_names", "clip_grad")}

    def __call__(self, parameters) -> list[str]:
        """Build this optimizer's graph into the open base model for the trainable parameters
        (``parameters`` is a TrainingBlock's ``(trainable, frozen)`` pair of TensorProto lists);
        returns the graph's output names."""
        from onnx import numpy_helper

        from odt_ops.onnxblock.base import current

        trainable = parameters[0] if isinstance(parameters, tuple) else parameters
        built = build_optimizer_model(self, {t.name: numpy_helper.to_array(t) for t in trainable})
        model = current()[0]
        model.graph.CopyFrom(built.graph)
        del model.opset_import[:]
        model.opset_import.extend(built.opset_import)
        del model.metadata_props[:]
        model.metadata_props.extend(built.metadata_props)
        return [o.name for o in built.graph.output]

    def build(self, b, params: Sequence[ParamSlots], lr: str, step: str) -> list[tuple[str, ...]]:
        """Emit the update; returns per parameter (new value, *new states)."""
        grads = [p.grad for p in params]
        if self.max_norm is not None:
            coef = clip_coefficient_graph(b, grads, self.max_norm)
            grads = [b.op("Mul", [g, coef]) for g in grads]
        scalars = self.build_scalars(b, lr, step)
        return [self.build_param(b, p, g, scalars) for p, g in zip(params, grads)]

    def update(self, params: Sequence[np.ndarray], grads: Sequence[np.ndarray], states: Sequence[Sequence[np.ndarray]], lr: float, step: int) -> None:
        """In place: params and states are overwritten, grads are left as they were."""
        if self.max_norm is not None:
            coef = clip_coefficient(grads, self.max_norm)
            grads = [g * coef for g in grads]
        scalars = self.scalars(F32(lr), step)
        for p, g, s in zip(params, grads, states):
            # one scratch array per parameter, reused by every pass: the update writes into it
            # with out= instead of allocating a temporary per operation
            self.update_param(p, g, s, scalars, np.empty_like(p))

    def build_scalars(self, b, lr: str, step: str) -> dict[str, str]:
        return {"lr": lr}

    def scalars(self, lr: np.float32, step: int) -> dict[str, np.float32]:
        return {"lr": lr}


@dataclass(frozen=True)
class SGD(Optimizer):
    """p -= lr * d, d = g + wd*p, with momentum buf = mu*buf + d and Nesterov d = d + mu*buf
    (torch.optim.SGD with dampening 0; plain SGD, ORT's default, keeps no state)."""

    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    kind = "SGD"

    def __post_init__(self):
        super().__post_init__()
        if self.nesterov and self.momentum <= 0:
            raise ArgumentError("SGD: nesterov needs momentum > 0")
        object.__setattr__(self, "state_names", ("momentum_buffer",) if self.momentum else ())

    def build_param(self, b, p: ParamSlots, g: str, s: dict) -> tuple[str, ...]:
        if self.weight_decay:
            g = b.op("Add", [g, b.op("Mul", [p.value, b.constant(F32(self.weight_decay))])])
        new_states = ()
        if self.momentum:
            buf = b.op("Add", [b.op("Mul", [p.states[0], b.constant(F32(self.momentum))]), g])
            new_states = (buf,)
            g = b.op("Add", [g, b.op("Mul", [buf, b.constant(F32(self.momentum))])]) if self.nesterov else buf
        return (b.op("Sub", [p.value, b.op("Mul", [g, s["lr"]])]), *new_states)

    def update_param(self, p: np.ndarray, g: np.ndarray, states, s: dict, tmp: np.ndarray) -> None:
        # the graph's operations in its order; a + b == b + a exactly, so the sums may
        # accumulate into the scratch
        if self.weight_decay:
            g = np.add(np.multiply(p, F32(self.weight_decay), out=tmp), g, out=tmp)
        if self.momentum:
            (buf,) = states
            buf *= F32(self.momentum)
            buf += g
            if self.nesterov:
                g = np.add(g, buf * F32(self.momentum), out=tmp)
            else:
                g = buf
        p -= np.multiply(g, s["lr"], out=tmp)


@dataclass(frozen=True)
class AdamW(Optimizer):
    """Adam with decoupled weight decay, in one of two exact flavours.

    mode "ort" (onnxruntime's AdamWOptimizer): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
    p -= lr * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + eps); then p -= lr * wd * p.
    mode "torch" (torch.optim.AdamW): p *= 1 - lr*wd; then
    p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
    """

    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    weight_decay: float = 0.0
    mode: str = "ort"
    state_names: tuple[str, ...] = field(default=("exp_avg", "exp_avg_sq"), init=False)
    kind = "AdamW"

    def __post_init__(self):
        super().__post_init__()
        if self.mode not in ("ort", "torch"):
            raise ArgumentError(f"AdamW mode must be 'ort' or 'torch', got {self.mode!r}")
        object.__setattr__(self, "betas", tuple(float(x) for x in self.betas))

    def build_scalars(self, b, lr: str, step: str) -> dict[str, str]:
        b1, b2 = self.betas
        t = b.op("Cast", [step], to=1)
        bc1 = b.op("Sub", [b.constant(F32(1)), b.op("Pow", [b.constant(F32(b1)), t])])
        bc2 = b.op("Sub", [b.constant(F32(1)), b.op("Pow", [b.constant(F32(b2)), t])])
        s = {"lr": lr}
        if self.mode == "ort":
            s["step_size"] = b.op("Div", [b.op("Mul", [lr, b.op("Sqrt", [bc2])]), bc1])
        else:
            s["step_size"] = b.op("Div", [lr, bc1])
            s["sqrt_bc2"] = b.op("Sqrt", [bc2])
        if self.weight_decay:
            s["decay"] = b.op("Sub", [b.constant(F32(1)), b.op("Mul", [lr, b.constant(F32(self.weight_decay))])])
        return s

    def scalars(self, lr: np.float32, step: int) -> dict[str, np.float32]:
        b1, b2 = F32(self.betas[0]), F32(self.betas[1])
        t = F32(step)
        bc1, bc2 = F32(1) - np.power(b1, t), F32(1) - np.power(b2, t)
        s = {"lr": lr}
        if self.mode == "ort":
            s["step_size"] = lr * np.sqrt(bc2) / bc1
        else:
            s["step_size"] = lr / bc1
            s["sqrt_bc2"] = np.sqrt(bc2)
        if self.weight_decay:
            s["decay"] = F32(1) - lr * F32(self.weight_decay)
        return s

    def build_param(self, b, p: ParamSlots, g: str, s: dict) -> tuple[str, ...]:
        b1, b2 = self.betas
        m = b.op("Add", [b.op("Mul", [p.states[0], b.constant(F32(b1))]), b.op("Mul", [g, b.constant(F32(1 - b1))])])
        v = b.op("Add", [b.op("Mul", [p.states[1], b.constant(F32(b2))]),
                         b.op("Mul", [b.op("Mul", [g, g]), b.constant(F32(1 - b2))])])
        sqrt_v = b.op("Sqrt", [v])
        if self.mode == "ort":
            denom = b.op("Add", [sqrt_v, b.constant(F32(self.eps))])
            value = b.op("Sub", [p.value, b.op("Mul", [b.op("Div", [m, denom]), s["step_size"]])])
            if self.weight_decay:
                value = b.op("Mul", [value, s["decay"]])
        else:
            value = b.op("Mul", [p.value, s["decay"]]) if self.weight_decay else p.value
            denom = b.op("Add", [b.op("Div", [sqrt_v, s["sqrt_bc2"]]), b.constant(F32(self.eps))])
            value = b.op("Sub", [value, b.op("Mul", [b.op("Div", [m, denom]), s["step_size"]])])
        return value, m, v

    def update_param(self, p: np.ndarray, g: np.ndarray, states, s: dict, tmp: np.ndarray) -> None:
        # the graph's operations in its order, each rounded as the graph rounds it; every
        # temporary lives in tmp
        b1, b2 = self.betas
        m, v = states
        m *= F32(b1)
        m += np.multiply(g, F32(1 - b1), out=tmp)
        v *= F32(b2)
        np.multiply(g, g, out=tmp)
        tmp *= F32(1 - b2)
        v += tmp
        if self.mode == "torch" and self.weight_decay:
            p *= s["decay"]
        np.sqrt(v, out=tmp)
        if self.mode == "torch":
            tmp /= s["sqrt_bc2"]
        tmp += F32(self.eps)
        np.divide(m, tmp, out=tmp)
        tmp *= s["step_size"]
        p -= tmp
        if self.mode == "ort" and self.weight_decay:
            p *= s["decay"]


@dataclass(frozen=True)
class Adam(AdamW):
    """torch.optim.Adam: L2 weight decay folded into the gradient (g += wd * p), no decoupled decay."""

    mode: str = "torch"
    kind = "Adam"

    def __post_init__(self):
        if self.mode != "torch":
            raise ArgumentError(f"Adam is torch.optim.Adam: mode is 'torch' only, got {self.mode!r} (AdamW has mode='ort')")
        super().__post_init__()

    def build_param(self, b, p: ParamSlots, g: str, s: dict) -> tuple[str, ...]:
        if self.weight_decay:
            g = b.op("Add", [g, b.op("Mul", [p.value, b.constant(F32(self.weight_decay))])])
        return AdamW(betas=self.betas, eps=self.eps, mode="torch").build_param(b, p, g, s)

    def build_scalars(self, b, lr: str, step: str) -> dict[str, str]:
        return AdamW(betas=self.betas, eps=self.eps, mode="torch").build_scalars(b, lr, step)

    def scalars(self, lr: np.float32, step: int) -> dict[str, np.float32]:
        return AdamW(betas=self.betas, eps=self.eps, mode="torch").scalars(lr, step)

    def update_param(self, p: np.ndarray, g: np.ndarray, states, s: dict, tmp: np.ndarray) -> None:
        if self.weight_decay:
            g = g + p * F32(self.weight_decay)  # a copy: tmp is the torch update's scratch
        AdamW(betas=self.betas, eps=self.eps, mode="torch").update_param(p, g, states, s, tmp)


def build_optimizer_model(opt: Optimizer, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The optimizer graph: (learning_rate, step, [param, grad, *states] per parameter) -> new values."""
    not_f32 = sorted(n for n, a in params.items() if a.dtype != np.float32)
    if not_f32:
        raise ArtifactError(f"the optimizer graphs are built for float32 parameters; {not_f32} are not float32 "
                            "(cast the model's weights to float32, or generate without an optimizer)")
    b = GraphBuilder(taken={"learning_rate", "step"}, prefix="optim")
    inputs = [helper.make_tensor_value_info("learning_rate", onnx.TensorProto.FLOAT, []),
              helper.make_tensor_value_info("step", onnx.TensorProto.INT64, [])]
    slots = []
    for name, array in params.items():
        elem = helper.np_dtype_to_tensor_dtype(array.dtype)
        value, grad = b.fresh(name), b.fresh(f"{name}/grad")
        states = tuple(b.fresh(f"{name}/{s}") for s in opt.state_names)
        for n in (value, grad, *states):
            inputs.append(helper.make_tensor_value_info(n, elem, list(array.shape)))
            b.types[n] = inputs[-1].type
        slots.append(ParamSlots(name, value, grad, states))
    results = opt.build(b, slots, "learning_rate", "step") if slots else []
    outputs = []
    for p, new in zip(slots, results):
        for src in new:
            # an output must be a fresh value, never an input passed through
            name = b.op("Identity", [src]) if src in {p.value, *p.states} else src
            outputs.append(helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(params[p.name].dtype), list(params[p.name].shape)))
    graph = helper.make_graph(b.nodes, "optimizer", inputs, outputs, b.initializers)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=TARGET_IR_VERSION)
    meta.write_optimizer(proto, opt, slots, [o.name for o in outputs])
    return finish(proto, "optimizer_model.onnx")
