"""Gradient rules: reshaping, permuting, joining, slicing, gathering and padding.

Pure data movement has a uniform gradient: run the same movement on the map of X's
flat positions and scatter-add dY back to the positions it read (``through_positions``).
Rules use it where no cheaper inverse exists (strided or reversed Slice, Pad's reflect/
edge/wrap modes, Tile with run-time repeats, Compress, ReverseSequence).
"""
from __future__ import annotations

import numpy as np
import onnx

from odt_ops.grad.registry import gradient

INT64_MAX = np.iinfo(np.int64).max


def _reshape_back(ctx, dY):
    """dX = reshape(dY, shape(X))"""
    return (ctx.b.Reshape(dY, ctx.reshape_target(ctx.inputs[0])),)


for _op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze"):
    gradient(_op)(_reshape_back)


def through_positions(ctx, dY, move, *, duplicates: bool) -> str:
    """dX for an op that only moves X's elements: ``move`` applied to the map of X's flat
    positions says where each element of Y came from; dY is scattered (added, when an
    element may be read twice) back to those positions."""
    b, X = ctx.b, ctx.inputs[0]
    shape = ctx.shape_of(X)
    size = b.Reshape(b.Size(X), ctx.ints([1]))
    positions = b.Reshape(b.Range(ctx.ints(0), b.Size(X), ctx.ints(1)), shape)
    source = b.Reshape(move(positions), ctx.ints([-1]))
    flat = b.ConstantOfShape(size, value=np.zeros((1,), dtype=ctx.dtype(X)))
    scattered = b.ScatterElements(flat, source, b.Reshape(dY, ctx.ints([-1])), axis=0, reduction="add" if duplicates else None)
    return b.Reshape(scattered, shape)


@gradient("Transpose")
def transpose_grad(ctx, dY):
    """dX = transpose(dY, argsort(perm))"""
    perm = ctx.attrs.get("perm") or list(reversed(range(ctx.rank(ctx.inputs[0]))))
    return (ctx.b.Transpose(dY, perm=[int(i) for i in np.argsort(perm)]),)


@gradient("Expand", broadcasting=True)
def expand_grad(ctx, dY):
    """dX = dY summed over the expanded axes (by the walker)"""
    return dY, None


@gradient("Concat")
def concat_grad(ctx, dY):
    """dX_i = split(dY, sizes of X_i, axis)"""
    b, inputs, axis = ctx.b, list(ctx.node.input), ctx.attrs["axis"]
    if len(inputs) == 1:
        return (dY,)
    sizes = [_dim(ctx, x, axis) for x in inputs]
    if all(isinstance(s, int) for s in sizes):
        split = ctx.ints(sizes)
    elif isinstance(sizes[0], str) and len(set(sizes)) == 1 and ctx.b.opset >= 18:
        # equal symbolic parts (a recurrence's steps, each [batch, H]): an even split, no Shape per part
        return tuple(b.op_multi("Split", [dY], len(inputs), axis=axis, num_outputs=len(inputs)))
    else:
        split = b.Concat(*[b.Shape(x, start=_axis(ctx, x, axis), end=_axis(ctx, x, axis) + 1) for x in inputs], axis=0)
    return tuple(b.op_multi("Split", [dY, split], len(inputs), axis=axis))


def _axis(ctx, x: str, axis: int) -> int:
    return axis + ctx.rank(x) if axis < 0 else axis


def _dim(ctx, x: str, axis: int):
    shape = ctx.shape(x)
    return None if shape is None else shape[axis]


@gradient("Split")
def split_grad(ctx, *dYs):
    """dX = concat(dY_i, axis), zeros for outputs without a gradient"""
    parts = [g if g is not None else ctx.zeros_like(y) for g, y in zip(dYs, ctx.outputs)]
    return (ctx.b.Concat(*parts, axis=ctx.attrs["axis"]) if len(parts) > 1 else parts[0],)


@gradient("Slice")
def slice_grad(ctx, dY):
    """dX = dY padded with zeros back to X's extent (unit steps); scattered back otherwise"""
    b, (_x, starts, ends, axes, steps) = ctx.b, ctx.inputs[:5]
    pads = _slice_pads(ctx)
    if pads is not None:
        begin, end, axes_ = pads
        return (b.Pad(dY, ctx.ints(begin + end), "", ctx.ints(axes_)),)
    move = lambda positions: b.Slice(positions, starts, ends, axes or None, steps or None)
    return (through_positions(ctx, dY, move, duplicates=False),)


