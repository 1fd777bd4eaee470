"""FedProx's proximal term on the client: mu/2 * ||w - w_global||^2.

Its gradient, ``mu * (w - w_global)``, is added to each trainable parameter's
accumulated gradient after the train step and before the optimizer step, so the
optimizer (with its clipping, weight decay and moments) sees exactly the gradient of
``loss + mu/2 * ||w - w_global||^2``: the same update as the term in the training
graph, at the cost of one fused pass over the parameters and no new artifact.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from odt_ops.errors import InputError


class ProximalTerm:
    """``mu/2 * ||w - anchor||^2`` over the trainable parameters of a CheckpointState
    bound to a Module (``state.parameters[name].data`` and ``.grad``)."""

    def __init__(self, state, anchor: Mapping[str, np.ndarray], mu: float):
        if not (np.isfinite(mu) and mu >= 0):
            raise InputError(f"proximal mu {mu!r}: expected a finite number >= 0")
        self.mu = float(mu)
        self._pairs = []
        for name, w_global in anchor.items():
            p = state.parameters[name]
            if p.grad is None:
                raise InputError(f"proximal term: {name!r} has no gradient buffer (not trainable, or the state is bound to no Module)")
            w_global = np.asarray(w_global)
            if w_global.shape != p.data.shape:
                raise InputError(f"proximal term: {name!r} is {list(p.data.shape)}, its global value {list(w_global.shape)}")
            # the parameter and gradient views share one layout (possibly column-major); the anchor is copied into it
            self._pairs.append((p.data, p.grad, np.array(w_global, dtype=p.data.dtype, order="K")))

    def add_gradient(self) -> None:
        """grad += mu * (w - w_global), in place, for every parameter."""
        if self.mu == 0.0:
            return
        mu = None
        for w, grad, anchor in self._pairs:
            if mu is None:
                mu = grad.dtype.type(self.mu)
            grad += mu * (w - anchor)

    def value(self) -> float:
        """mu/2 * ||w - w_global||^2 at the current parameters (float64)."""
        total = sum(float(np.sum((w.astype(np.float64) - anchor.astype(np.float64)) ** 2)) for w, _, anchor in self._pairs)
        return 0.5 * self.mu * total


__all__ = ["ProximalTerm"]
