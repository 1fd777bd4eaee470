"""Compiled execution plans.

Compiling resolves, once, everything a run would otherwise look up: topological
order, the engine's fusions (runtime/fusion/: node groups rewritten into fewer,
equal computations), the kernel of each node with its attributes bound, and the step
after which each intermediate can be freed. The run itself is generated as one
straight-line Python function, a local variable per value and a line per node, so
between two kernels there is no interpreter loop, no list indexing and no lookup.
"""
from __future__ import annotations

import functools
import itertools
import linecache
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import onnx

from odt_ops.domain import canonical
from odt_ops.errors import ArgumentError, InputError, KernelError, ModelCheckError, OdtError, UnsupportedOpError, describe_arrays, node_label
from odt_ops.ir.binding import bind_kernel, missing_kernels, node_inputs
from odt_ops.ir.graph import implicit_inputs, topological_order
from odt_ops.kernels.products import ProductRecord
from odt_ops.runtime import fusion, inplace
from odt_ops.runtime.memory import tune_allocator

Check = Callable[[np.ndarray], None]
_CODE_NAME = "<odt_ops plan>"
_PLANS = itertools.count(1)  # each plan's generated source gets its own file name


def bind_node(node: onnx.NodeProto, opset: int, rng: np.random.Generator | None = None,
              opsets: Mapping[str, int] | None = None) -> Callable[..., tuple]:
    """The node's kernel with attributes and engine keywords bound; the engine's fused nodes
    (runtime/fusion/) are bound by the fusion that made them."""
    if node.domain == fusion.DOMAIN:
        return fusion.bind(node, opset)
    return bind_kernel(node, opset, rng, opsets, compile_subgraph=Plan)  # control-flow bodies run as plans too


@dataclass(frozen=True)
class GeneratedRun:
    """The generated ``run(feeds, into)`` with what the plan needs beside it: its source (shown by
    tracebacks and pdb), where its step lines start and each step's argument names (to name the
    node a failing line runs), and its kernels by global name (to route them through a profiler)."""

    fn: Callable[..., list[np.ndarray]]
    source: str
    first_step_line: int
    kernels: dict[str, tuple[int, Callable]]
    step_inputs: list[list[str]]


@dataclass(frozen=True)
class Step:
    fn: Callable[..., tuple]
    inputs: tuple[str, ...]  # value names; "" is an omitted optional input
    outputs: tuple[str, ...]  # "" is an output nobody reads
    frees: tuple[str, ...]  # values dead after this step
    node: onnx.NodeProto