def _slice_pads(ctx):
    """Static (begin, end, axes) zero pads undoing a unit-step Slice, or None."""
    X, starts, ends, axes, steps = ctx.inputs[:5]
    values = [ctx.value(n) if n else None for n in (starts, ends, axes, steps)]
    if values[0] is None or values[1] is None or (axes and values[2] is None) or (steps and values[3] is None):
        return None
    shape = ctx.shape(X)
    rank = len(shape) if shape is not None else None
    starts_, ends_ = values[0].tolist(), values[1].tolist()
    axes_ = values[2].tolist() if axes else list(range(len(starts_)))
    steps_ = values[3].tolist() if steps else [1] * len(starts_)
    if rank is None or any(s != 1 for s in steps_):
        return None
    begin, end, norm = [], [], []
    for a, s, e in zip(axes_, starts_, ends_):
        a = a + rank if a < 0 else a
        dim = shape[a]
        if not isinstance(dim, int):
            return None
        lo, hi, _ = slice(s, e).indices(dim)
        hi = max(hi, lo)
        begin.append(lo)
        end.append(dim - hi)
        norm.append(a)
    return begin, end, norm


@gradient("Gather")
def gather_grad(ctx, dY):
    """dX = zeros with dY added at the gathered rows (ScatterND, axis moved to the front)"""
    b, (X, indices) = ctx.b, ctx.inputs[:2]
    rank, q = ctx.rank(X), ctx.rank(indices)
    axis = ctx.attrs["axis"] % rank if rank else 0
    picked, shape = ctx.value(indices), ctx.b.shape(X)
    if picked is not None and picked.ndim == 0 and shape is not None and isinstance(shape[axis], int):
        # one constant index (attention's q, k, v = qkv[0], qkv[1], qkv[2]): dY padded with zeros
        # along the axis, no scatter into a zero tensor
        i = int(picked) % shape[axis]
        pads = [0] * (2 * rank)
        pads[axis], pads[rank + axis] = i, shape[axis] - 1 - i
        return b.Pad(b.Unsqueeze(dY, ctx.ints([axis])), ctx.ints(pads)), None
    index = b.Unsqueeze(indices, ctx.ints([-1]))
    if axis == 0:
        return b.ScatterND(ctx.zeros_like(X), index, dY, reduction="add"), None
    # X: pre + [n] + post, dY: pre + I + post; scatter into [n] + pre + post, then move n back
    to_front = [axis, *range(axis), *range(axis + 1, rank)]
    g = b.Transpose(dY, perm=[*range(axis, axis + q), *range(axis), *range(axis + q, axis + q + rank - 1 - axis)])
    zeros_shape = b.Gather(ctx.shape_of(X), ctx.ints(to_front), axis=0)
    zeros = b.ConstantOfShape(zeros_shape, value=np.zeros((1,), dtype=ctx.dtype(X)))
    scattered = b.ScatterND(zeros, index, g, reduction="add")
    return b.Transpose(scattered, perm=[int(i) for i in np.argsort(to_front)]), None


@gradient("GatherElements")
def gather_elements_grad(ctx, dY):
    """dX = scatter-add of dY at indices along axis"""
    X, indices = ctx.inputs[:2]
    return ctx.b.ScatterElements(ctx.zeros_like(X), indices, dY, axis=ctx.attrs["axis"], reduction="add"), None


@gradient("GatherND")
def gather_nd_grad(ctx, dY):
    """dX = scatter-add of dY at the index tuples; with batch_dims = n, each tuple is first
    prefixed with the coordinates of its batch position (the n leading dims), which makes it a
    plain batch_dims=0 index into X"""
    b, (X, indices) = ctx.b, ctx.inputs[:2]
    n = ctx.attrs["batch_dims"]
    if n:
        q = ctx.rank(indices)
        grid = b.Slice(ctx.shape_of(indices), ctx.ints([0]), ctx.ints([q - 1]))  # indices.shape[:-1]
        grid = b.Concat(grid, ctx.ints([1]), axis=0)
        coordinates = []
        for axis in range(n):
            size = b.Slice(ctx.shape_of(X), ctx.ints([axis]), ctx.ints([axis + 1]))
            steps = b.Range(ctx.ints(0), b.Squeeze(size, ctx.ints([0])), ctx.ints(1))
            along = [1] * q
            along[axis] = -1
            coordinates.append(b.Expand(b.Reshape(steps, ctx.ints(along)), grid))
        indices = b.Concat(*coordinates, b.Cast(indices, to=onnx.TensorProto.INT64), axis=-1)
    return b.ScatterND(ctx.zeros_like(X), indices, dY, reduction="add"), None


@gradient("ScatterElements")
def scatter_elements_grad(ctx, dY):
    """see _scatter_grad; positions are element indices along ``axis``"""
    axis = ctx.attrs["axis"]
    return _scatter_grad(ctx, dY, lambda *a, **kw: ctx.b.ScatterElements(*a, axis=axis, **kw),
                         lambda *a: ctx.b.GatherElements(*a, axis=axis))


@gradient("ScatterND")
def scatter_nd_grad(ctx, dY):
    """see _scatter_grad; positions are index tuples"""
    return _scatter_grad(ctx, dY, ctx.b.ScatterND, ctx.b.GatherND)


