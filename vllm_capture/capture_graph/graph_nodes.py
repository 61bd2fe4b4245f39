"""Switch the capture kernels' nodes in captured CUDA graphs off while their site is idle.

Why: an idle site's kernel exits at once, but in a replayed graph even that costs a kernel
boundary. At 8B decode the 64 idle kernels of two components cost 1.3-3% of a step on the H200
(idle at 0.969-0.987 of vanilla). A node of an instantiated graph can be disabled
(``cuGraphNodeSetEnabled``): it then runs as an empty node, and enabling it again takes effect at
the next replay, without instantiating the graph again.

How:

* While vLLM captures a graph, the op body notes the node its launch just added, with its site:
  right after a launch, the capture's dependency set is that one node (``cuStreamGetCaptureInfo``).
* Node handles belong to the captured ``cudaGraph_t``, which torch destroys once it has
  instantiated the graph unless the graph is made with ``keep_graph=True``. So the worker's
  ``torch.cuda.CUDAGraph`` becomes :class:`KeptCUDAGraph` (``install``), which keeps its graph,
  instantiates at ``capture_end`` as torch does without ``keep_graph``, and hands its noted nodes to
  the registry.
* ``set_site(key, on)`` enables or disables a site's nodes in every live graph.

The kernels' own ``enabled`` flag still decides what is captured; this only saves launches. So a
node is disabled only when the driver calls are available and worked; enabling a node that then
fails raises (its rows would be lost), and a failed disable leaves the node enabled.

Everything here runs on the thread that launches the graphs (vLLM's model-runner thread: stream
switches are RPCs between steps), since a graph exec is not thread-safe.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from dataclasses import dataclass, field

import torch

logger = logging.getLogger("vllm_capture")

_CAPTURE_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE


class Driver:
    """The CUDA driver calls this needs, through ctypes (torch does not expose them)."""

    def __init__(self, lib: ctypes.CDLL):
        self._set_enabled = lib.cuGraphNodeSetEnabled
        self._set_enabled.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._get_enabled = lib.cuGraphNodeGetEnabled
        self._get_enabled.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_uint)]
        # _v3 (CUDA 12.3+) adds the edge data; _v2 is the older driver's.
        self._info_v3 = getattr(lib, "cuStreamGetCaptureInfo_v3", None)
        self._info_v2 = None if self._info_v3 is not None else lib.cuStreamGetCaptureInfo_v2
        common = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                  ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p))]
        if self._info_v3 is not None:
            self._info_v3.argtypes = common + [ctypes.POINTER(ctypes.c_void_p),
                                               ctypes.POINTER(ctypes.c_size_t)]
        else:
            self._info_v2.argtypes = common + [ctypes.POINTER(ctypes.c_size_t)]

    def capture_tail(self, stream: int) -> tuple[int, list[int]] | None:
        """``(graph, dependency nodes)`` of the capture under way on ``stream``, else None."""
        status, capture_id = ctypes.c_int(0), ctypes.c_uint64(0)
        graph = ctypes.c_void_p(0)
        deps = ctypes.POINTER(ctypes.c_void_p)()
        count = ctypes.c_size_t(0)
        if self._info_v3 is not None:
            edges = ctypes.c_void_p(0)
            rc = self._info_v3(stream, ctypes.byref(status), ctypes.byref(capture_id),
                               ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(edges),
                               ctypes.byref(count))
        else:
            rc = self._info_v2(stream, ctypes.byref(status), ctypes.byref(capture_id),
                               ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(count))
        if rc != 0 or status.value != _CAPTURE_ACTIVE or not graph.value:
            return None
        return graph.value, [deps[i] for i in range(count.value)]

    def set_enabled(self, graph_exec: int, node: int, on: bool) -> int:
        return self._set_enabled(graph_exec, node, int(on))

    def is_enabled(self, graph_exec: int, node: int) -> bool:
        out = ctypes.c_uint(0)
        rc = self._get_enabled(graph_exec, node, ctypes.byref(out))
        if rc != 0:
            raise RuntimeError(f"cuGraphNodeGetEnabled failed with CUresult {rc}")
        return bool(out.value)


def load_driver() -> Driver | None:
    try:
        return Driver(ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError) as exc:
        logger.info("vllm-capture: idle capture nodes stay enabled (%s)", exc)
        return None


@dataclass
class _Graph:
    """A captured graph's noted nodes, by site key."""

    graph: weakref.ref
    by_site: dict[int, list[int]]


