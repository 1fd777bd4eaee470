"""The fusions' registry and the node list they rewrite: ``@fusion`` passes, ``@fused_op``
implementations, ``Graph`` with its producer/consumer lookups, and the helpers every family uses."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from odt_ops.domain import SPELLINGS
from odt_ops.errors import ArgumentError
from odt_ops.ir.attributes import node_attributes
from odt_ops.ir.graph import consumers, node_reads, producers
from odt_ops.kernels import lookup

DOMAIN = "odt_ops.fused"
STANDARD = SPELLINGS  # the default domain's two spellings, as the matchers' domains tuple

Pass = Callable[["Graph"], bool]
Factory = Callable[[dict, int], Callable[..., tuple]]  # (fused node attributes, ai.onnx opset) -> kernel

FUSIONS: dict[str, Pass] = {}
_OPS: dict[str, Factory] = {}
_ORDER: list[str] = []  # the order ``fuse`` runs the passes in (run_in_order), whatever FUSIONS' insertion order


def _registrar(table: dict, kind: str):
    """A decorator factory that files a function in ``table`` under a key given once."""
    def register_as(key: str):
        def register(fn):
            assert key not in table, f"{kind} {key} registered twice"
            table[key] = fn
            return fn
        return register
    return register_as


fusion: Callable[[str], Callable[[Pass], Pass]] = _registrar(FUSIONS, "fusion")  # a named pass
fused_op: Callable[[str], Callable[[Factory], Factory]] = _registrar(_OPS, "fused op")  # a fused node's implementation


def run_in_order(order: Sequence[str]) -> None:
    """Make ``order`` the order ``fuse`` runs the passes in: every registered pass, each once."""
    assert sorted(order) == sorted(FUSIONS), f"the fusion order {list(order)} must name each of {sorted(FUSIONS)} once"
    _ORDER[:] = order


def bind(node: onnx.NodeProto, opset: int) -> Callable[..., tuple]:
    """The implementation of a fused node; ``opset`` is the graph's ai.onnx opset."""
    return _OPS[node.op_type](node_attributes(node), opset)


def fuse(nodes: Sequence[onnx.NodeProto], constants: Mapping[str, np.ndarray], keep: Iterable[str],
         only: Iterable[str] | None = None, shapes: Callable[[], Mapping[str, tuple]] | None = None) -> list[onnx.NodeProto]:
    """The nodes with every fusion (or those named in ``only``) applied; ``keep`` must survive.
    ``shapes`` gives the values' shapes (None for an unknown dimension) when a pass first asks."""
    unknown = set(only or ()) - set(FUSIONS)
    if unknown:
        raise ArgumentError(f"fuse(only=...): unknown fusion(s) {sorted(unknown)}; the fusions are {list(FUSIONS)}")
    graph = Graph(nodes, constants, set(keep), shapes)
    # by the fixed order, not FUSIONS' own: a pass taken out and put back (a test's monkeypatch) keeps its place
    for name in _ORDER:
        run = FUSIONS.get(name)
        if run is not None and (only is None or name in only):
            run(graph)
    return graph.nodes


