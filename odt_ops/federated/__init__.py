"""Federated learning with the engine as each client's local trainer.

Framework-neutral (numpy and onnx only, like the rest of odt_ops):

- ``local``: ``LocalTrainer`` runs one client's round (global parameters in, as arrays or
  a model difference; update, example count and metrics out) and evaluation;
- ``proximal``: FedProx's proximal term as an exact gradient correction;
- ``encoding``: model differences on the wire (float32, float16, int8 with a per-tensor
  scale), and the checks a server runs on an update.

``odt_ops.federated.flower`` (the only module that imports Flower, ``pip install
odt[federated]``) builds Flower's ClientApp and ServerApp around these.
"""
from odt_ops.federated.encoding import (
    ENCODINGS,
    EncodedDiff,
    check_update,
    clip_update,
    decode_diff,
    encode_diff,
    encoding_error,
    fingerprint,
    load_encoded,
    save_encoded,
)
from odt_ops.federated.local import EvalResult, LocalTrainer, RoundConfig, RoundResult
from odt_ops.federated.proximal import ProximalTerm

__all__ = [
    "ENCODINGS",
    "EncodedDiff",
    "EvalResult",
    "LocalTrainer",
    "ProximalTerm",
    "RoundConfig",
    "RoundResult",
    "check_update",
    "clip_update",
    "decode_diff",
    "encode_diff",
    "encoding_error",
    "fingerprint",
    "load_encoded",
    "save_encoded",
]
