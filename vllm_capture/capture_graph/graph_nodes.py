"""Replay captured CUDA graphs without the capture kernels' nodes of idle sites.

Why: an idle site's kernel exits at once, but in a replayed graph even that costs a kernel
boundary. A node switched off in the instantiated graph (``cuGraphNodeSetEnabled``) costs almost as
much: on the H200, an 8B decode graph of 64 tokens replayed alone took 5,637 us in a vanilla
engine; with its 64 capture nodes enabled but idle, 5,768 us; with them disabled, 5,712 us; and
copied without them, 5,642 us (``benchmarks/graph_replay.py``). So a graph whose sites are partly
idle is replayed from a copy without those nodes.

How:

* While vLLM captures a graph, the op body notes the node its launch just added, with its site:
  right after a launch, the capture's dependency set is that one node (``cuStreamGetCaptureInfo``).
* Node handles belong to the captured ``cudaGraph_t``, which torch destroys once it has
  instantiated the graph unless the graph is made with ``keep_graph=True``. So the worker's
  ``torch.cuda.CUDAGraph`` becomes :class:`KeptCUDAGraph` (``install``), which keeps its graph,
  instantiates at ``capture_end`` as torch does without ``keep_graph``, and hands its noted nodes to
  the registry.
* ``set_sites`` says which sites are on. For every live graph with idle sites the registry then
  makes (or reuses) an executable copy of the kept graph without those sites' nodes, each removed
  node's predecessors joined to its successors, instantiated as torch instantiates. Only then do
  replays use it, so the copies are made between steps (stream switches are RPCs), never during
  one. ``KeptCUDAGraph.replay`` launches the copy on the current stream; with every site on, or
  where a copy could not be made, torch's own executable graph runs, every capture node in it.
* torch's replay also advances the CUDA generator by the graph's random-number use. A graph is
  replayed from a copy only once its first replay (by torch) showed that it does not advance the
  default generator; vLLM's forward graphs draw no random numbers.

The kernels' own ``enabled`` flag still decides what is captured; this only saves launches. The
replay counter's site (``pinned``) keeps its nodes in every copy, so ``graph_replays`` counts every
forward.

Everything here runs on the thread that launches the graphs (vLLM's model-runner thread: stream
switches are RPCs between steps), since a graph exec is not thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("vllm_capture")

_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
# What torch instantiates with (cudaGraphInstantiateFlagAutoFreeOnLaunch).
_INSTANTIATE_FLAGS = 1
_P = ctypes.c_void_p
_SIZE = ctypes.POINTER(ctypes.c_size_t)


class DriverError(RuntimeError):
    pass


class Driver:
    """The CUDA driver calls this needs, through ctypes (torch does not expose them). Graph
    edits use the entry points without edge data, whose signatures every driver keeps."""

    _SIGNATURES = {
        "cuGraphClone": [ctypes.POINTER(_P), _P],
        "cuGraphNodeFindInClone": [ctypes.POINTER(_P), _P, _P],
        "cuGraphNodeGetDependencies": [_P, ctypes.POINTER(_P), _SIZE],
        "cuGraphNodeGetDependentNodes": [_P, ctypes.POINTER(_P), _SIZE],
        "cuGraphAddDependencies": [_P, ctypes.POINTER(_P), ctypes.POINTER(_P), ctypes.c_size_t],
        "cuGraphDestroyNode": [_P],
        "cuGraphDestroy": [_P],
        "cuGraphInstantiateWithFlags": [ctypes.POINTER(_P), _P, ctypes.c_ulonglong],
        "cuGraphLaunch": [_P, _P],
        "cuGraphExecDestroy": [_P],
    }

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        for name, args in self._SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        # _v3 (CUDA 12.3+) adds the edge data; _v2 is the older driver's.
        self._info_v3 = getattr(lib, "cuStreamGetCaptureInfo_v3", None)
        self._info_v2 = None if self._info_v3 is not None else lib.cuStreamGetCaptureInfo_v2
        common = [_P, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(_P), ctypes.POINTER(ctypes.POINTER(_P))]
        if self._info_v3 is not None:
            self._info_v3.argtypes = common + [ctypes.POINTER(_P), _SIZE]
        else:
            self._info_v2.argtypes = common + [_SIZE]

    def _call(self, name: str, *args) -> None:
        rc = getattr(self._lib, name)(*args)
        if rc != 0:
            raise DriverError(f"{name} failed with CUresult {rc}")

    def capture_tail(self, stream: int) -> tuple[int, list[int]] | None:
        """``(graph, dependency nodes)`` of the capture under way on ``stream``, else None."""
        status, capture_id = ctypes.c_int(0), ctypes.c_uint64(0)
        graph = _P(0)
        deps = ctypes.POINTER(_P)()
        count = ctypes.c_size_t(0)
        if self._info_v3 is not None:
            edges = _P(0)
            rc = self._info_v3(stream, ctypes.byref(status), ctypes.byref(capture_id),
                               ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(edges),
                               ctypes.byref(count))
        else:
            rc = self._info_v2(stream, ctypes.byref(status), ctypes.byref(capture_id),
                               ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(count))
        if rc != 0 or status.value != _CAPTURE_ACTIVE or not graph.value:
            return None
        return graph.value, [deps[i] for i in range(count.value)]

    def _neighbours(self, name: str, node: _P) -> list[int]:
        count = ctypes.c_size_t(0)
        self._call(name, node, None, ctypes.byref(count))
        if count.value == 0:  # a graph's first or last node: asking again with an array fails
            return []
        out = (_P * count.value)()
        self._call(name, node, out, ctypes.byref(count))
        return [out[i] for i in range(count.value)]

    def exec_without(self, graph: int, nodes: list[int]) -> int:
        """An executable copy of ``graph`` without ``nodes``, each one's predecessors joined to
        its successors (DriverError when the driver refuses; nothing is left behind)."""
        clone = _P()
        self._call("cuGraphClone", ctypes.byref(clone), _P(graph))
        try:
            for node in nodes:
                copy = _P()
                self._call("cuGraphNodeFindInClone", ctypes.byref(copy), _P(node), clone)
                before = self._neighbours("cuGraphNodeGetDependencies", copy)
                after = self._neighbours("cuGraphNodeGetDependentNodes", copy)
                self._call("cuGraphDestroyNode", copy)
                if before and after:
                    pairs = len(before) * len(after)
                    src = (_P * pairs)(*[a for a in before for _ in after])
                    dst = (_P * pairs)(*[b for _ in before for b in after])
                    self._call("cuGraphAddDependencies", clone, src, dst, pairs)
            graph_exec = _P()
            self._call("cuGraphInstantiateWithFlags", ctypes.byref(graph_exec), clone,
                       _INSTANTIATE_FLAGS)
            return graph_exec.value
        finally:
            self._lib.cuGraphDestroy(clone)

    def launch(self, graph_exec: int, stream: int) -> None:
        self._call("cuGraphLaunch", _P(graph_exec), _P(stream))

    def destroy_exec(self, graph_exec: int) -> None:
        # An exec still running is freed once it completes (cuGraphExecDestroy's contract).
        self._lib.cuGraphExecDestroy(_P(graph_exec))


def load_driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        logger.info("vllm-capture: idle capture nodes stay in replayed graphs (%s)", exc)
        return None


#: Copies kept per graph, the one in use included: switching between a few stream settings
#: (idle, one stream, another) reuses them instead of instantiating again.
VARIANTS_PER_GRAPH = 4


@dataclass
class _Graph:
    """A captured graph's noted nodes, by site key, and its copies without some sites."""

    graph: weakref.ref
    raw: int  # the kept cudaGraph_t
    by_site: dict[int, list[int]]
    variants: dict[frozenset, int] = field(default_factory=dict)  # removed sites -> graph exec
    use: int | None = None  # the copy replays launch; None: torch's own exec
    draws_random: bool | None = None  # known after its first replay
    idle_nodes: int = 0  # nodes of idle sites (not pinned): what a replay by torch runs for nothing


