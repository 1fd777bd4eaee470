"""One exception hierarchy for the engine.

Every error names the thing at fault (file, node, op, input, parameter) and, where
there is one, the fix. Callers catch ``OdtError``; nothing below it leaks numpy
or protobuf exceptions to users. Each class is also the builtin a Python user would
catch for that kind of fault (ValueError for bad values and files, FileNotFoundError for
a missing file, NotImplementedError for an op we do not run, ...), so generic code
keeps working.
"""
from __future__ import annotations

from collections.abc import Iterable

from odt_ops.domain import is_default


class OdtError(Exception):
    """Base of every error the engine raises on bad input."""


class ModelLoadError(OdtError, ValueError):
    """The model file or bytes cannot be read as an ONNX model."""


class ModelCheckError(OdtError, ValueError):
    """The model is readable but not a valid ONNX model (onnx.checker, shapes, names)."""


class UnsupportedOpError(OdtError, NotImplementedError):
    """The model uses ops the engine has no kernel (or gradient rule) for.

    ``missing`` maps (domain, op_type, opset) to the names of the nodes using it, so
    one error lists everything that is missing, not just the first miss.
    """

    def __init__(self, missing: dict[tuple[str, str, int], list[str]], what: str = "kernel", source: str | None = None,
                 reasons: dict[str, str] | None = None):
        self.missing = dict(missing)
        self.what = what
        self.source = source
        reasons = reasons or {}
        lines = [
            f"  {domain or 'ai.onnx'}::{op} (opset {opset}) used by {len(nodes)} node(s): "
            + ", ".join(nodes[:5])
            + (", ..." if len(nodes) > 5 else "")
            + (f"\n      why: {reasons[op]}" if is_default(domain) and op in reasons else "")
            for (domain, op, opset), nodes in sorted(self.missing.items())
        ]
        super().__init__(
            (f"{source}: " if source else "") + f"{len(self.missing)} op type(s) have no {what} in odt_ops:\n" + "\n".join(lines)
            + "\nReplace these ops in the exported model or add them to odt_ops."
        )


class InputError(OdtError, ValueError):
    """Run-time feeds do not match the model's inputs (name, dtype or shape)."""


class ArgumentError(OdtError, ValueError):
    """An argument of a public constructor or function is out of range or contradicts another;
    the message names the argument and what it accepts."""


class KernelError(OdtError, RuntimeError):
    """A kernel failed on the values it was given; names the node and the input shapes."""


def node_label(node) -> str:
    """How every message names a node (an onnx.NodeProto): its op and name, or what it produces."""
    return f"{node.op_type} node {node.name!r}" if node.name else f"{node.op_type} node producing {list(node.output)}"


def describe_arrays(values: Iterable[object]) -> str:
    """Short 'float32[2,3], None' rendering of kernel inputs for error messages."""
    parts = []
    for v in values:
        shape = getattr(v, "shape", None)
        dtype = getattr(v, "dtype", None)
        parts.append("None" if v is None else f"{dtype}[{','.join(map(str, shape))}]" if shape is not None else type(v).__name__)
    return ", ".join(parts)


class CheckpointError(OdtError, ValueError):
    """A checkpoint file is unreadable, corrupted, from a newer format, or does not fit the model."""


class ArtifactError(OdtError, ValueError):
    """Training artifacts cannot be generated or do not fit together."""


class GradientError(OdtError, ValueError):
    """A gradient graph cannot be built (a rule is missing or a shape is unknown)."""


class ModelDiffError(OdtError, ValueError):
    """A model difference is unreadable or does not fit the model it is applied to."""


class TrainingDivergedError(OdtError, FloatingPointError):
    """The loss became NaN or infinite; parameters and gradients were left untouched."""


# A missing file is both the reader's error and a FileNotFoundError.
class ModelFileNotFoundError(ModelLoadError, FileNotFoundError):
    """No model file at the given path."""


class CheckpointFileNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint file at the given path."""


class ModelDiffFileNotFoundError(ModelDiffError, FileNotFoundError):
    """No model difference file at the given path."""


def not_found(error: type[OdtError]) -> type[OdtError]:
    """The file-not-found form of ``error`` (itself when it has none)."""
    return {ModelLoadError: ModelFileNotFoundError, CheckpointError: CheckpointFileNotFoundError,
            ModelDiffError: ModelDiffFileNotFoundError}.get(error, error)


class WebBundleError(OdtError, ValueError):
    """Training artifacts cannot be written as a web bundle (browser training), or the page's files are missing."""


class LoraError(OdtError, ValueError):
    """LoRA adapters cannot be added, merged or exported as asked; names the option, glob, node or weight at fault."""


class QuantizationError(OdtError, ValueError):
    """A quantized (QDQ) model cannot be fine-tuned or re-quantized as asked; names the node and why."""


# Bad numbers given to a training step (issue 21): each names the value and leaves the state as it was.
class ArgumentTypeError(ArgumentError, TypeError):
    """An argument has the wrong type (a learning rate given as a string or None); also the
    TypeError that ONNX Runtime's bindings raise for it."""


class LabelError(InputError):
    """A class label lies outside [0, classes) (and is not the loss's ignore_index)."""


class EmptyBatchError(InputError):
    """A train or eval step was given a batch of no examples."""


class NonFiniteValueError(CheckpointError):
    """A checkpoint would hold NaN or infinite parameters, buffers or optimizer states."""


class FederationSettingsError(ArgumentError):
    """A federation's settings are out of range; ``problems`` lists each (key, value,
    what is expected), keys as conf/federated and the Flower run config name them."""

    def __init__(self, problems: list[tuple[str, object, str]]):
        super().__init__("federation settings: " + "; ".join(f"{k}={v!r} (expected {why})" for k, v, why in problems))
        self.problems = problems


class StaticBatchError(ModelCheckError):
    """An export made with a static batch holds a constant equal to that batch whose role the data
    flow does not decide (the batch, or a model size that happens to equal it); names the node.
    Loading catches it: such a model keeps its export batch, with a StaticBatchWarning."""


class StaticBatchWarning(UserWarning):
    """A static-batch export runs only at the batch it was exported with: the StaticBatchError's
    text says which node held the undecided constant and how to export instead."""