class Graph:
    """The node list a fusion rewrites, with producer/consumer lookups and its constants."""

    def __init__(self, nodes: Sequence[onnx.NodeProto], constants: Mapping[str, np.ndarray], keep: set[str],
                 shapes: Callable[[], Mapping[str, tuple]] | None = None):
        self.nodes = list(nodes)
        self.constants = constants
        self.keep = keep
        self._find_shapes = shapes
        self._shapes: Mapping[str, tuple] | None = None
        self._index()

    def shape(self, name: str) -> tuple | None:
        """The value's shape (None for an unknown dimension), or None when it is not known; the
        shapes are worked out on the first call."""
        if self._shapes is None:
            self._shapes = self._find_shapes() if self._find_shapes is not None else {}
        return self._shapes.get(name)

    def made_by(self, name: str) -> onnx.NodeProto | None:
        """The node producing ``name``, whatever its op."""
        return self._producer.get(name)

    def rewrite(self, nodes: Sequence[onnx.NodeProto]) -> None:
        """Replace the whole node list (a pass that rewrites many nodes at once; the plan sorts again)."""
        self.nodes = list(nodes)
        self._index()

    def _index(self) -> None:
        self._producer = producers(self.nodes)
        self._consumers = consumers(self.nodes)

    def producer(self, name: str, op_type: str, domains: tuple[str, ...] = STANDARD) -> onnx.NodeProto | None:
        node = self._producer.get(name)
        return node if node is not None and node.op_type == op_type and node.domain in domains else None

    def consumers(self, name: str) -> list[onnx.NodeProto]:
        return self._consumers.get(name, [])

    def sole_reader(self, name: str, op_type: str, position: int | None = None,
                    domains: tuple[str, ...] = STANDARD) -> onnx.NodeProto | None:
        """The one node reading ``name``, if it is an ``op_type`` (reading it at ``position``) and
        nothing else needs the value."""
        readers = self.consumers(name)
        if name in self.keep or len(readers) != 1:
            return None
        node = readers[0]
        if node.op_type != op_type or node.domain not in domains or list(node.input).count(name) != 1:
            return None
        return node if position is None or node.input[position] == name else None

    def constant(self, name: str) -> np.ndarray | None:
        return self.constants.get(name) if name else None

    def scalar(self, name: str):
        """The value of a one-element constant that broadcasts without adding axes (0-d or [1]), else None."""
        value = self.constant(name)
        return value.reshape(-1)[0] if value is not None and value.size == 1 and value.ndim <= 1 else None

    def is_zero(self, name: str) -> bool:
        """Whether ``name`` is a constant +0 that broadcasts without adding axes."""
        value = self.scalar(name)
        return value is not None and value == 0 and not np.signbit(value)

    def is_one(self, name: str) -> bool:
        """Whether ``name`` is a floating-point constant 1 that broadcasts without adding axes."""
        value = self.scalar(name)
        return value is not None and np.asarray(value).dtype.kind == "f" and value == 1

    def ints(self, node: onnx.NodeProto, position: int, attribute: str) -> list[int] | None:
        """A constant int list given as input ``position`` (newer opsets) or as an attribute."""
        if len(node.input) > position and node.input[position]:
            value = self.constant(node.input[position])
            return None if value is None or value.dtype.kind not in "iu" else [int(v) for v in value.reshape(-1)]
        value = node_attributes(node).get(attribute)
        return None if value is None else [int(v) for v in np.atleast_1d(value)]

    def replace(self, old: Sequence[onnx.NodeProto], new: onnx.NodeProto) -> bool:
        """Put ``new`` where the last of ``old`` was (the plan sorts again afterwards); False, and
        nothing changed, when an input of ``new`` is computed from an output of ``old`` (a cycle)
        or when ``new`` drops a value of ``old`` that another node or the caller needs."""
        produced = {name for n in old for name in n.output if name}
        spent = {id(n) for n in old}
        needed = [name for name in produced - set(new.output)
                  if name in self.keep or any(id(r) not in spent for r in self.consumers(name))]
        if needed or self._reaches(new.input, produced):
            return False
        at = max(i for i, n in enumerate(self.nodes) if id(n) in spent)
        self.nodes = [new if i == at else n for i, n in enumerate(self.nodes) if id(n) not in spent or i == at]
        self._reindex(old, new)
        return True

    def _reindex(self, old: Sequence[onnx.NodeProto], new: onnx.NodeProto) -> None:
        """The lookups after ``replace``, as ``_index`` would rebuild them (each reader list in node
        order), touching only the values ``old`` and ``new`` write or read: rebuilding all of them
        on every replace was half of EfficientNet's plan-binding time."""
        spent = {id(n) for n in old}
        for node in old:
            for name in node.output:
                if name and self._producer.get(name) is node:
                    del self._producer[name]
        touched: set[str] = set()
        for node in old:
            for name in dict.fromkeys(node_reads(node)):
                touched.add(name)
                self._consumers[name] = [r for r in self._consumers.get(name, []) if id(r) not in spent]
        self._producer.update((name, new) for name in new.output if name)
        position: dict[int, int] = {}
        for name in dict.fromkeys(node_reads(new)):
            touched.add(name)
            readers = self._consumers.setdefault(name, [])
            readers.append(new)
            if len(readers) > 1:
                position = position or {id(n): i for i, n in enumerate(self.nodes)}
                readers.sort(key=lambda r: position[id(r)])
        for name in touched:
            if not self._consumers.get(name, True):
                del self._consumers[name]

    def _reaches(self, names: Iterable[str], targets: set[str]) -> bool:
        """Whether any of ``names`` is, or is computed from, one of ``targets``."""
        seen: set[str] = set()
        stack = [n for n in names if n]
        while stack:
            name = stack.pop()
            if name in targets:
                return True
            if name in seen:
                continue
            seen.add(name)
            node = self._producer.get(name)
            if node is not None:
                stack.extend(n for n in node.input if n)
        return False


def fused_node(op_type: str, inputs: Sequence[str], outputs: Sequence[str], name: str, **attrs) -> onnx.NodeProto:
    return onnx.helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=DOMAIN,
                                 **{k: v for k, v in attrs.items() if v is not None})


def kernel_entry(op_type: str, opset: int):
    """The registry entry of the ai.onnx kernel a fused node runs at ``opset``."""
    entry = lookup("", op_type, opset)
    if entry is None:
        raise AssertionError(f"fused op needs a kernel for {op_type} at opset {opset}")
    return entry


def kernel_of(op_type: str, opset: int, **attrs) -> Callable[..., tuple]:
    """That kernel with ``attrs`` bound."""
    entry = kernel_entry(op_type, opset)
    return lambda *args, **engine: entry.fn(*args, **attrs, **engine)
