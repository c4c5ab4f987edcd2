"""The graph IR every stage of graphopt works on.

A :class:`Graph` is a topologically ordered list of :class:`Node` objects connected by tensor names (as in
ONNX), plus weights as numpy arrays and shape/dtype information for every tensor.  It keeps everything
needed to write the model back to ONNX unchanged: nodes the optimizer does not understand are kept with
their full ONNX definition (op type, domain, attributes with their types), never dropped.

Why names rather than object links: rewrites replace whole subgraphs, and name-based wiring makes a
rewrite a local edit (swap some nodes, rename some inputs) that is cheap to copy, hash and export.
"""
from __future__ import annotations

import copy
import hashlib
import heapq
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

import numpy as np

from graphopt.memo import IdentityCache

if TYPE_CHECKING:
    import networkx as nx

Dim = int | str  # str for a symbolic dimension that shape inference could not resolve


@dataclass
class TensorInfo:
    """Static type of a tensor: element type name (numpy style, e.g. ``float32``) and shape."""

    name: str
    dtype: str
    shape: tuple[Dim, ...] | None  # None when the rank itself is unknown

    @property
    def is_static(self) -> bool:
        return self.shape is not None and all(isinstance(d, int) for d in self.shape)


@dataclass
class Node:
    """One operator application.

    ``attrs`` holds plain Python values (ints, floats, lists, numpy arrays for tensor attributes, ONNX
    GraphProto for control-flow bodies); ``attr_types`` remembers the ONNX attribute type of imported
    attributes so an opaque node exports bit-for-bit the way it came in.  Empty input names mean an omitted
    optional input, as in ONNX.
    """

    op_type: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    domain: str = ""
    attr_types: dict[str, int] = field(default_factory=dict)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attrs.get(key, default)


