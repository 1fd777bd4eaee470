"""Federated learning with the engine as each client's local trainer.

Framework-neutral (numpy and onnx only, like the rest of odt_ops):

- ``local``: ``LocalTrainer`` runs one client's round (global parameters in, as arrays or
  a model difference; update, example count and metrics out) and evaluation;
- ``proximal``: FedProx's proximal term as an exact gradient correction;
- ``encoding``: model differences on the wire (float32, float16, int8 with a per-tensor
  scale), and the checks a server runs on an update;
- ``settings``: a federation's settings (``FederationSettings``), the schema of the
  federate stage's ``federated`` section and of the Flower App's run config.

On Flower (``pip install odt[federated]``), in Flower's layout: ``client_app`` (the
ClientApp), ``server_app`` (the ServerApp and the guarded strategy), ``task`` (a client's
data, the reply's records, server-side evaluation), ``simulation`` (Flower's Ray engine)
and ``secagg`` (SecAgg+); ``flower`` imports their public names in one place.
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
