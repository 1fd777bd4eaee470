"""Fusions: node groups of the training graphs rewritten, when a plan is compiled, into
fewer nodes that compute the same values.

Each fusion is a named pass over the node list (registered with ``@fusion``) that says
whether it changed anything. A fused node is an ordinary NodeProto in the engine's own
domain, so plans, profiles and error messages treat it like any other node; its
implementation is registered with ``@fused_op`` and bound when the plan is compiled.
The artifacts never contain these nodes: ``Plan(..., fuse=False)`` runs the graphs as
written, and the tests hold both ways equal.

A pass only removes a value that nothing else reads and that the caller does not need
(graph outputs, checked values), and only rewrites what it can prove equal from the
node attributes and constants; anything else is left for the node-by-node path.
"""
from odt_ops.runtime.fusion import (  # noqa: F401  (registers)
    activations,
    channel_affine,
    layout,
    loss,
    normalization,
    product_sum,
    recurrent,
    reductions,
    scatter,
    sizes,
    windows,
)
from odt_ops.runtime.fusion.graph import DOMAIN, FUSIONS, STANDARD, Graph, bind, fuse, fused_op, fusion, run_in_order
from odt_ops.runtime.fusion.layout import value_shapes

# The order the passes run in, stated here rather than left to the order of the imports above:
# a pass matches the nodes the earlier passes left, so a reordering changes what fuses (the
# fused-versus-unfused tests in test_runtime_plan.py hold this order bit-equal to the graphs).
ORDER = (
    "softmax_cross_entropy_grad",
    "reduce_squeeze",
    "stacked_slices",
    "window_columns",
    "scatter_into_zeros",
    "relu_masked_scatter",
    "relu_in_place",
    "activation_grad",
    "divide_by_size",
    "normalization_grad",
    "lstm_cell",  # after activation_grad: an LSTM step's gradient is matched with its SigmoidGrad and TanhGrad nodes
    "gru_cell",  # likewise
    "channels_last",  # it reads the fused normalization gradients
    "product_sum",  # after channels_last, which rewrites the products and sums of its regions channels-last
    "channel_affine",  # likewise
)
run_in_order(ORDER)

__all__ = ["DOMAIN", "FUSIONS", "ORDER", "STANDARD", "Graph", "bind", "fuse", "fused_op", "fusion", "value_shapes"]
