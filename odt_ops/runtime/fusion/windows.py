"""Convolution weight gradients' window taps: stacked strided slices, and zero-padded stride-1 windows read as row windows."""
from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.ir.attributes import node_attributes
from odt_ops.kernels.geometry import WindowGeometry
from odt_ops.kernels.windows import keeps_rows, row_windows, zero_wrapped
from odt_ops.runtime.fusion.graph import DOMAIN, STANDARD, Graph, fused_node, fused_op, fusion, kernel_of


@fusion("stacked_slices")
def _stacked_slices(g: Graph) -> bool:
    """Concat(axis=a) of Unsqueeze(Slice(x, constant starts/ends/axes/steps > 0), [a]) over one x
    -> one node stacking the slices (the Conv weight gradient's kernel taps)."""
    changed = False
    for concat in [n for n in g.nodes if n.op_type == "Concat" and n.domain in STANDARD and len(n.input) > 1]:
        axis = node_attributes(concat).get("axis")
        if axis is None:
            continue
        found = [_tap(g, name, concat, axis) for name in concat.input]
        taps = [t for t in found if t is not None]
        if len(taps) < len(found) or len({t[0].input[0] for t in taps}) != 1:
            continue
        regions = [region for _, _, region in taps]
        fused = fused_node("StackedSlices", [taps[0][0].input[0]], [concat.output[0]], f"fused/{concat.name or concat.output[0]}",
                            axis=axis, rank=len(regions[0]), regions=[v for region in regions for item in region for v in item])
        changed = g.replace([n for slice_, unsqueeze, _ in taps for n in (slice_, unsqueeze)] + [concat], fused) or changed
    return changed


def _tap(g: Graph, name: str, concat: onnx.NodeProto, axis: int):
    """(Slice, Unsqueeze, [(axis, start, end, step) per sliced axis]) for one Concat input, or None."""
    unsqueeze = g.producer(name, "Unsqueeze")
    if unsqueeze is None or g.sole_reader(name, "Concat") is not concat or g.ints(unsqueeze, 1, "axes") != [axis]:
        return None
    slice_ = g.producer(unsqueeze.input[0], "Slice")
    if slice_ is None or g.sole_reader(slice_.output[0], "Unsqueeze") is not unsqueeze:
        return None
    starts, ends = g.ints(slice_, 1, "starts"), g.ints(slice_, 2, "ends")
    axes, steps = g.ints(slice_, 3, "axes"), g.ints(slice_, 4, "steps")
    given = [len(slice_.input) > i and bool(slice_.input[i]) for i in (3, 4)]
    if starts is None or ends is None or (axes is None and given[0]) or (steps is None and given[1]):
        return None  # a non-constant input
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps) or min(steps, default=1) < 1:
        return None
    return slice_, unsqueeze, [(a, s, e, st) for a, s, e, st in zip(axes, starts, ends, steps)]


@fused_op("StackedSlices")
def _stack_slices(attrs: dict, opset: int) -> Callable[..., tuple]:
    axis, rank, flat = attrs["axis"], attrs["rank"], attrs["regions"]
    regions = [[tuple(flat[i + 4 * j: i + 4 * j + 4]) for j in range(rank)] for i in range(0, len(flat), 4 * rank)]

    def run(x):
        parts = []
        for region in regions:
            index = [slice(None)] * x.ndim
            for a, start, end, step in region:
                if not -x.ndim <= a < x.ndim or index[a % x.ndim] != slice(None):
                    raise ValueError(f"Slice axes {[r[0] for r in region]} do not fit a tensor of rank {x.ndim}")
                # positive steps: Python's clamping of start and end is the Slice spec's
                index[a % x.ndim] = slice(start, end, step)
            parts.append(x[tuple(index)])
        return (np.stack(parts, axis=axis),)

    return run


