"""The pipeline's errors: each names the key, file or model at fault and the fix.

A stage's ``main()`` prints one line for any of them (no traceback) and exits with
``EXIT_CONFIG`` for configuration errors, ``EXIT_INPUT`` for bad inputs; the engine's
own errors (``odt_ops.OdtError``) are reported the same way.
"""
from __future__ import annotations

EXIT_INPUT = 1
EXIT_CONFIG = 2


class PipelineError(Exception):
    """Base of every error a stage reports as one clean line."""

    exit_code = EXIT_INPUT


class ConfigError(PipelineError):
    """The configuration (conf/, params.yaml or an override) is not valid; names the key."""

    exit_code = EXIT_CONFIG


class DataError(PipelineError):
    """A data file is missing or malformed, or its samples do not fit the model; names the file."""


class ModelSourceError(PipelineError):
    """The model source cannot be turned into an ONNX model; names the source and the fix."""


class TrackingError(PipelineError):
    """The MLflow store cannot be reached or written."""
