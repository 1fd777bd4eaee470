"""Kernels: shape and indexing (Reshape, Transpose, Concat, Gather, Slice, ...) and constants.

Shape kernels return numpy views wherever numpy gives one (Reshape, Transpose, Squeeze,
Unsqueeze, Slice, Split, Expand, scalar Gather): these sit on the hot path of every
model, and a view costs nothing. Kernels that write (the Scatter family, Trilu) always
write into a fresh array, never into an input or a view of one.

Range and Slice are ``range_`` and ``slice_`` (PEP 8's trailing underscore): the
helpers here need the builtins of those names.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
import onnx

from odt_ops.kernels.registry import kernel

# ---------------------------------------------------------------- helpers


def _ints(values) -> list[int]:
    """A shape-like input (1-D int tensor) or attribute list as Python ints."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.reshape(-1).tolist()  # tolist gives Python ints already
    return [int(v) for v in np.asarray(values).reshape(-1).tolist()]


def _axis(axis: int, rank: int, *, extra: int = 0) -> int:
    """Normalize one axis into [0, rank + extra); ``extra=1`` for ops that insert a dimension."""
    bound = rank + extra
    if not -bound <= axis < bound:
        raise ValueError(f"axis {axis} is out of range for rank {rank} (accepted: [{-bound}, {bound - 1}])")
    return axis + bound if axis < 0 else axis


def _axes(axes: Sequence[int], rank: int) -> list[int]:
    out = [_axis(a, rank) for a in axes]
    if len(set(out)) != len(out):
        raise ValueError(f"axes {list(axes)} repeat an axis")
    return out


def _along(axis: int, index) -> tuple:
    """An indexing tuple that applies ``index`` to ``axis`` and keeps the leading axes whole."""
    return (slice(None),) * axis + (index,)


def _np_dtype(tensor_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type))


# ---------------------------------------------------------------- constants


@kernel("Constant", since=1)
def constant(*, value=None, value_float=None, value_floats=None, value_int=None, value_ints=None,
             value_string=None, value_strings=None, sparse_value=None):
    if value is not None:
        return (np.asarray(value),)
    if sparse_value is not None:
        return (np.asarray(sparse_value),)
    if value_float is not None:
        return (np.array(value_float, dtype=np.float32),)
    if value_floats is not None:
        return (np.array(value_floats, dtype=np.float32),)
    if value_int is not None:
        return (np.array(value_int, dtype=np.int64),)
    if value_ints is not None:
        return (np.array(value_ints, dtype=np.int64),)
    if value_string is not None:
        return (np.array(value_string, dtype=object),)
    if value_strings is not None:
        return (np.array(value_strings, dtype=object),)
    raise ValueError("Constant has none of its value attributes set")


@kernel("ConstantOfShape", since=9)
def constant_of_shape(input, *, value=None):
    fill = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value).reshape(-1)
    if fill.size != 1:
        raise ValueError(f"ConstantOfShape value must hold one element, got {fill.size}")
    if fill.dtype != object and not fill.view(np.uint8).any():  # all-zero bits: calloc'd pages are zero already
        return (np.zeros(_ints(input), dtype=fill.dtype),)
    return (np.full(_ints(input), fill[0], dtype=fill.dtype),)


@kernel("EyeLike", since=9)
def eye_like(input, *, dtype=None, k=0):
    if input.ndim != 2:
        raise ValueError(f"EyeLike takes a 2-D input, got rank {input.ndim}")
    out_dtype = input.dtype if dtype is None else _np_dtype(dtype)
    return (np.eye(*input.shape, k=k, dtype=out_dtype),)