@fusion("window_columns")
def _window_columns(g: Graph) -> bool:
    """StackedSlices of a zero-Padded input whose slices are a stride-1 window's taps (a Conv weight
    gradient's columns) -> one node that reads the taps from the unpadded planes, one flat offset
    per tap (kernels/windows.py's row windows, as the forward Conv's im2col does) when the output
    rows are as long as the input's: whole-plane copies instead of a copy per short row. The
    values are the same copies and zeros."""
    changed = False
    for stack in [n for n in g.nodes if n.op_type == "StackedSlices" and n.domain == DOMAIN]:
        pad = g.producer(stack.input[0], "Pad")
        if pad is None or g.sole_reader(pad.output[0], "StackedSlices", 0, domains=(DOMAIN,)) is not stack:
            continue
        attrs = node_attributes(stack)
        window = _stride_one_window(g, pad, attrs)
        if window:
            kernel, dilations, pads = window
            fused = fused_node("WindowColumns", [pad.input[0], *pad.input[1:]], stack.output, f"fused/{stack.name}",
                                kernel=kernel, dilations=dilations, pads=pads, **attrs)
            changed = g.replace([pad, stack], fused) or changed
    return changed


def _stride_one_window(g: Graph, pad: onnx.NodeProto, attrs: dict):
    """(kernel, dilations, spatial pads) if ``pad`` zero-pads only axes 2.. and the stack's slices,
    in order, are every tap of a stride-1 window over those axes (at axis 1), else None."""
    pads = g.ints(pad, 1, "pads")
    mode = node_attributes(pad).get("mode", "constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    value = g.constant(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else np.zeros(1)
    if pads is None or mode != "constant" or value is None or value.size != 1 or value.reshape(-1)[0] != 0 \
            or (len(pad.input) > 3 and pad.input[3]) or attrs["axis"] != 1 or min(pads) < 0:
        return None
    rank, full = attrs["rank"], len(pads) // 2
    if full != rank + 2 or pads[0] or pads[1] or pads[full] or pads[full + 1]:
        return None
    flat = attrs["regions"]
    taps = [flat[i: i + 4 * rank] for i in range(0, len(flat), 4 * rank)]
    starts = [[t[4 * j + 1] for j in range(rank)] for t in taps]
    if any([t[4 * j] for j in range(rank)] != list(range(2, 2 + rank)) or any(t[4 * j + 3] != 1 for j in range(rank)) for t in taps):
        return None
    kernel = [len({s[j] for s in starts}) for j in range(rank)]
    dilations = [(max(s[j] for s in starts) // (k - 1)) if k > 1 else 1 for j, k in enumerate(kernel)]
    expected = [[k * d for k, d in zip(offset, dilations)] for offset in np.ndindex(*kernel)]
    lengths = {tuple(t[4 * j + 2] - t[4 * j + 1] for j in range(rank)) for t in taps}
    if starts != expected or len(lengths) != 1:
        return None
    return kernel, dilations, [*pads[2:full], *pads[full + 2:]]


@fused_op("WindowColumns")
def _window_columns_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    kernel, dilations, pads = tuple(attrs["kernel"]), tuple(attrs["dilations"]), attrs["pads"]
    rank = len(kernel)
    pad, stack = kernel_of("Pad", opset), _stack_slices(attrs, opset)
    first = attrs["regions"][:4 * rank]
    out = tuple(first[4 * j + 2] - first[4 * j + 1] for j in range(rank))
    geo = WindowGeometry(kernel, (1,) * rank, dilations, tuple(pads[:rank]), tuple(pads[rank:]), out)

    def run(x, *pad_inputs):
        if x.ndim != rank + 2 or not keeps_rows(x, geo) or any(r > n + b + e for r, n, b, e in
                                                                 zip(geo.reach, x.shape[2:], geo.begin, geo.end)):
            return stack(pad(x, *pad_inputs)[0])  # the two nodes as written
        C, N = x.shape[:2]
        columns = np.empty((C, *kernel, N, math.prod(out)), dtype=x.dtype)
        windows = row_windows(x, geo)  # (C, N, *kernel, positions)
        np.copyto(columns, np.moveaxis(windows, 1, 1 + rank))
        zero_wrapped(np.moveaxis(columns.reshape(C, *kernel, N, *out), 1 + rank, 1), geo)
        return (columns.reshape(C, math.prod(kernel), N, *out),)

    return run