@dataclass
class GraphNodes:
    """The capture kernels' nodes in every live captured graph, and which sites want them."""

    driver: Driver | None
    # Sites whose nodes stay in every copy whatever ``set_sites`` says (the replay counter's).
    pinned: set[int] = field(default_factory=set)
    _off: set[int] = field(default_factory=set)  # site keys that are idle
    _noting: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # by cudaGraph_t
    _graphs: dict[int, _Graph] = field(default_factory=dict)  # by id(CUDAGraph)
    unnoted_launches: int = 0
    copy_failures: int = 0
    copy_seconds: float = 0.0  # spent making copies (at adopt and at each switch)
    # Replays, counted as they launch: from a copy, and the idle sites' nodes that replays by
    # torch ran (a graph's first, or one that could not be copied), so that a run can tell
    # whether its idle capture nodes stayed out of the GPU's work.
    copy_replays: int = 0
    idle_nodes_replayed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note_launch(self, key: int, stream: int) -> None:
        """The op body just launched ``key``'s kernel into the capture on ``stream``."""
        if self.driver is None:
            return
        tail = self.driver.capture_tail(stream)
        if tail is None or len(tail[1]) != 1:
            self.unnoted_launches += 1  # stays in every copy: costs a launch, loses nothing
            return
        graph, (node,) = tail
        with self._lock:
            self._noting.setdefault(graph, []).append((node, key))

    def adopt(self, cuda_graph, raw_graph: int) -> None:
        """``cuda_graph`` (a torch CUDAGraph) was captured into ``raw_graph`` and instantiated:
        take its noted nodes, and copy it without the idle sites' nodes."""
        with self._lock:
            noted = self._noting.pop(raw_graph, [])
            old = self._graphs.pop(id(cuda_graph), None)
        if old is not None:
            self._drop(old)
        if not noted:
            return
        by_site: dict[int, list[int]] = {}
        for node, key in noted:
            by_site.setdefault(key, []).append(node)
        entry = _Graph(weakref.ref(cuda_graph), raw_graph, by_site)
        # The copies go with the graph (not at exit: the process is ending, its context too).
        weakref.finalize(cuda_graph, self._release, id(cuda_graph), entry).atexit = False
        with self._lock:
            self._graphs[id(cuda_graph)] = entry
        self._choose(entry)

    def forget(self, cuda_graph) -> None:
        self._release(id(cuda_graph), self._graphs.get(id(cuda_graph)))

    def _release(self, key: int, entry: _Graph | None) -> None:
        with self._lock:
            if entry is None or self._graphs.get(key) is not entry:
                return
            del self._graphs[key]
        self._drop(entry)

    def set_sites(self, states: dict[int, bool]) -> None:
        """Sites on (True) or idle (False), by key. Every live graph's replays leave out the
        nodes of idle sites from the next replay on."""
        with self._lock:
            before = set(self._off)
            for key, on in states.items():
                if on:
                    self._off.discard(key)
                else:
                    self._off.add(key)
            changed = self._off != before
            entries = list(self._graphs.values()) if changed else []
        for entry in entries:
            self._choose(entry)

    def launch_for(self, cuda_graph) -> int | None:
        """The copy to replay ``cuda_graph`` from, or None: torch's own replay."""
        entry = self._graphs.get(id(cuda_graph))
        if entry is None or entry.draws_random is not False:
            return None
        return entry.use

    def count_torch_replay(self, cuda_graph) -> None:
        """``cuda_graph`` replays by torch, with every node it was captured with."""
        entry = self._graphs.get(id(cuda_graph))
        if entry is not None:
            self.idle_nodes_replayed += entry.idle_nodes

    def unchecked(self, cuda_graph) -> bool:
        """Whether ``cuda_graph`` was never replayed (by torch), so its use of random numbers
        is not known yet."""
        entry = self._graphs.get(id(cuda_graph))
        return entry is not None and entry.draws_random is None

    def replayed_by_torch(self, cuda_graph, draws_random: bool) -> None:
        """Whether torch's first replay of ``cuda_graph`` advanced the CUDA generator."""
        entry = self._graphs.get(id(cuda_graph))
        if entry is None or entry.draws_random is not None:
            return
        entry.draws_random = draws_random
        if draws_random:
            logger.info("vllm-capture: a captured graph draws random numbers; torch replays "
                        "it, with every capture node")
            self._drop(entry)

    def _choose(self, entry: _Graph) -> None:
        """Point ``entry`` at the copy without its idle sites' nodes, made if need be."""
        if entry.graph() is None:
            return
        with self._lock:
            removed = frozenset(k for k in entry.by_site if k in self._off and k not in self.pinned)
        entry.idle_nodes = sum(len(entry.by_site[k]) for k in removed)
        if self.driver is None or entry.draws_random:
            return
        if not removed:
            entry.use = None
            return
        graph_exec = entry.variants.pop(removed, None)
        if graph_exec is None:
            t0 = time.perf_counter()
            try:
                graph_exec = self.driver.exec_without(
                    entry.raw, [n for key in removed for n in entry.by_site[key]])
            except DriverError as exc:
                self.copy_failures += 1
                logger.warning("vllm-capture: could not copy a graph without its idle capture "
                               "nodes (%s); it replays with them", exc)
                entry.use = None
                return
            finally:
                self.copy_seconds += time.perf_counter() - t0
        entry.variants[removed] = graph_exec  # the most recent last
        entry.use = graph_exec
        while len(entry.variants) > VARIANTS_PER_GRAPH:
            self.driver.destroy_exec(entry.variants.pop(next(iter(entry.variants))))

    def _drop(self, entry: _Graph) -> None:
        entry.use = None
        variants, entry.variants = entry.variants, {}
        if self.driver is not None:
            for graph_exec in variants.values():
                self.driver.destroy_exec(graph_exec)

    def status(self) -> dict[str, int]:
        """How many graphs and nodes are tracked, how many nodes replays leave out now (idle
        sites'), the copies held, and the replays so far: from a copy, and the idle sites' nodes
        that replays by torch ran."""
        with self._lock:
            graphs = [g for g in self._graphs.values() if g.graph() is not None]
            off = set(self._off) - self.pinned
        return {"graphs": len(graphs),
                "nodes": sum(len(nodes) for g in graphs for nodes in g.by_site.values()),
                "nodes_left_out": sum(len(nodes) for g in graphs
                                      if g.use is not None and g.draws_random is False
                                      for key, nodes in g.by_site.items() if key in off),
                "graph_copies": sum(len(g.variants) for g in graphs),
                "copy_failures": self.copy_failures,
                "copy_ms": round(self.copy_seconds * 1e3, 1),
                "unnoted_launches": self.unnoted_launches,
                "copy_replays": self.copy_replays,
                "idle_nodes_replayed": self.idle_nodes_replayed}