class Plan:
    """An executable form of one graph: ``run(feeds) -> outputs`` by position.

    ``fuse``: apply the engine's fusions (or those named, from fusion.FUSIONS); False runs the
    graph node by node, as written (the default is on unless the environment sets ODT_FUSE=0).
    ``destinations``: output names that ``run(feeds, into=[arrays])`` leaves in the given
    preallocated arrays, one per name in this order (a node that can write its result in
    place does, the rest are copied at the end), returning those arrays. They must not
    share memory with any feed or constant.
    ``checks``: {value name: callable}, called on the value as soon as it is computed; an
    exception it raises stops the run before any destination is written.
    """

    def __init__(
        self,
        graph: onnx.GraphProto,
        opsets: Mapping[str, int],
        constants: Mapping[str, np.ndarray],
        input_names: Sequence[str],
        output_names: Sequence[str],
        rng: np.random.Generator | None = None,
        *,
        fuse: bool | Iterable[str] | None = None,
        destinations: Sequence[str] = (),
        checks: Mapping[str, Check] | None = None,
        trace: bool | None = None,
        source: str | None = None,
    ):
        tune_allocator()
        self.input_names = list(input_names)
        self.source = source  # the model file, named in a failing kernel's error
        self.output_names = list(output_names)
        self.destinations = list(destinations)
        self._constants = dict(constants)
        self._checks = dict(checks or {})
        stray = set(self.destinations) - set(self.output_names)
        if stray:
            raise ArgumentError(f"Plan(destinations=...): {sorted(stray)} are not among the plan's outputs {self.output_names}")
        # the phases, each a method: order (and fuse) the nodes, bind each to its kernel, free each
        # value after its last reader, let nodes write destinations in place, generate the run
        nodes = self._ordered_nodes(graph, opsets, fuse)
        self.fusions = [n.op_type for n in nodes if n.domain == fusion.DOMAIN]
        bound = self._bound_steps(nodes, opsets, rng)
        self.steps = self._with_frees(bound)
        writers = self._in_place_writers()
        self.in_place = sorted(self.steps[i].outputs[0] for i in writers)
        self._run = self._compile(writers)
        if trace if trace is not None else os.environ.get("ODT_TRACE", "0") not in ("", "0"):
            self.instrument(_tracer)

    # ---- the phases -----------------------------------------------------------------------
    def _ordered_nodes(self, graph: onnx.GraphProto, opsets: Mapping[str, int], fuse) -> list[onnx.NodeProto]:
        """Every node, in an order that runs each after its producers, with the engine's fusions applied."""
        missing = missing_kernels(graph.node, opsets)
        if missing:
            raise UnsupportedOpError(missing)
        available = set(self._constants) | set(self.input_names)
        nodes = topological_order(graph.node, available)
        if fuse is None:
            fuse = os.environ.get("ODT_FUSE", "1") != "0"
        if fuse:
            keep = set(self.output_names) | set(self._checks) | {n for node in nodes for n in implicit_inputs(node)}
            only = None if fuse is True else set(fuse)
            shapes = functools.partial(fusion.value_shapes, graph, opsets)  # inferred only if a pass asks
            nodes = topological_order(fusion.fuse(nodes, self._constants, keep, only, shapes), available)
        return nodes

    def _bound_steps(self, nodes: list[onnx.NodeProto], opsets: Mapping[str, int], rng) -> list[tuple]:
        """(kernel with its attributes bound, input names, output names, node) per node; each matrix
        product gets its own record of the formulations it chooses (``formulations()`` shows them)."""
        known = set(self._constants) | set(self.input_names)
        self._products: dict[str, ProductRecord] = {}
        steps = []
        for node in nodes:
            ins = node_inputs(node)  # what its subgraphs read comes after its inputs
            for name in ins:
                if name and name not in known:
                    raise ModelCheckError(f"{node_label(node)} reads {name!r}, which nothing produces")
            known.update(n for n in node.output if n)
            # fused nodes run ai.onnx kernels at the graph's opset
            opset = opsets.get("" if node.domain == fusion.DOMAIN else canonical(node.domain), 0)
            fn = bind_node(node, opset, rng, opsets)
            if _multiplies(node):
                fn = functools.partial(fn, _products=self._products.setdefault(node.name or node.output[0], ProductRecord()))
            steps.append((fn, tuple(ins), tuple(node.output), node))
        for name in [*self.output_names, *self._checks]:
            if name not in known:
                raise ModelCheckError(f"graph output {name!r} is produced by no node, input or initializer")
        return steps

    def _with_frees(self, steps: list[tuple]) -> list[Step]:
        """Each intermediate freed right after its last reader; constants, feeds and outputs stay."""
        stay = set(self.output_names) | set(self._constants) | set(self.input_names)
        last_use: dict[str, int] = {}
        for i, (_, ins, outs, _) in enumerate(steps):
            for name in (*ins, *outs):
                if name:
                    last_use[name] = i
        frees_at: list[list[str]] = [[] for _ in steps]
        for name, i in last_use.items():
            if name not in stay:
                frees_at[i].append(name)
        return [Step(fn, ins, outs, tuple(frees_at[i]), node) for i, (fn, ins, outs, node) in enumerate(steps)]

    def _in_place_writers(self) -> dict[int, Callable]:
        """Steps that can compute a destination straight into its array: only after every check
        has passed, so a failed check leaves every destination as it was."""
        after_checks = max((i for i, s in enumerate(self.steps) for o in s.outputs if o in self._checks), default=-1)
        writers = {}
        for i, s in enumerate(self.steps):
            for name in s.outputs:
                if name in self.destinations and i > after_checks and len(s.outputs) == 1:
                    writer = inplace.writer(s.node, s.fn)
                    if writer is not None:
                        writers[i] = writer
        return writers

    def run(self, feeds: Sequence[np.ndarray], *, into: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        run = self._run.fn
        if len(feeds) != len(self.input_names):
            raise InputError(f"the plan takes {len(self.input_names)} feeds ({self.input_names}), got {len(feeds)}")
        if into is not None and len(into) != len(self.destinations):
            raise InputError(f"the plan writes {len(self.destinations)} destinations ({self.destinations}), got {len(into)} arrays")
        try:
            return run(feeds, into)
        except OdtError:
            raise
        except Exception as exc:  # a kernel met values it cannot handle: name the node
            failed = _failed_step(exc, self._run)
            if failed is None:
                raise
            index, frame = failed
            step = self.steps[index]
            values = [frame.f_locals.get(v, frame.f_globals.get(v)) for v in self._run.step_inputs[index]]
            raise KernelError(
                (f"{self.source}: " if self.source and not self.source.startswith("<") else "") + f"{node_label(step.node)} failed on inputs ({describe_arrays(values)}): {type(exc).__name__}: {exc}"
            ) from exc

    def formulations(self) -> dict[str, list[str]]:
        """Per matrix-product node, the formulation chosen for each operand shape it has met
        (kernels/products.py): fixed once chosen, so two runs of this plan are bit-identical."""
        return {node: record.describe() for node, record in self._products.items() if record.chosen}

    def instrument(self, wrap: Callable[[Step, Callable], Callable] | None) -> None:
        """Route every step's kernel through ``wrap(step, fn)`` (a profiler's timer); None undoes it."""
        for key, (i, fn) in self._run.kernels.items():
            self._run.fn.__globals__[key] = fn if wrap is None else wrap(self.steps[i], fn)

    def _compile(self, writers: Mapping[int, Callable]) -> GeneratedRun:
        """The run as one generated function ``run(feeds, into)``: a line per step, so a traceback's
        line names the step; ``into`` (None or the destination arrays) picks the writers and the
        destination copies."""
        space: dict[str, object] = {"__builtins__": {}, "_copyto": np.copyto}
        local: dict[str, str] = {}  # value name -> the variable holding it now
        fed = set(self.input_names)
        counter = iter(range(sys.maxsize))

        def ref(name: str) -> str:
            if not name:
                return "None"
            if name not in local:  # a constant: a global of the generated function
                assert name in self._constants and name not in fed, f"{name!r} read before it is computed"
                local[name] = f"c{next(counter)}"
                space[local[name]] = self._constants[name]
            return local[name]

        def bind(name: str) -> str:
            local[name] = f"v{next(counter)}"
            return local[name]

        def checks(names: Iterable[str]) -> str:
            calls = ""
            for name in names:
                if name in self._checks:
                    key = f"chk{next(counter)}"
                    space[key] = self._checks[name]
                    calls += f"; {key}({ref(name)})"
            return calls

        targets = [bind(n) for n in self.input_names]
        head = f"    {', '.join(targets)}, = feeds" if targets else "    pass"
        head += checks(n for n in dict.fromkeys([*self.input_names, *self._constants]))
        lines = ["def run(feeds, into):", head]
        first_step_line = len(lines) + 1  # line numbers count from 1
        kernels: dict[str, tuple[int, Callable]] = {}
        step_inputs: list[list[str]] = []
        for i, step in enumerate(self.steps):
            kernels[f"k{i}"] = (i, step.fn)
            fn = f"k{i}"
            args = [ref(n) for n in step.inputs]
            step_inputs.append(args)
            call = f"{fn}({', '.join(args)})"
            if i in writers:
                kernels[f"w{i}"] = (i, writers[i])
                out = f"into[{self.destinations.index(step.outputs[0])}]"
                call = f"(k{i}({', '.join(args)}) if into is None else w{i}({', '.join(args)}, out={out}))"
            named = [(j, n) for j, n in enumerate(step.outputs) if n]
            if len(step.outputs) == 1 and named:
                code = f"{bind(named[0][1])} = {call}[0]"
            else:  # kernels may return more outputs than the node names
                code = f"_r = {call}" + "".join(f"; {bind(n)} = _r[{j}]" for j, n in named) + "; _r = None"
            code += checks(n for _, n in named)
            code += "".join(f"; {local.pop(n)} = None" for n in step.frees if n in local)
            lines.append("    " + code + f"  # {_comment(step)}")
        results, copies = [], []
        for name in self.output_names:
            if name in self.destinations:
                key = f"into[{self.destinations.index(name)}]"
                if name not in self.in_place:
                    copies.append(f"_copyto({key}, {ref(name)})")
                results.append(f"({ref(name)} if into is None else {key})")
            else:
                results.append(ref(name))
        if copies:
            lines.append(f"    if into is not None: {'; '.join(copies)}")
        lines.append(f"    return [{', '.join(results)}]")
        space.update({key: fn for key, (_, fn) in kernels.items()})
        source = "\n".join(lines) + "\n"
        filename = f"{_CODE_NAME[:-1]} {next(_PLANS)}>"
        # registered, so tracebacks, pdb and inspect show the generated source with its node comments
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        exec(compile(source, filename, "exec"), space)
        run = cast(Callable[..., list[np.ndarray]], space["run"])  # the `def run` just executed
        return GeneratedRun(run, source, first_step_line, kernels, step_inputs)


# the nodes whose kernels multiply matrices through a ProductRecord: Gemm and MatMul, alone or
# with the ReLU fused over their product (runtime/fusion/activations.py)
_PRODUCTS = {"": ("Gemm", "MatMul"), fusion.DOMAIN: ("GemmRelu", "MatMulRelu")}


def _multiplies(node: onnx.NodeProto) -> bool:
    return node.op_type in _PRODUCTS.get(canonical(node.domain), ())


def _comment(step: Step) -> str:
    ins = ", ".join(n or "-" for n in step.inputs)
    outs = ", ".join(n or "-" for n in step.outputs)
    return f"{node_label(step.node)}: ({ins}) -> ({outs})".replace("\n", " ")


def _tracer(step: Step, fn: Callable) -> Callable:
    """A kernel that prints, after it runs, its node and each output's dtype, shape and range
    (what onnx.reference's verbose mode shows), and a matrix product's formulations, on stderr."""
    record = fn.keywords.get("_products") if isinstance(fn, functools.partial) else None

    def traced(*args, **kwargs):
        outputs = fn(*args, **kwargs)
        for name, value in zip(step.outputs, outputs):
            if name:
                print(f"{node_label(step.node)} -> {name}: {_describe(value)}", file=sys.stderr)
        if record is not None:  # which formulation of the product ran (kernels/products.py)
            print(f"{node_label(step.node)} product: {'; '.join(record.describe())}", file=sys.stderr)
        return outputs

    return traced


def _describe(value) -> str:
    array = np.asarray(value)
    if array.dtype.kind in "fiub" and array.size:
        finite = array[np.isfinite(array)] if array.dtype.kind == "f" else array
        span = f" range [{finite.min():.6g}, {finite.max():.6g}]" if finite.size else " no finite value"
        return f"{array.dtype}{list(array.shape)}{span}"
    return f"{array.dtype}{list(array.shape)}"


def _failed_step(exc: BaseException, run: GeneratedRun):
    """(step index, frame) of the generated run's line that was executing when ``exc`` was raised."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is run.fn.__code__:
            index = tb.tb_lineno - run.first_step_line
            return (index, tb.tb_frame) if 0 <= index < len(run.step_inputs) else None
        tb = tb.tb_next
    return None
