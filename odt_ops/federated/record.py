"""One round of a federation as the server saw it: what the plain server app and the SecAgg+
workflow both report, per round, to the stage's progress lines and rounds.json (no Flower here)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RoundRecord:
    """What happened in one round, as the server saw it."""

    round: int
    sampled: int = 0
    participants: int = 0  # updates averaged in
    dropped: list[dict] = field(default_factory=list)  # {client, node, reason}
    kept_global: bool = False  # too few successful clients: the global model stayed
    bytes_down: int = 0  # ArrayRecord bytes sent (train and evaluate messages)
    bytes_up: int = 0  # ArrayRecord bytes received from clients
    payload_bytes_up: int = 0  # encoded values (and int8 scales) only
    train_metrics: dict[str, float] = field(default_factory=dict)
    client_eval: dict[str, float] = field(default_factory=dict)  # weighted over the clients' holdouts
    client_eval_count: int = 0
    server_eval: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    clients: list[int] = field(default_factory=list)  # the clients averaged in
