"""The federate stage's simulated users: each client is one user with their own
handwriting, a slant drawn from ``slant_deg`` and a pen width from ``strokes``, and their
own label mix (Dirichlet, ``label_alpha``), made the way the personalization demo makes
its user (``datasets.render_style``) from the bundled digits that neither the cloud's
training set nor the global test holds. A user's samples are made when that client is
asked for them, from ``(seed, client id)``: nothing holds every client's data, so a
population of any size costs the memory of the users being played (``federated.population``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline import datasets, inputs
from pipeline.errors import DataError
from pipeline.paths import Artifacts, Paths


def client_pool(global_train: inputs.Split, global_test: inputs.Split) -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits that are in neither the cloud's training set nor the global test."""
    x, y = datasets.load_digits_demo()
    taken = {row.tobytes() for split in (global_train, global_test) for row in np.ascontiguousarray(split.x, np.float32)}
    keep = np.array([row.tobytes() not in taken for row in np.ascontiguousarray(x, np.float32)])
    if keep.sum() < 20:
        raise DataError(f"only {int(keep.sum())} digits are left for the federated users once the cloud's are set aside; "
                        "lower data.test_fraction or raise data.user_samples")
    return x[keep], y[keep]


@dataclass
class Population:
    """Simulated users, made on demand from (seed, client id); picklable, so Ray's workers
    make the data of the clients they play themselves."""

    pool_x: np.ndarray
    pool_y: np.ndarray
    seed: int
    train_per_client: int
    holdout_per_client: int
    label_alpha: float
    slant_deg: tuple[float, float]
    strokes: tuple[int, ...]
    jitter_deg: float
    num_classes: int = 10
    one_hot: str | None = None  # the label input's dtype when it takes one-hot rows (mse, l1, bce losses)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg, pool: tuple[np.ndarray, np.ndarray], one_hot: str | None = None) -> Population:
        p = cfg.federated.population
        return cls(pool[0], pool[1], int(cfg.seed), int(p.train_per_client), int(p.holdout_per_client), float(p.label_alpha),
                   (float(p.slant_deg[0]), float(p.slant_deg[1])), tuple(int(s) for s in p.strokes), float(p.jitter_deg),
                   int(cfg.data.num_classes), one_hot)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def style(self, cid: int) -> dict:
        rng = np.random.default_rng([self.seed, 1789, cid])
        return {"slant_deg": float(rng.uniform(*self.slant_deg)), "stroke": int(rng.choice(self.strokes)),
                "class_mix": rng.dirichlet(np.full(self.num_classes, self.label_alpha)).tolist()}

    def user(self, cid: int):
        """(x_train, y_train, x_holdout, y_holdout) of user ``cid`` (class ids)."""
        if cid in self._cache:
            return self._cache[cid]
        style = self.style(cid)
        rng = np.random.default_rng([self.seed, 1790, cid])
        n = self.train_per_client + self.holdout_per_client
        counts = rng.multinomial(n, style["class_mix"])
        picked = []
        for c in range(self.num_classes):
            avail = np.flatnonzero(self.pool_y == c)
            k = min(int(counts[c]), len(avail))
            picked.extend(rng.choice(avail, k, replace=False).tolist())
        idx = rng.permutation(np.array(picked, dtype=np.int64))
        x = datasets.render_style(self.pool_x[idx], slant_deg=style["slant_deg"], stroke=style["stroke"], jitter_deg=self.jitter_deg,
                                  shift=[0.0, 0.0], rng=rng)
        y = self.pool_y[idx]
        k = max(1, min(len(idx) - 1, round(len(idx) * self.train_per_client / n)))
        out = (x[:k], y[:k], x[k:], y[k:])
        if len(self._cache) >= 64:
            self._cache.pop(next(iter(self._cache)))
        self._cache[cid] = out
        return out

    def targets(self, y: np.ndarray) -> np.ndarray:
        if self.one_hot is None:
            return y.astype(np.int64)
        out = np.zeros((len(y), self.num_classes), dtype=np.dtype(self.one_hot))
        out[np.arange(len(y)), y] = 1
        return out

    def data(self, cid: int, context=None):
        """What the ClientApp asks: this user's samples (odt_ops.federated.task.ClientData)."""
        from odt_ops.federated.task import ClientData

        x, y, xh, yh = self.user(int(cid))
        return ClientData(x, self.targets(y), xh, self.targets(yh))


def one_hot_dtype(gen: Artifacts) -> str | None:
    """The label input's dtype when the artifacts' loss takes one-hot rows, else None (class ids)."""
    probe = inputs.target_encoder(gen.training_model)(np.array([0]))
    return None if probe.ndim == 1 else probe.dtype.str


def population(cfg, paths: Paths) -> Population:
    """The users of ``cfg.federated.population`` over the digits the prepare stage left for them."""
    pool = client_pool(inputs.load_split(paths, "global_train"), inputs.load_split(paths, "global_test"))
    return Population.from_config(cfg, pool, one_hot_dtype(paths.artifacts))
