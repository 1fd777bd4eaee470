"""A federation's settings: the one schema of the federate stage's ``federated`` section
(conf/federated/, whose keys are these fields' names), the Flower App's run config
(``flwr run . --run-config``) and the apps built in code.

Free of Flower: the pipeline validates its configuration with it before Flower is
imported, and the engine stays importable without ``odt[federated]``.
"""
from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from odt_ops.errors import ArgumentError, FederationSettingsError
from odt_ops.federated.encoding import ENCODINGS

# Flower's strategies by name (odt_ops.federated.server_app maps each to its class)
STRATEGY_NAMES = ("fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "fedavgm", "fedmedian", "fedtrimmedavg", "krum",
                  "multikrum", "bulyan")
DP_MODES = ("server_fixed", "server_adaptive", "client_fixed")


@dataclass
class DPSettings:
    """Flower's central differential privacy: a wrapper around the strategy that clips each
    update's L2 norm (on the server, or on the client for ``client_fixed``) and adds
    Gaussian noise of ``noise_multiplier * clipping_norm / sampled clients`` to the average."""

    enabled: bool = False
    mode: str = "server_fixed"  # server_fixed | server_adaptive | client_fixed
    noise_multiplier: float = 0.1
    clipping_norm: float = 1.0  # the fixed norm, or the adaptive one's start
    target_clipped_quantile: float = 0.5  # server_adaptive only
    clip_norm_lr: float = 0.2  # server_adaptive only


@dataclass
class SecAggSettings:
    """Flower's SecAgg+ (``SecAggPlusWorkflow`` on the server, ``secaggplus_mod`` on each
    client): the server learns the sum of the sampled clients' updates, never one of them.
    Each client clips its update's values to ``[-clipping_range, clipping_range]`` and
    quantizes them to integers in ``[0, quantization_range)`` before masking."""

    enabled: bool = False
    num_shares: int = 3  # each client's secrets go to this many others (more: more dropouts survived, more traffic)
    reconstruction_threshold: int = 2  # shares needed to unmask a client (higher: more colluders resisted)
    clipping_range: float = 1.0  # largest |value| of an update that survives intact
    quantization_range: int = 4_194_304  # 2**22 levels over [-clipping_range, clipping_range]
    max_weight: float = 1000.0  # largest example count a client may weigh its update by


