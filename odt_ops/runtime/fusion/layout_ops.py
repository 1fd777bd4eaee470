"""The channels-last graph's kernels (layout.py decides where they run): the two conversions,
the ``ChannelsLast`` node that runs an op on (N, H, W, C) arrays, and the 1x1 weight gradient."""
from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import onnx

from odt_ops.kernels.channels import batch_norm_grad_rows, batch_norm_inference_rows, batch_norm_rows, unbuffered_runs
from odt_ops.kernels.conv import TAP_RUN, conv_channels_last, conv_transpose_channels_last, pointwise_channels_last
from odt_ops.runtime.fusion.graph import DOMAIN, bind, fused_op, kernel_entry
from odt_ops.runtime.fusion.normalization import normalization_training_grad

TO_LAST, TO_FIRST, CHANNELS_LAST = "ToChannelsLast", "ToChannelsFirst", "ChannelsLast"
TO_LAST_PERM, TO_FIRST_PERM = (0, 2, 3, 1), (0, 3, 1, 2)
_TO_LAST_AXIS = (0, 3, 1, 2)  # where axis a of the channels-first value lies in the channels-last one
FUSED_ELEMENTWISE = frozenset({"SigmoidGrad", "TanhGrad"})  # fusion/activations.py's, in the engine's domain


@fused_op(TO_LAST)
def _to_last(attrs: dict, opset: int) -> Callable[..., tuple]:
    return lambda x: (np.ascontiguousarray(x.transpose(TO_LAST_PERM)),)


@fused_op(TO_FIRST)
def _to_first(attrs: dict, opset: int) -> Callable[..., tuple]:
    return lambda x: (np.ascontiguousarray(x.transpose(TO_FIRST_PERM)),)


def _per_channel_rows(fn: Callable[..., tuple], images: int) -> Callable[..., tuple]:
    """``fn`` of a per-channel op on its first ``images`` inputs as (N*H*W, C) rows: the
    op's (N, C, rest) layout with rest = 1, so the same per-channel statistics."""
    def run(*args):
        shape = args[0].shape
        rows = [a.reshape(-1, shape[-1]) for a in args[:images]]
        out = fn(*rows, *args[images:])
        return (out[0].reshape(shape), *out[1:])
    return run


def _global_average_pool(x: np.ndarray) -> tuple:
    """(N, H, W, C) -> the (N, C, 1, 1) mean, summed down the rows of each image."""
    n, c = x.shape[0], x.shape[-1]
    rows = x.reshape(n, -1, c)
    if x.dtype not in (np.float32, np.float64):
        return (rows.mean(axis=1).reshape(n, c, 1, 1),)
    total = np.add.reduce(rows, axis=1)
    total *= x.dtype.type(1 / rows.shape[1])
    return (total.reshape(n, c, 1, 1),)


def _own_kernels(op: str, attrs: dict, opset: int, outputs: int) -> Callable[..., tuple] | None:
    if op == "Conv":
        return _pointwise_or(op, attrs, functools.partial(conv_channels_last, **attrs))
    if op == "ConvTranspose":
        return _pointwise_or(op, attrs, functools.partial(conv_transpose_channels_last, **attrs))
    if op == "ReduceSum":
        reduce_sum = kernel_entry("ReduceSum", opset).fn
        return lambda x, axes: reduce_sum(x, np.asarray([_TO_LAST_AXIS[a % 4] for a in np.atleast_1d(axes)], dtype=np.int64), keepdims=1)
    if op == "GlobalAveragePool":
        return _global_average_pool
    if op == "Shape":
        return lambda x: (np.array([x.shape[i] for i in TO_FIRST_PERM], dtype=np.int64),)
    if op == "Transpose":
        perm = [TO_FIRST_PERM[p] for p in attrs["perm"]]  # axis p of the channels-first value
        return lambda x: (np.transpose(x, perm),)
    if op == "Expand":
        expand = kernel_entry("Expand", opset).fn
        return lambda x, shape: expand(x, np.asarray(shape)[list(TO_LAST_PERM)])
    if op == "NormalizationTrainingGrad":
        general = normalization_training_grad([0], "ac,ac->c", [0], opset)
        return _per_channel_rows(lambda x, dy, *rest: (batch_norm_grad_rows if _fast(x, dy) else general)(x, dy, *rest), 2)
    if op == "BatchNormalization" and opset >= 14:
        entry = kernel_entry(op, opset)
        general = functools.partial(entry.fn, **attrs, _num_outputs=outputs)
        eps, momentum, training = attrs.get("epsilon", 1e-5), attrs.get("momentum", 0.9), attrs.get("training_mode", 0)

        def batch_norm(x, *params):
            if not _fast(x, *params):
                return general(x, *params)
            if training:
                return batch_norm_rows(x, *params, eps, momentum)
            return (batch_norm_inference_rows(x, *params, eps),)
        return _per_channel_rows(batch_norm, 1)
    return None