def _scatter_grad(ctx, dY, scatter, gather):
    """Y = data with the updates written (none), added (add), multiplied (mul) or maxed/minned in.

    none: ddata = dY with the written positions zeroed, dupdates = dY there.
    add: ddata = dY, dupdates = dY at their positions.
    mul: ddata = dY * (product of the updates at the position); dupdates = dY * Y / update, or
    exactly dY * data when the indices are constants hitting each position once.
    max/min: the gradient goes to whatever equals the result, shared evenly among ties (as
    torch's scatter_reduce amax/amin)."""
    b, (data, indices, updates) = ctx.b, ctx.inputs[:3]
    reduction = ctx.attrs["reduction"]
    ddata = dupdates = None
    if reduction == "none":
        ddata = scatter(dY, indices, ctx.zeros_like(updates)) if ctx.needs(0) else None
        dupdates = gather(dY, indices) if ctx.needs(2) else None
    elif reduction == "add":
        ddata = dY if ctx.needs(0) else None
        dupdates = gather(dY, indices) if ctx.needs(2) else None
    elif reduction == "mul":
        Y = ctx.outputs[0]
        if ctx.needs(0):
            one = ctx.const(1, like=data)
            ones = b.Add(ctx.zeros_like(data), one)
            ddata = b.Mul(dY, scatter(ones, indices, updates, reduction="mul"))
        if ctx.needs(2):
            if _hits_each_position_once(ctx, indices):
                dupdates = gather(b.Mul(dY, data), indices)
            else:
                dupdates = b.Div(gather(b.Mul(dY, Y), indices), updates)
    elif reduction in ("max", "min"):
        Y = ctx.outputs[0]
        at_result = b.Cast(b.Equal(data, Y), to=_float_type(ctx, data))
        updates_at_result = b.Cast(b.Equal(updates, gather(Y, indices)), to=_float_type(ctx, data))
        ties = b.Add(at_result, scatter(ctx.zeros_like(data), indices, updates_at_result, reduction="add"))
        share = b.Div(dY, ties)
        ddata = b.Mul(share, at_result) if ctx.needs(0) else None
        dupdates = b.Mul(gather(share, indices), updates_at_result) if ctx.needs(2) else None
    else:
        raise ctx.fail(f"{ctx.node.op_type} gradient with reduction={reduction!r} is not supported")
    return ddata, None, dupdates


def _float_type(ctx, name: str) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(ctx.dtype(name))


def _hits_each_position_once(ctx, indices: str) -> bool:
    value = ctx.value(indices)
    if value is None:
        return False
    rows = value.reshape(-1, value.shape[-1]) if ctx.node.op_type == "ScatterND" else None
    if rows is not None:
        return len({tuple(r) for r in rows}) == len(rows)
    axis = ctx.attrs["axis"] % value.ndim
    moved = np.moveaxis(value, axis, -1).reshape(-1, value.shape[axis])  # positions along axis, per line
    return all(len(set(line)) == len(line) for line in moved)


@gradient("Tile")
def tile_grad(ctx, dY):
    """dX = dY viewed as [r0, d0, r1, d1, ...] summed over the r axes"""
    b, (X, repeats) = ctx.b, ctx.inputs[:2]
    reps, shape = ctx.value(repeats), ctx.static_shape(X)
    if reps is None or shape is None:
        return through_positions(ctx, dY, lambda positions: b.Tile(positions, repeats), duplicates=True), None
    interleaved = [v for pair in zip(reps.tolist(), shape) for v in pair]
    blocks = b.Reshape(dY, ctx.ints(interleaved))
    return b.ReduceSum(blocks, ctx.ints(list(range(0, 2 * len(shape), 2))), keepdims=0), None


@gradient("Compress")
def compress_grad(ctx, dY):
    """dX = dY scattered back to the kept positions, zeros elsewhere"""
    b, (_x, condition) = ctx.b, ctx.inputs[:2]
    axis = ctx.attrs.get("axis")
    move = lambda positions: b.Compress(positions, condition, axis=axis)
    return through_positions(ctx, dY, move, duplicates=False), None


@gradient("ReverseSequence")
def reverse_sequence_grad(ctx, dY):
    """dX = reverse_sequence(dY) (the op is its own inverse)"""
    X, lens = ctx.inputs[:2]
    return ctx.b.ReverseSequence(dY, lens, batch_axis=ctx.attrs["batch_axis"], time_axis=ctx.attrs["time_axis"]), None


@gradient("Trilu")
def trilu_grad(ctx, dY):
    """dX = trilu(dY) with the same k and upper"""
    X, k = ctx.inputs[:2]
    return ctx.b.Trilu(dY, k, upper=ctx.attrs["upper"]), None


@gradient("Identity")
def identity_grad(ctx, dY):
    """dX = dY"""
    return (dY,)