@dataclass
class FederationSettings:
    """A federation: the Flower strategy and its options, rounds, sampling, the clients'
    local training, the update's encoding, differential privacy, secure aggregation, seed."""

    strategy: str = "fedavg"
    strategy_options: dict[str, Any] = field(default_factory=dict)  # passed to the Flower strategy (eta, server_momentum, ...)
    rounds: int = 3
    clients: int = 2  # how many SuperNodes to expect (simulation: how many it starts)
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_clients: int = 1
    min_evaluate_clients: int = 1
    min_successful_clients: int = 1  # fewer surviving updates: the round keeps the global model
    local_epochs: int = 1
    batch_size: int = 16
    lr: float = 0.05  # the clients' learning rate (the artifacts' optimizer, fresh each round)
    mu: float = 0.0  # FedProx's proximal term mu/2 ||w - w_global||^2 (any strategy; fedprox sends it)
    encoding: str = "float32"
    dp: DPSettings = field(default_factory=DPSettings)
    secagg: SecAggSettings = field(default_factory=SecAggSettings)
    seed: int = 0
    round_timeout: float = 600.0
    connect_timeout: float = 120.0  # waiting for `clients` SuperNodes to connect

    def __post_init__(self):
        if isinstance(self.dp, Mapping):
            self.dp = DPSettings(**self.dp)
        if isinstance(self.secagg, Mapping):
            self.secagg = SecAggSettings(**self.secagg)
        problems = self.problems()
        if problems:
            raise FederationSettingsError(problems)

    def problems(self) -> list[tuple[str, Any, str]]:
        """Every (key, value, what is expected) that is wrong, keys as the run config names them."""
        out: list[tuple[str, Any, str]] = []

        def need(ok: bool, key: str, expected: str) -> None:
            if not ok:
                value: Any = self
                for part in key.split("."):
                    value = getattr(value, part)
                out.append((key, value, expected))

        need(self.strategy in STRATEGY_NAMES, "strategy", f"one of {', '.join(STRATEGY_NAMES)}")
        need(self.encoding in ENCODINGS, "encoding", f"one of {', '.join(ENCODINGS)}")
        need(self.dp.mode in DP_MODES, "dp.mode", f"one of {', '.join(DP_MODES)}")
        need(self.rounds >= 0, "rounds", "an integer >= 0")
        need(isinstance(self.seed, numbers.Integral) and not isinstance(self.seed, bool) and self.seed >= 0, "seed",
             "an integer >= 0 (each client's RoundConfig seed)")
        for key in ("clients", "local_epochs", "batch_size", "min_train_clients", "min_evaluate_clients", "min_successful_clients"):
            need(getattr(self, key) >= 1, key, "an integer >= 1")
        need(self.min_successful_clients <= self.clients, "min_successful_clients", f"at most clients ({self.clients})")
        for key in ("fraction_train", "fraction_evaluate"):
            need(0.0 <= getattr(self, key) <= 1.0, key, "a number in [0, 1]")
        need(self.lr > 0, "lr", "a number > 0")
        need(self.mu >= 0, "mu", "a number >= 0 (0: no proximal term)")
        need(self.dp.noise_multiplier >= 0, "dp.noise_multiplier", "a number >= 0")
        need(self.dp.clipping_norm > 0, "dp.clipping_norm", "a number > 0")
        s = self.secagg
        need(s.num_shares >= 2, "secagg.num_shares", "an integer >= 2")
        need(1 <= s.reconstruction_threshold <= s.num_shares, "secagg.reconstruction_threshold",
             f"an integer in [1, secagg.num_shares={s.num_shares}]")
        need(s.clipping_range > 0, "secagg.clipping_range", "a number > 0")
        need(s.quantization_range >= 2, "secagg.quantization_range", "an integer >= 2")
        need(not (s.enabled and self.dp.enabled and self.dp.mode != "client_fixed"), "secagg.enabled",
             "false when dp clips on the server (the server sees no single update to clip: use dp.mode=client_fixed)")
        need(not (s.enabled and self.encoding != "float32"), "secagg.enabled", "false with a lossy encoding (SecAgg+ quantizes itself)")
        return out

    def sample_size(self) -> int:
        """Clients sampled per training round (Flower's rule: max(fraction * N, minimum))."""
        return min(self.clients, max(int(self.clients * self.fraction_train), self.min_train_clients))

    def to_config(self) -> dict[str, Any]:
        """A flat dict (``dp.noise_multiplier`` ...), the form of a Flower run config."""
        nested = {"dp", "secagg", "strategy_options"}
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in nested}
        flat.update({f"dp.{k}": v for k, v in asdict(self.dp).items()})
        flat.update({f"secagg.{k}": v for k, v in asdict(self.secagg).items()})
        flat.update({f"strategy_options.{k}": v for k, v in self.strategy_options.items()})
        return flat

    @classmethod
    def from_config(cls, flat: Mapping[str, Any], base: FederationSettings | None = None) -> FederationSettings:
        """``base`` with the keys of a flat dict (as ``to_config`` writes, or a Flower run
        config) applied; keys that are not settings are ignored (the app's own, such as
        ``artifacts``)."""
        base = base or cls()
        known = set(base.to_config())
        unknown = sorted(k for k in flat if "." in k and not k.startswith("strategy_options.") and k not in known)
        if unknown:
            raise ArgumentError(f"federation settings: unknown key(s) {', '.join(unknown)}; the settings are {', '.join(sorted(known))}")
        top_names = {f.name for f in fields(cls)} - {"dp", "secagg", "strategy_options"}
        top = {k: v for k, v in flat.items() if k in top_names}
        nested = {p: {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith(p + ".")} for p in ("dp", "secagg", "strategy_options")}
        return replace(base, **top, dp=replace(base.dp, **nested["dp"]), secagg=replace(base.secagg, **nested["secagg"]),
                       strategy_options={**base.strategy_options, **nested["strategy_options"]})


__all__ = ["DP_MODES", "DPSettings", "FederationSettings", "SecAggSettings", "STRATEGY_NAMES"]