@dataclass
class GraphNodes:
    """The capture kernels' nodes in every live captured graph, and which sites want them."""

    driver: Driver | None
    # Sites whose nodes must stay enabled whatever ``set_site`` says (the replay counter's site).
    pinned: set[int] = field(default_factory=set)
    _off: set[int] = field(default_factory=set)  # site keys whose nodes are disabled
    _noting: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # by cudaGraph_t
    _graphs: dict[int, _Graph] = field(default_factory=dict)  # by id(CUDAGraph)
    unnoted_launches: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def note_launch(self, key: int, stream: int) -> None:
        """The op body just launched ``key``'s kernel into the capture on ``stream``."""
        if self.driver is None:
            return
        tail = self.driver.capture_tail(stream)
        if tail is None or len(tail[1]) != 1:
            self.unnoted_launches += 1  # stays enabled: costs a launch, loses nothing
            return
        graph, (node,) = tail
        with self._lock:
            self._noting.setdefault(graph, []).append((node, key))

    def adopt(self, cuda_graph, raw_graph: int) -> None:
        """``cuda_graph`` (a torch CUDAGraph) was captured into ``raw_graph`` and instantiated:
        take its noted nodes and disable those of sites that are off."""
        with self._lock:
            noted = self._noting.pop(raw_graph, [])
            if not noted:
                self._graphs.pop(id(cuda_graph), None)
                return
            by_site: dict[int, list[int]] = {}
            for node, key in noted:
                by_site.setdefault(key, []).append(node)
            self._graphs[id(cuda_graph)] = _Graph(weakref.ref(cuda_graph), by_site)
            off = [node for key in self._off - self.pinned for node in by_site.get(key, ())]
        if off:
            self._apply(cuda_graph, off, on=False)

    def forget(self, cuda_graph) -> None:
        with self._lock:
            self._graphs.pop(id(cuda_graph), None)

    def set_site(self, key: int, on: bool) -> None:
        """Enable (``on``) or disable the nodes of site ``key`` in every live graph."""
        if not on and key in self.pinned:
            return
        with self._lock:
            if on == (key not in self._off):
                return
            graphs = [(g.graph(), g.by_site.get(key)) for g in self._graphs.values()]
        graphs = [(g, nodes) for g, nodes in graphs if g is not None and nodes]
        done = all([self._apply(g, nodes, on) for g, nodes in graphs])
        if not done:  # some graphs took the disable: enable them again, so none is half off
            for g, nodes in graphs:
                self._apply(g, nodes, True)
        with self._lock:
            if on:
                self._off.discard(key)
            elif done:
                self._off.add(key)

    def _apply(self, cuda_graph, nodes: list[int], on: bool) -> bool:
        """Set ``nodes`` of one graph; False when a disable did not take (nodes left enabled)."""
        try:
            graph_exec = cuda_graph.raw_cuda_graph_exec()
        except RuntimeError:
            return True  # not instantiated (reset): nothing replays it
        for node in nodes:
            rc = self.driver.set_enabled(graph_exec, node, on)
            if rc == 0:
                continue
            if on:
                raise RuntimeError(f"vllm-capture: cuGraphNodeSetEnabled failed with CUresult "
                                   f"{rc}; a capture node stays disabled")
            for undo in nodes:  # a half-disabled site is a state nobody tracks
                if self.driver.set_enabled(graph_exec, undo, True) != 0:
                    raise RuntimeError(f"vllm-capture: could not re-enable a capture node "
                                       f"after cuGraphNodeSetEnabled failed with {rc}")
            logger.warning("vllm-capture: cuGraphNodeSetEnabled failed with CUresult %d; idle "
                           "capture nodes stay enabled", rc)
            return False
        return True

    def status(self) -> dict[str, int]:
        """How many graphs and nodes are tracked, and how many nodes are disabled now."""
        with self._lock:
            graphs = [g for g in self._graphs.values() if g.graph() is not None]
            off = set(self._off)
        return {"graphs": len(graphs),
                "nodes": sum(len(nodes) for g in graphs for nodes in g.by_site.values()),
                "nodes_disabled": sum(len(nodes) for g in graphs
                                      for key, nodes in g.by_site.items() if key in off),
                "unnoted_launches": self.unnoted_launches}

    def disabled_in_graphs(self) -> int:
        """Nodes the driver reports disabled, over every live graph (a check, not a mirror)."""
        count = 0
        with self._lock:
            graphs = [(g.graph(), [n for nodes in g.by_site.values() for n in nodes])
                      for g in self._graphs.values()]
        for cuda_graph, nodes in graphs:
            if cuda_graph is None:
                continue
            graph_exec = cuda_graph.raw_cuda_graph_exec()
            count += sum(not self.driver.is_enabled(graph_exec, node) for node in nodes)
        return count


# The registry of this process's model (one per worker process), read by KeptCUDAGraph.
_active: GraphNodes | None = None


class _KeptGraphMixin:
    """Makes a ``torch.cuda.CUDAGraph`` keep its captured graph, so its node handles stay valid,
    and hands its noted nodes to the active registry once instantiated."""

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