def _pointwise_or(op: str, attrs: dict, general: Callable[..., tuple]) -> Callable[..., tuple]:
    """A Conv or ConvTranspose whose attributes pin it to one group, stride 1 and no padding: with
    1x1 float weights, the channels-last kernels' own matrix product (``pointwise_channels_last``)
    and bias, called straight (the same operations, so the same bits) without resolving the window geometry on every call, which
    cost 15-20 us of a 1x1 layer's 40-110 at batch 8 (AMD EPYC Zen 4, one thread); MobileNetV3 runs
    34 such nodes a step. Anything else: ``general``."""
    zero = ("pads", "output_padding")
    if (attrs.get("group", 1) != 1 or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or "output_shape" in attrs
            or any(any(attrs.get(a) or [0]) for a in zero) or any(s != 1 for s in attrs.get("strides") or [1])
            or any(k != 1 for k in attrs.get("kernel_shape") or [1])):
        return general
    transposed = op == "ConvTranspose"

    def run(x, w, b=None):
        c = x.shape[-1]
        if (w.ndim != 4 or w.shape[2:] != (1, 1) or w.shape[0 if transposed else 1] != c or not _fast(x, w, *([] if b is None else [b]))
                or x.ndim != 4):
            return general(x, w) if b is None else general(x, w, b)
        y = pointwise_channels_last(x, w, transposed)
        if b is not None:
            np.add(y, b, out=y)
        return (y,)
    return run


def _fast(*arrays: np.ndarray) -> bool:
    """Whether the (rows, C) kernels apply: float32 or float64 throughout (others widen as the ONNX kernels do)."""
    return all(a.dtype == arrays[0].dtype for a in arrays) and arrays[0].dtype in (np.float32, np.float64)


@fused_op(CHANNELS_LAST)
def _channels_last_op(attrs: dict, opset: int) -> Callable[..., tuple]:
    op, outputs = attrs.pop("layout_op"), attrs.pop("layout_outputs")
    own = _own_kernels(op, attrs, opset, outputs)
    if own is not None:
        return own
    if op in FUSED_ELEMENTWISE:
        return bind(onnx.helper.make_node(op, [], [], domain=DOMAIN), opset)
    entry = kernel_entry(op, opset)
    if "_num_outputs" in entry.engine_keywords:
        attrs["_num_outputs"] = outputs
    fn = functools.partial(entry.fn, **attrs)
    return _per_channel_rows(fn, 1) if op == "BatchNormalization" else fn


@fused_op("PointwiseWeightGrad")
def _pointwise_weight_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    def run(x, dy):
        rows, columns = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        return (np.matmul(rows.T, columns)[None],)  # (1, C, M): the rule's group axis of one
    return run


