"""The sliding window the convolution and pooling gradients share: its geometry resolved by the
forward kernels' own helpers (kernels/geometry.py), the pads it really reads, and the input
gradient of a window sum as a ConvTranspose (used by Conv and by the average and Lp pools)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from odt_ops.kernels.geometry import window_geometry

INT64_MIN = np.iinfo(np.int64).min


@dataclass(frozen=True)
class Window:
    """A convolution window over a zero-padded input, per spatial axis."""

    kernel: tuple[int, ...]
    strides: tuple[int, ...]
    dilations: tuple[int, ...]
    begin: tuple[int, ...]  # padding before the input (negative: the input starts cropped)
    end: tuple[int, ...]  # padding the last window reads past the input (negative: unread tail)

    @property
    def rank(self) -> int:
        return len(self.kernel)

    @property
    def pads(self) -> list[int]:
        """Conv/ConvTranspose pads: the non-negative parts of begin and end."""
        return [max(p, 0) for p in (*self.begin, *self.end)]

    def attrs(self) -> dict:
        return {"strides": list(self.strides), "dilations": list(self.dilations), "pads": self.pads}


def spatial_sizes(ctx, name: str) -> tuple[int, ...]:
    """The spatial dims of ``name`` (all after N, C), which the rules need statically."""
    shape = ctx.shape(name)
    if shape is None or len(shape) < 3 or not all(isinstance(d, int) for d in shape[2:]):
        raise ctx.fail(f"the spatial dims of {name!r} must be static, got shape {shape}")
    return tuple(shape[2:])


def channels(ctx, name: str) -> int:
    dim = (ctx.shape(name) or (None, None))[1]
    if not isinstance(dim, int):
        raise ctx.fail(f"the channel dim of {name!r} must be static, got shape {ctx.shape(name)}")
    return dim


def forward_geometry(ctx, spatial: tuple[int, ...], kernel: tuple[int, ...]):
    """The forward kernels' geometry of a Conv or pool over an input of ``spatial`` size."""
    a = ctx.attrs
    try:
        return window_geometry(spatial, kernel, strides=a.get("strides"), dilations=a.get("dilations"), pads=a.get("pads"),
                         auto_pad=a.get("auto_pad", "NOTSET"), ceil_mode=a.get("ceil_mode", 0))
    except ValueError as exc:
        raise ctx.fail(str(exc)) from None


def forward_window(geo, spatial: tuple[int, ...]) -> Window:
    end = tuple(r - n - b for r, n, b in zip(geo.reach, spatial, geo.begin))
    return Window(geo.kernel, geo.strides, geo.dilations, geo.begin, end)


def axes_after_channels(rank: int) -> list[int]:
    return list(range(2, rank + 2))


def crop(ctx, x: str, window: Window, spatial: tuple[int, ...]) -> str:
    """``x`` without the parts a negative pad says no window reads."""
    lo = [max(-b, 0) for b in window.begin]
    hi = [n - max(-e, 0) for n, e in zip(spatial, window.end)]
    if not any(lo) and hi == list(spatial):
        return x
    return ctx.b.Slice(x, ctx.ints(lo), ctx.ints(hi), ctx.ints(axes_after_channels(window.rank)))


def input_grad(ctx, dY: str, W: str, window: Window, group: int) -> str:
    """The adjoint of Conv(X, W) with respect to X: ConvTranspose of dY by W, padded back to X's
    size. At stride 1 (plain or depthwise, kernel larger than 1x1) it is a Conv of dY by the
    flipped kernel, which the engine runs faster than a ConvTranspose."""
    assert min(window.begin, default=0) >= 0, "a Conv window never starts before its input"
    mirrored = mirrored_pads(window)
    shape = ctx.shape(W)
    depthwise = group > 1 and shape is not None and shape[:2] == (group, 1)
    plain = group == 1 and math.prod(window.kernel) > 1  # a 1x1 kernel's ConvTranspose is a bare GEMM already
    if mirrored is not None and (depthwise or plain):
        # stride 1: the adjoint as a forward Conv by the flipped kernel (channels swapped unless
        # depthwise), whose im2col + GEMM the engine runs 1.2-2.5x faster than ConvTranspose's col2im
        rank = window.rank
        flipped = ctx.b.Slice(W, ctx.ints([-1] * rank), ctx.ints([INT64_MIN] * rank), ctx.ints(axes_after_channels(rank)),
                              ctx.ints([-1] * rank))
        if plain:
            flipped = ctx.b.Transpose(flipped, perm=[1, 0, *axes_after_channels(rank)])
        return ctx.b.Conv(dY, flipped, group=group, pads=mirrored, dilations=list(window.dilations))
    adjust = [max(-e, 0) for e in window.end]
    return ctx.b.ConvTranspose(dY, W, group=group, output_padding=adjust if any(adjust) else None, **window.attrs())


def mirrored_pads(window: Window) -> list[int] | None:
    """With stride 1, sliding the flipped window over dY padded by these pads visits, for every
    input position, exactly the outputs whose windows read it: the adjoint as a forward window.
    None for strides > 1 (the adjoint then needs zeros between dY's elements) or when the
    forward pads exceed the window."""
    if any(s != 1 for s in window.strides):
        return None
    extents = [(k - 1) * d + 1 for k, d in zip(window.kernel, window.dilations)]
    pads = [x - 1 - p for x, p in zip(extents * 2, (*window.begin, *window.end))]
    return pads if min(pads, default=0) >= 0 else None