@dataclass
class Graph:
    """A whole model: inputs, outputs, weights, nodes in topological order, and tensor types."""

    nodes: list[Node]
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    initializers: dict[str, np.ndarray] = field(default_factory=dict)
    value_info: dict[str, TensorInfo] = field(default_factory=dict)
    name: str = "graph"
    opset_imports: dict[str, int] = field(default_factory=lambda: {"": 17})
    ir_version: int = 8
    functions: list[Any] = field(default_factory=list)  # onnx.FunctionProto, kept verbatim for export
    producer_name: str = "optimize-model"
    # convolutions (by their weight initializer) the compiler computes with its Winograd F(m x m, 3 x 3)
    # kernel, m the value: graphopt.winograd.mark; exported as the model's metadata (WINOGRAD_METADATA), so
    # the ONNX file still computes the same function and any runtime ignores it
    winograd: dict[str, int] = field(default_factory=dict)

    # ---- queries -------------------------------------------------------------------------------------
    def tensor(self, name: str) -> TensorInfo | None:
        """Type of any tensor (graph input, weight, intermediate or output)."""
        if name in self.value_info:
            return self.value_info[name]
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        if name in self.initializers:
            arr = self.initializers[name]
            return TensorInfo(name, str(arr.dtype), tuple(arr.shape))
        return None

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        info = self.tensor(name)
        return None if info is None else info.shape

    def producers(self) -> dict[str, tuple[Node, int]]:
        """Map tensor name -> (producing node, output index)."""
        return {out: (n, i) for n in self.nodes for i, out in enumerate(n.outputs) if out}

    def consumers(self) -> dict[str, list[Node]]:
        """Map tensor name -> nodes that read it (a node appears once per tensor even if it reads it twice)."""
        result: dict[str, list[Node]] = {}
        for n in self.nodes:
            for t in dict.fromkeys(n.inputs):
                if t:
                    result.setdefault(t, []).append(n)
        return result

    @property
    def onnx_opset(self) -> int:
        """The opset of the default ONNX domain ("" or "ai.onnx"; 1 when the graph imports neither)."""
        return int(self.opset_imports.get("", self.opset_imports.get("ai.onnx", 1)))

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def is_constant(self, name: str) -> bool:
        """True for weights: initializers that the caller cannot override as graph inputs."""
        return name in self.initializers and name not in self.input_names

    def freeze_weights(self) -> list[str]:
        """Make the initializers that are also listed as graph inputs plain weights (in place); their names.

        ONNX before IR version 4 required every initializer to be a graph input (the opset-9 model zoo's
        convention; https://github.com/onnx/onnx/blob/main/docs/IR.md#graphs): that lists every weight as an
        input a caller *could* override, which none does.  Kept as inputs they are not constants: a Reshape's
        shape is unknown, nothing folds, and a timing run feeds them zeros.  The graph stage calls this unless
        the user asks to keep them overridable.  The IR version is raised to 4 when needed, so the exported
        model (initializers no longer inputs) is valid."""
        frozen = [t.name for t in self.inputs if t.name in self.initializers]
        if frozen:
            self.inputs = [t for t in self.inputs if t.name not in self.initializers]
            self.ir_version = max(self.ir_version, 4)
        return frozen

    # ---- structure -----------------------------------------------------------------------------------
    def topo_sort(self) -> None:
        """Reorder ``nodes`` topologically (stable: keeps the current order where it is already valid).

        Raises ValueError on a cycle, which a correct rewrite never creates.
        """
        produced = self.producers()
        index = {id(n): i for i, n in enumerate(self.nodes)}
        deps: dict[int, set[int]] = {}
        users: dict[int, list[int]] = {i: [] for i in range(len(self.nodes))}
        for i, n in enumerate(self.nodes):
            d = {index[id(produced[t][0])] for t in n.inputs if t in produced}
            deps[i] = d
            for j in d:
                users[j].append(i)
        ready = [i for i, d in deps.items() if not d]
        heapq.heapify(ready)
        order: list[int] = []
        remaining = {i: len(d) for i, d in deps.items()}
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                remaining[u] -= 1
                if remaining[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(self.nodes):
            raise ValueError("graph has a cycle")
        self.nodes = [self.nodes[i] for i in order]

    def to_networkx(self) -> "nx.MultiDiGraph":
        """Node-level dataflow graph: vertices are node indices, edges carry the tensor name."""
        import networkx as nx  # here, not at module level: it costs every command ~0.2 s at start-up

        g = nx.MultiDiGraph()
        produced = self.producers()
        index = {id(n): i for i, n in enumerate(self.nodes)}
        for i, n in enumerate(self.nodes):
            g.add_node(i, op_type=n.op_type, name=n.name)
        for i, n in enumerate(self.nodes):
            for t in n.inputs:
                if t in produced:
                    g.add_edge(index[id(produced[t][0])], i, tensor=t)
        return g

    def remove_unused(self) -> int:
        """Drop nodes, weights and tensor types that no graph output depends on (one linear pass).

        Returns the number of nodes removed.  Nodes are only dead when none of their outputs reaches a
        graph output, and ONNX ops have no side effects, so opaque nodes are as safe to remove as any.
        """
        needed = set(self.output_names)
        keep: list[Node] = []
        for n in reversed(self.nodes):
            if any(o in needed for o in n.outputs if o):
                keep.append(n)
                needed.update(t for t in n.inputs if t)
                needed.update(subgraph_inputs(n))
        removed = len(self.nodes) - len(keep)
        self.nodes = list(reversed(keep))
        for w in [w for w in self.initializers if w not in needed and w not in self.input_names]:
            del self.initializers[w]
        produced = {o for n in self.nodes for o in n.outputs}
        for v in [v for v in self.value_info if v not in needed and v not in produced]:
            del self.value_info[v]
        return removed

    def copy(self) -> "Graph":
        """Copy nodes and tensor tables; weight arrays are shared (rewrites never mutate them in place)."""
        g = copy.copy(self)
        g.nodes = [copy.copy(n) for n in self.nodes]
        for n in g.nodes:
            n.inputs = list(n.inputs)
            n.outputs = list(n.outputs)
            n.attrs = dict(n.attrs)
        g.inputs = list(self.inputs)
        g.outputs = list(self.outputs)
        g.initializers = dict(self.initializers)
        g.value_info = dict(self.value_info)
        g.winograd = dict(self.winograd)
        return g

    def fresh_name(self, base: str) -> str:
        """A tensor/node name not used anywhere in the graph yet."""
        used = self._used_names()
        if base not in used:
            return base
        i = 1
        while f"{base}_{i}" in used:
            i += 1
        return f"{base}_{i}"

    def _used_names(self) -> set[str]:
        used = set(self.initializers) | set(self.value_info) | set(self.input_names) | set(self.output_names)
        for n in self.nodes:
            used.update(n.inputs)
            used.update(n.outputs)
            used.add(n.name)
        return used

    def structural_hash(self) -> str:
        """Hash of the computation (ops, attributes, wiring, weight identities), independent of node names.

        Used to deduplicate graphs during search: two graphs that compute the same thing the same way hash
        equal even if intermediate tensors were named differently.
        """
        produced = self.producers()
        memo: dict[str, str] = {}

        def leaf_key(t: str) -> str:
            return "w:" + array_key(self.initializers[t]) if t in self.initializers else "in:" + t

        def tensor_key(root: str) -> str:
            """Post-order over the producers with an explicit stack: a chain of any length (no recursion limit)."""
            stack, expanding = [root], set()
            while stack:
                t = stack[-1]
                if t in memo:
                    stack.pop()
                    continue
                if t not in produced:
                    memo[t] = leaf_key(t)
                    stack.pop()
                    continue
                n, k = produced[t]
                pending = [i for i in n.inputs if i and i not in memo]
                if pending and t not in expanding:
                    expanding.add(t)
                    if any(i in expanding for i in pending):
                        raise ValueError(f"the graph has a cycle through tensor {t!r}")
                    stack.extend(reversed(pending))
                    continue
                h = hashlib.sha1()
                h.update(f"{n.domain}:{n.op_type}:{attrs_key(n.attrs)}:{k}".encode())
                for i in n.inputs:
                    h.update(memo[i].encode() if i else b"-")
                memo[t] = h.hexdigest()
                expanding.discard(t)
                stack.pop()
            return memo[root]

        h = hashlib.sha1()
        for o in self.output_names:
            h.update(tensor_key(o).encode())
        for w, m in sorted(self.winograd.items()):  # the same function computed by another kernel
            if w in self.initializers:
                h.update(f"winograd{m}:{array_key(self.initializers[w])}".encode())
        return h.hexdigest()


def subgraph_inputs(node: Node) -> Iterable[str]:
    """Outer-scope tensors referenced by a control-flow body (If/Loop/Scan), which keep them alive."""
    for v in node.attrs.values():
        if hasattr(v, "node") and hasattr(v, "initializer"):  # onnx.GraphProto
            local = {i.name for i in v.input} | {i.name for i in v.initializer}
            for sub in v.node:
                local.update(sub.output)
            for sub in v.node:
                for t in sub.input:
                    if t and t not in local:
                        yield t


def attrs_key(attrs: dict[str, Any]) -> str:
    parts = []
    for k in sorted(attrs):
        v = attrs[k]
        if isinstance(v, np.ndarray):
            v = array_key(v)
        elif hasattr(v, "SerializeToString"):
            v = hashlib.sha1(v.SerializeToString()).hexdigest()
        parts.append(f"{k}={v!r}")
    return ",".join(parts)


_ARRAY_KEYS: IdentityCache[str] = IdentityCache(1 << 14)


def array_key(arr: np.ndarray) -> str:
    """Content hash of a weight, cached by identity because weights are shared between graph copies."""
    hit = _ARRAY_KEYS.get(arr)
    if hit is not None:
        return hit
    key = f"{arr.dtype}{arr.shape}" + hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()[:16]
    return _ARRAY_KEYS.put(arr, key)