def _current_stream() -> int:
    # The raw handle in two C calls: torch.cuda.current_stream() builds a Stream object through
    # several Python frames, on every replay of a graph, where torch's own replay pays nothing.
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _generator_offset() -> int:
    """The default CUDA generator's offset, which torch's replay advances by the random numbers
    the graph draws."""
    return torch.cuda.default_generators[torch.cuda.current_device()].get_offset()


# The registry of this process's model (one per worker process), read by KeptCUDAGraph.
_active: GraphNodes | None = None


class _KeptGraphMixin:
    """Makes a ``torch.cuda.CUDAGraph`` keep its captured graph, so its node handles stay valid,
    hands its noted nodes to the active registry once instantiated, and replays from the
    registry's copy without idle sites' nodes when there is one."""

    # torch's binding takes keep_graph in __init__ (its Python __new__ passes it along too).
    def __new__(cls, keep_graph: bool = True):
        return super().__new__(cls, True)

    def __init__(self, keep_graph: bool = True):
        super().__init__(True)

    def capture_end(self):
        super().capture_end()
        # What capture_end does without keep_graph; replay would do it lazily otherwise.
        self.instantiate()
        if _active is not None:
            _active.adopt(self, self.raw_cuda_graph())

    def replay(self):
        registry = _active
        graph_exec = None if registry is None else registry.launch_for(self)
        if graph_exec is not None:
            registry.driver.launch(graph_exec, _current_stream())
            registry.copy_replays += 1
            return
        if registry is None:
            super().replay()
            return
        registry.count_torch_replay(self)
        if registry.unchecked(self):
            offset = _generator_offset()
            super().replay()
            registry.replayed_by_torch(self, _generator_offset() != offset)
        else:
            super().replay()

    def reset(self):
        if _active is not None:
            _active.forget(self)
        super().reset()


def kept_graph_class(base: type) -> type:
    return type("KeptCUDAGraph", (_KeptGraphMixin, base), {})


def install(nodes: GraphNodes) -> None:
    """Make ``nodes`` the registry, and ``torch.cuda.CUDAGraph`` (which vLLM looks up whenever it
    captures) a class that keeps its graph. Before vLLM captures graphs."""
    global _active
    _active = nodes
    if torch.cuda.CUDAGraph.__name__ != "KeptCUDAGraph":
        torch.cuda.CUDAGraph = kept_graph_class(torch.cuda.CUDAGraph)
