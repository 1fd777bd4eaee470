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
from odt_ops.runtime.fusion.graph import DOMAIN, FUSIONS, STANDARD, Graph, bind, fuse, fused_op, fusion

# Each family registers its passes on import, and FUSIONS runs them in this order.
# isort: off
from odt_ops.runtime.fusion import loss  # noqa: F401
from odt_ops.runtime.fusion import reductions  # noqa: F401
from odt_ops.runtime.fusion import windows  # noqa: F401
from odt_ops.runtime.fusion import scatter  # noqa: F401
from odt_ops.runtime.fusion import activations  # noqa: F401
from odt_ops.runtime.fusion import sizes  # noqa: F401
from odt_ops.runtime.fusion import normalization  # noqa: F401
# isort: on

__all__ = ["DOMAIN", "FUSIONS", "STANDARD", "Graph", "bind", "fuse", "fused_op", "fusion"]