@fused_op("DepthwiseWeightGrad")
def _depthwise_weight_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    """(C, taps, 1): per tap, the sum over the batch and the output positions of dY times the tap's
    view of the zero-padded X, both (N, H, W, C). ``regions``: per tap and spatial axis (axis of the
    (C, N, H, W) value, start, end, step) on the padded input; ``pads``: (begin H, W, end H, W)."""
    flat, (top, left, bottom, right) = attrs["regions"], attrs["pads"]
    regions = [[tuple(flat[i + 4 * j: i + 4 * j + 4]) for j in range(2)] for i in range(0, len(flat), 8)]

    def run(x, dy):
        n, h, w, c = x.shape
        padded = np.zeros((n, h + top + bottom, w + left + right, c), dtype=x.dtype)
        padded[:, top:top + h, left:left + w] = x
        sums = np.ones(dy.size // c, dtype=dy.dtype)
        product = np.empty(dy.shape, dtype=np.result_type(x, dy))
        out = np.empty((c, len(regions), 1), dtype=product.dtype)
        with unbuffered_runs(TAP_RUN):
            for t, region in enumerate(regions):
                index = [slice(None)] * 4
                for axis, start, end, step in region:
                    index[axis - 1] = slice(start, end, step)  # (C, N, H, W) axis 2, 3 -> (N, H, W, C) axis 1, 2
                tap = padded[tuple(index)]
                if tap.shape != dy.shape:
                    raise ValueError(f"a window tap {tap.shape} does not match the output gradient {dy.shape}")
                np.multiply(tap, dy, out=product)
                out[:, t, 0] = sums @ product.reshape(-1, c)
        return (out,)

    return run


# ``StrideOneWeightGrad`` takes its tap products over blocks of pixels whose planes and output gradient
# fill about this much (a core's L2 is 1 MiB on Zen 4): every tap then reads the block from cache.
# Measured on UNet's layers, batch 32, one thread: 0.75-0.8x the time of whole-batch products.
_BLOCK_BYTES = 1 << 18
# unless that block has fewer pixels than this many per channel of the wider side: a wide layer's
# block product is then too thin, its (C, M) result per block and tap costing more than the cache
# saves; it takes the whole batch in one product per tap (ResNet-50's 512-channel 7x7 layer at batch 4:
# 64-pixel blocks 1.26x the whole batch's time; UNet's 64-to-16-channel layer at batch 32: blocks of
# 819 pixels 0.83x the time of 1024-pixel ones)
_BLOCK_PER_CHANNEL = 4


@fused_op("StrideOneWeightGrad")
def _stride_one_weight_grad(attrs: dict, opset: int) -> Callable[..., tuple]:
    """A one-group stride-1 2-D convolution's weight gradient, (1, C * taps, M), from channels-first
    X (N, C, H, W) and dY (N, M, Ho, Wo), with no window columns: X zero-padded and flattened per
    channel over the whole batch to (C, pixels) planes, dY laid on the same padded grid as (pixels, M)
    rows (zeros where no output is), and per kernel tap one product planes[:, offset:] @ dY, the tap's
    flat offset into the planes, taken over cache-sized blocks of pixels and summed. A product's
    reads past an image's valid outputs meet dY's zeros; a guard of zero columns ends the planes.
    Channel-major planes, not pixel-major ones: they are copied
    in runs of W from X (a channels-last copy moved one value at a time: 2.4 of the 11 ms of UNet's
    32-channel 32x32 layer at batch 32), and BLAS ran the tap products 1.2-1.5x faster this way round
    (AMD EPYC Zen 4, one thread). ``kernel``, ``dilations``; ``pads``: (begin H, W, end H, W).

    At two threads it runs no faster: BLAS does not split a product whose (C, M) result is this
    small. Sharing the blocks out among two Python threads (BLAS at one thread meanwhile, the blocks'
    terms added in block order) made the node alone 1.23x faster (5.37 -> 4.35 ms, UNet's 32-to-16
    layer at batch 32) but UNet's whole step 1.02-1.03x slower (both alternating in one process,
    2 cores, quiet). That session read it as OpenBLAS's workers spinning on the second core; a later
    one found the elementwise pool losing as much with BLAS at one thread, so the cost is handing
    work between Python threads inside a step (kernels/parallel.py has those figures). So it stays
    on one thread."""
    (kh, kw), (dh, dw), (top, left, bottom, right) = attrs["kernel"], attrs["dilations"], attrs["pads"]

    def run(x, dy):
        n, c, h, w = x.shape
        m, ho, wo = dy.shape[1:]
        hp, wp = h + top + bottom, w + left + right
        if (ho, wo) != (hp - (kh - 1) * dh, wp - (kw - 1) * dw) or dy.shape[0] != n:
            raise ValueError(f"an output gradient {dy.shape} does not match the {kh}x{kw} window over {x.shape} padded by {attrs['pads']}")
        dtype = np.result_type(x, dy)
        pixels, guard = n * hp * wp, (kh - 1) * dh * wp + (kw - 1) * dw
        planes = np.zeros((c, pixels + guard), dtype=dtype)
        planes[:, :pixels].reshape(c, n, hp, wp)[:, :, top:top + h, left:left + w] = x.transpose(1, 0, 2, 3)
        grads = np.zeros((n, hp, wp, m), dtype=dtype)
        grads[:, :ho, :wo] = dy.transpose(0, 2, 3, 1)
        grads = grads.reshape(pixels, m)
        offsets = [i * dh * wp + j * dw for i, j in np.ndindex(kh, kw)]
        out = np.zeros((c, kh * kw, m), dtype=dtype)  # row c * taps + t, as the rule's columns
        term = np.empty((c, m), dtype=dtype)
        step = _BLOCK_BYTES // ((c + m) * planes.itemsize)
        if step < _BLOCK_PER_CHANNEL * max(c, m):
            step = pixels  # wide layers: one block
        for start in range(0, pixels, step):  # a block of pixels' planes and dY, reused by every tap from cache
            stop = min(pixels, start + step)
            block = grads[start:stop]
            for t, offset in enumerate(offsets):
                np.matmul(planes[:, offset + start:offset + stop], block, out=term)
                out[:, t] += term
        return (out.reshape(1, c * kh * kw, m),)

    return run
