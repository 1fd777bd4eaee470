"""Every error of ours is also the builtin a Python user would catch for that fault."""
from __future__ import annotations

import builtins
import inspect

import pytest

from odt_ops import errors
from odt_ops.api import CheckpointState
from odt_ops.export import load_diff
from odt_ops.ir.load import read_model


def test_every_error_class_is_also_a_builtin_exception():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.OdtError) and c is not errors.OdtError]
    assert len(classes) >= 10
    builtin = {c for c in vars(builtins).values() if isinstance(c, type) and issubclass(c, Exception)} - {Exception}
    lacking = [c.__name__ for c in classes if not any(issubclass(c, b) for b in builtin)]
    assert not lacking, f"{lacking} subclass no builtin exception"


@pytest.mark.parametrize("read", [read_model, CheckpointState.load_checkpoint, load_diff])
def test_a_missing_file_is_a_file_not_found_error_that_names_it(tmp_path, read):
    with pytest.raises(FileNotFoundError, match="nowhere") as raised:
        read(tmp_path / "nowhere")
    assert isinstance(raised.value, errors.OdtError)