@kernel("Range", since=11)
def range_(start, limit, delta, *, stash_type=1):
    dtype = start.dtype
    # half-precision ranges are computed in stash_type precision, then rounded once
    low = dtype in (np.dtype(np.float16), np.dtype("bfloat16"))
    work = _np_dtype(stash_type) if low else dtype
    s, lim, d = (np.asarray(v).astype(work).item() for v in (start, limit, delta))
    if d == 0:
        raise ValueError("Range delta must not be zero")
    # integer ranges count exactly: ceil(a / b) == -(-a // b) for either sign of b
    count = max(-((s - lim) // d) if dtype.kind in "iu" else math.ceil((lim - s) / d), 0)
    return ((np.asarray(s, dtype=work) + np.arange(count, dtype=work) * np.asarray(d, dtype=work)).astype(dtype),)


# ---------------------------------------------------------------- shape queries


@kernel("Shape", since=1)
def shape(data, *, start=0, end=None):
    # Python slicing clamps out-of-range start/end exactly as Shape-15 prescribes
    return (np.array(data.shape[start:end], dtype=np.int64),)


@kernel("Size", since=1)
def size(data):
    return (np.array(data.size, dtype=np.int64),)


@kernel("Identity", since=1)
def identity(input):
    return (input,)


# ---------------------------------------------------------------- reshaping (views)


def _reshape(data: np.ndarray, shape: list[int], allowzero: int) -> np.ndarray:
    # list membership and min, not generator scans: Reshape runs dozens of times a step
    if 0 in shape:
        if not allowzero:
            if 0 in shape[data.ndim:]:
                raise ValueError(f"Reshape shape {shape} copies dimension(s) the input (shape {data.shape}) lacks")
            shape = [data.shape[i] if d == 0 else d for i, d in enumerate(shape)]
        elif -1 in shape:
            raise ValueError(f"Reshape shape {shape} has both 0 (with allowzero=1) and -1")
    if shape.count(-1) > 1 or min(shape, default=0) < -1:
        raise ValueError(f"Reshape shape {shape} is invalid (at most one -1, no other negative dims)")
    return data.reshape(shape)


@kernel("Reshape", since=1)
def reshape_1(data, *, shape=None, consumed_inputs=None):
    if shape is None:
        raise ValueError("Reshape-1 needs the shape attribute")
    return (_reshape(data, list(shape), 0),)


@kernel("Reshape", since=5)
def reshape(data, shape, *, allowzero=0):
    return (_reshape(data, _ints(shape), allowzero),)


@kernel("Flatten", since=1)
def flatten(input, *, axis=1):
    # axis may equal the rank (everything goes to the first factor); negatives count from the rank
    if not -input.ndim <= axis <= input.ndim:
        raise ValueError(f"Flatten axis {axis} is out of range for rank {input.ndim}")
    axis = axis if axis >= 0 else axis + input.ndim
    return (input.reshape(math.prod(input.shape[:axis]), math.prod(input.shape[axis:])),)


@kernel("Transpose", since=1)
def transpose(data, *, perm=None):
    if perm is not None and sorted(perm) != list(range(data.ndim)):
        raise ValueError(f"Transpose perm {list(perm)} is not a permutation of the {data.ndim} axes")
    return (np.transpose(data, perm),)


def _squeeze(data: np.ndarray, axes) -> np.ndarray:
    if axes is None:
        return np.squeeze(data)
    axes = _axes(_ints(axes), data.ndim)
    bad = [a for a in axes if data.shape[a] != 1]
    if bad:
        raise ValueError(f"Squeeze axes {bad} have size != 1 in shape {data.shape}")
    return np.squeeze(data, axis=tuple(axes))


@kernel("Squeeze", since=1)
def squeeze_1(data, *, axes=None):
    return (_squeeze(data, axes),)


@kernel("Squeeze", since=13)
def squeeze(data, axes=None):
    return (_squeeze(data, axes),)


def _unsqueeze(data: np.ndarray, axes) -> np.ndarray:
    axes = _ints(axes)
    # axes index the output, whose rank grows by len(axes)
    # inserting unit axes is a view whatever the strides: np.expand_dims took twice as long
    # (~7 us against ~4), and attention and recurrent graphs run dozens a step
    shape = list(data.shape)
    for axis in sorted(_axes(axes, data.ndim + len(axes))):
        shape.insert(axis, 1)
    return data.reshape(shape)


@kernel("Unsqueeze", since=1)
def unsqueeze_1(data, *, axes):
    return (_unsqueeze(data, axes),)


@kernel("Unsqueeze", since=13)
def unsqueeze(data, axes):
    return (_unsqueeze(data, axes),)


@kernel("Expand", since=8)
def expand(input, shape):
    # bidirectional broadcast: a 1 in `shape` keeps the input's dimension
    out_shape = np.broadcast_shapes(input.shape, tuple(_ints(shape)))
    return (np.broadcast_to(input, out_shape),)


# ---------------------------------------------------------------- slicing (views)


def _clamped_slice(start: int, end: int, step: int, dim: int) -> slice:
    """ONNX Slice bounds for one axis as a Python slice (which treats negatives differently)."""
    if step == 0:
        raise ValueError("Slice step must not be zero")
    if start < 0:
        start += dim
    if end < 0:
        end += dim
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    start = min(max(start, 0), dim - 1)
    end = min(max(end, -1), dim - 1)
    # end == -1 means "past the front", which a Python slice spells None
    return slice(start, end if end >= 0 else None, step)


def _slice(data: np.ndarray, starts: list[int], ends: list[int], axes, steps) -> np.ndarray:
    axes = list(range(len(starts))) if axes is None else _axes(_ints(axes), data.ndim)
    steps = [1] * len(starts) if steps is None else _ints(steps)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise ValueError(f"Slice starts/ends/axes/steps differ in length: {len(starts)}/{len(ends)}/{len(axes)}/{len(steps)}")
    index = [slice(None)] * data.ndim
    for a, s, e, st in zip(axes, starts, ends, steps):
        index[a] = _clamped_slice(s, e, st, data.shape[a])
    return data[tuple(index)]


@kernel("Slice", since=1)
def slice_1(data, *, starts, ends, axes=None):
    return (_slice(data, list(starts), list(ends), axes, None),)


@kernel("Slice", since=10)
def slice_(data, starts, ends, axes=None, steps=None):
    return (_slice(data, _ints(starts), _ints(ends), axes, steps),)


def _split(input: np.ndarray, sizes, axis: int, parts: int, *, uneven: bool) -> tuple:
    axis = _axis(axis, input.ndim)
    dim = input.shape[axis]
    if sizes is None:
        if parts < 1:
            raise ValueError(f"Split needs at least one output, got {parts}")
        chunk = -(-dim // parts)
        if dim % parts and not uneven:
            raise ValueError(f"Split cannot cut axis {axis} of size {dim} into {parts} equal parts")
        sizes = [chunk] * (parts - 1) + [dim - chunk * (parts - 1)]
    else:
        sizes = _ints(sizes)
    if min(sizes, default=0) < 0 or sum(sizes) != dim:
        raise ValueError(f"Split sizes {sizes} do not partition axis {axis} of size {dim}")
    return tuple(input[cut] for cut in _cuts(axis, tuple(sizes)))


@functools.lru_cache(maxsize=256)
def _cuts(axis: int, sizes: tuple[int, ...]) -> tuple[tuple[slice, ...], ...]:
    """The index of each part: an LSTM splits small gates several times per step, where
    building the slices cost more than the views they make."""
    cuts, start = [], 0
    for size in sizes:
        cuts.append(_along(axis, slice(start, start + size)))
        start += size
    return tuple(cuts)


@kernel("Split", since=1)
def split_1(input, split_sizes=None, *, axis=0, split=None, _num_outputs):
    # Split-1 takes the sizes as a second input or as the attribute; 2 and 11 keep the attribute
    sizes = split if split is not None else split_sizes
    return _split(input, sizes, axis, _num_outputs, uneven=False)


@kernel("Split", since=13)
def split_13(input, split=None, *, axis=0, _num_outputs):
    return _split(input, split, axis, _num_outputs, uneven=False)


@kernel("Split", since=18)
def split(input, split=None, *, axis=0, num_outputs=None, _num_outputs):
    if split is not None and num_outputs is not None:
        raise ValueError("Split takes either the split input or num_outputs, not both")
    parts = _num_outputs if num_outputs is None else num_outputs
    if num_outputs is not None and num_outputs != _num_outputs:
        raise ValueError(f"Split num_outputs={num_outputs} but the node has {_num_outputs} outputs")
    return _split(input, split, axis, parts, uneven=True)


@kernel("Concat", since=1)
def concat_1(*inputs, axis=1):
    return concat(*inputs, axis=axis)


@kernel("Concat", since=4)
def concat(*inputs, axis):
    if len(inputs) == 1:
        return (inputs[0],)
    return (np.concatenate(inputs, axis=_axis(axis, inputs[0].ndim)),)


@kernel("Tile", since=1)
def tile_1(input, tiles, axis):
    reps = [1] * input.ndim
    reps[_axis(int(axis), input.ndim)] = int(tiles)
    return (np.tile(input, reps),)


@kernel("Tile", since=6)
def tile(input, repeats):
    reps = _ints(repeats)
    if len(reps) != input.ndim or any(r < 0 for r in reps):
        raise ValueError(f"Tile repeats {reps} must be {input.ndim} non-negative values")
    return (np.tile(input, reps),)


@kernel("Compress", since=9)
def compress(input, condition, *, axis=None):
    cond = np.asarray(condition).reshape(-1).astype(bool, copy=False)
    if axis is None:
        return (np.compress(cond, input.reshape(-1)),)
    return (np.compress(cond, input, axis=_axis(axis, input.ndim)),)


# ---------------------------------------------------------------- gathering


@kernel("Gather", since=1)
def gather(data, indices, *, axis=0):
    axis = _axis(axis, data.ndim)
    if indices.ndim == 0:
        # a scalar index picks one slice: a view, no copy
        i = int(indices)
        dim = data.shape[axis]
        if not -dim <= i < dim:
            raise ValueError(f"Gather index {i} is out of range for axis {axis} of size {dim}")
        return (data[_along(axis, i)],)
    # np.take counts negative indices from the end and raises on out-of-range ones
    return (np.take(data, indices, axis=axis),)


def _flat_elements_index(shape: Sequence[int], indices: np.ndarray, axis: int) -> np.ndarray:
    """The flat (C-order, 1-D) positions, in an array of ``shape``, of data[..., indices[i...], ...] along ``axis``.

    One flat index array makes numpy's fancy indexing ~2.7x faster than a tuple of broadcast
    per-axis grids; the price is checking the axis bounds here (an index past the axis would
    otherwise land in the next row)."""
    if len(shape) == 1:
        return indices  # numpy's own indexing wraps negatives and checks the bounds
    n = shape[axis]
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < -n or high >= n:
            raise ValueError(f"indices must lie in [{-n}, {n - 1}] along axis {axis} (size {n}), got {low}..{high}")
        if low < 0:
            indices = np.where(indices < 0, indices + n, indices)
    pitch = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    flat = np.multiply(indices, pitch[axis], dtype=np.intp)
    # the other axes' offsets, summed over the (small) grid that has 1 along ``axis``
    grid = [np.arange(m, dtype=np.intp).reshape((m,) + (1,) * (len(shape) - 1 - d)) * pitch[d]
            for d, m in enumerate(indices.shape) if d != axis]
    flat += functools.reduce(np.add, grid)
    return flat.reshape(-1)


def _check_elements(data: np.ndarray, indices: np.ndarray, axis: int) -> None:
    if indices.ndim != data.ndim:
        raise ValueError(f"indices rank {indices.ndim} differs from data rank {data.ndim}")
    too_big = [d for d in range(data.ndim) if d != axis and indices.shape[d] > data.shape[d]]
    if too_big:
        raise ValueError(f"indices shape {indices.shape} exceeds data shape {data.shape} on axes {too_big}")


@kernel("GatherElements", since=11)
def gather_elements(data, indices, *, axis=0):
    axis = _axis(axis, data.ndim)
    _check_elements(data, indices, axis)
    # indices may be smaller than data off the axis: narrow data (a view) to match
    narrowed = data[tuple(slice(n) if d != axis else slice(None) for d, n in enumerate(indices.shape))]
    return (np.take_along_axis(narrowed, indices, axis=axis),)


@kernel("GatherND", since=11)
def gather_nd(data, indices, *, batch_dims=0):
    b = batch_dims
    k = indices.shape[-1]
    if b + k > data.ndim or indices.shape[:b] != data.shape[:b]:
        raise ValueError(f"GatherND: indices {indices.shape} with batch_dims={b} do not fit data {data.shape}")
    batch = math.prod(data.shape[:b])
    per_batch = math.prod(indices.shape[b:-1])
    flat_idx = indices.reshape(batch, per_batch, k)
    # one fancy index over (batch, k coordinates); the batch row is repeated for every tuple
    rows = np.broadcast_to(np.arange(batch).reshape(batch, 1), (batch, per_batch))
    picked = data.reshape(batch, *data.shape[b:])[(rows, *(flat_idx[..., j] for j in range(k)))]
    return (picked.reshape(*indices.shape[:-1], *data.shape[b + k:]),)


# ---------------------------------------------------------------- scattering (fresh output)

_SCATTER_UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter(data: np.ndarray, index: tuple, updates: np.ndarray, reduction: str) -> np.ndarray:
    out = data.copy()
    if reduction == "none":
        out[index] = updates
        return out
    ufunc = _SCATTER_UFUNCS.get(reduction)
    if ufunc is None:
        raise ValueError(f"unknown reduction {reduction!r} (expected none, add, mul, max or min)")
    # ufunc.at applies every duplicate index in turn, as the reductions require
    ufunc.at(out, index, updates)
    return out


@kernel("ScatterElements", since=11)
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    axis = _axis(axis, data.ndim)
    _check_elements(data, indices, axis)
    if updates.shape != indices.shape:
        raise ValueError(f"updates shape {updates.shape} differs from indices shape {indices.shape}")
    flat = _scatter(data.reshape(-1), _flat_elements_index(data.shape, indices, axis), updates.reshape(-1), reduction)
    return (flat.reshape(data.shape),)


@kernel("Scatter", since=9)
def scatter(data, indices, updates, *, axis=0):
    return scatter_elements(data, indices, updates, axis=axis)


@kernel("ScatterND", since=11)
def scatter_nd(data, indices, updates, *, reduction="none"):
    k = indices.shape[-1]
    want = indices.shape[:-1] + data.shape[k:]
    if k > data.ndim or updates.shape != want:
        raise ValueError(f"ScatterND: updates shape {updates.shape} should be {want} for indices {indices.shape}")
    return (_scatter(data, tuple(indices[..., j] for j in range(k)), updates, reduction),)


# ---------------------------------------------------------------- masks and encodings


def _one_hot(indices, depth, values, axis: int, negative: bool) -> np.ndarray:
    depth = int(np.asarray(depth).reshape(-1)[0])
    if depth < 1:
        raise ValueError(f"OneHot depth must be positive, got {depth}")
    values = np.asarray(values).reshape(-1)
    if values.size != 2:
        raise ValueError(f"OneHot values must be [off_value, on_value], got {values.size} elements")
    axis = _axis(axis, indices.ndim, extra=1)
    # widen integers so idx + depth cannot overflow; a float index must be integral to match
    idx = indices.astype(np.int64) if indices.dtype.kind in "biu" else indices
    if negative:
        idx = np.where(idx < 0, idx + depth, idx)
    # compare against the class index laid along `axis`; out-of-range indices match nothing
    classes = np.arange(depth).reshape((depth,) + (1,) * (indices.ndim - axis))
    hot = np.expand_dims(idx, axis) == classes
    return np.where(hot, values[1], values[0])


@kernel("OneHot", since=9)
def one_hot_9(indices, depth, values, *, axis=-1):
    return (_one_hot(indices, depth, values, axis, negative=False),)


@kernel("OneHot", since=11)
def one_hot(indices, depth, values, *, axis=-1):
    return (_one_hot(indices, depth, values, axis, negative=True),)


@kernel("Trilu", since=14)
def trilu(input, k=None, *, upper=1):
    diag = 0 if k is None else int(k)
    return ((np.triu if upper else np.tril)(input, diag),)


@kernel("NonZero", since=9)
def non_zero(X):
    if X.ndim == 0:
        return (np.zeros((0, int(bool(X))), dtype=np.int64),)
    return (np.array(np.nonzero(X), dtype=np.int64).reshape(X.ndim, -1),)


@kernel("ReverseSequence", since=10)
def reverse_sequence(input, sequence_lens, *, batch_axis=1, time_axis=0):
    if {batch_axis, time_axis} != {0, 1}:
        raise ValueError(f"ReverseSequence needs batch_axis/time_axis to be 0 and 1, got {batch_axis}/{time_axis}")
    steps = input.shape[time_axis]
    lens = sequence_lens.astype(np.int64).reshape(-1)
    t = np.arange(steps).reshape(steps, 1)
    # source time step per (time, batch): reversed inside each sequence, untouched after it
    source = np.where(t < lens, lens - 1 - t, t)
    if time_axis == 1:
        source = source.T
    source = source.reshape(source.shape + (1,) * (input.ndim - 2))
    return (np.take_along_axis(input, source, axis=time_axis),)
