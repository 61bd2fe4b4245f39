"""graph_nodes: which capture nodes of captured CUDA graphs are switched off, and when.

The driver is a fake that keeps each (graph exec, node)'s enabled state the way the CUDA driver
does (enabled unless set otherwise) and can be told to fail; the graphs are fakes with torch's
CUDAGraph methods. The real driver calls run on the H200 (``tests/gpu/gpu_checks.py``)."""

from __future__ import annotations

import gc

import pytest

from vllm_capture.capture_graph import graph_nodes
from vllm_capture.capture_graph.graph_nodes import GraphNodes


class FakeDriver:
    def __init__(self):
        self.enabled: dict[tuple[int, int], bool] = {}
        self.calls = 0
        self.fail: set[tuple[int, int, bool]] = set()  # (exec, node, on) that return an error
        self.capturing: dict[int, tuple[int, list[int]]] = {}  # stream -> (graph, tail nodes)

    def capture_tail(self, stream):
        return self.capturing.get(stream)

    def set_enabled(self, graph_exec, node, on):
        self.calls += 1
        if (graph_exec, node, on) in self.fail:
            return 1  # CUDA_ERROR_INVALID_VALUE
        self.enabled[(graph_exec, node)] = on
        return 0

    def is_enabled(self, graph_exec, node):
        return self.enabled.get((graph_exec, node), True)


class FakeGraph:
    """torch.cuda.CUDAGraph's surface that graph_nodes uses."""

    def __init__(self, raw_exec: int):
        self.raw_exec = raw_exec

    def raw_cuda_graph_exec(self):
        if self.raw_exec is None:
            raise RuntimeError("not instantiated")
        return self.raw_exec


def captured(nodes: GraphNodes, driver: FakeDriver, raw_graph: int, raw_exec: int,
             launches: list[tuple[int, int]]) -> FakeGraph:
    """Capture a graph with ``launches`` = [(node, site key)], then adopt it."""
    for node, key in launches:
        driver.capturing[7] = (raw_graph, [node])
        nodes.note_launch(key, stream=7)
    driver.capturing.pop(7, None)
    graph = FakeGraph(raw_exec)
    nodes.adopt(graph, raw_graph)
    return graph


def states(driver: FakeDriver, graph_exec: int, node_list) -> list[bool]:
    return [driver.is_enabled(graph_exec, n) for n in node_list]


def test_nodes_of_off_sites_are_disabled_when_the_graph_is_adopted():
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned={100})
    for key in (100, 200, 300):
        nodes.set_site(key, False)  # sites start off, before any graph exists
    nodes.set_site(300, True)
    assert driver.calls == 0
    graph = captured(nodes, driver, raw_graph=1, raw_exec=11,
                     launches=[(1, 100), (2, 200), (3, 300)])
    # The pinned site (the replay counter's) stays on; the off site's node is disabled.
    assert states(driver, 11, [1, 2, 3]) == [True, False, True]
    assert nodes.status() == {"graphs": 1, "nodes": 3, "nodes_disabled": 1, "unnoted_launches": 0}
    assert nodes.disabled_in_graphs() == 1
    del graph
    gc.collect()
    assert nodes.status()["graphs"] == 0  # a graph vLLM freed is no longer tracked


def test_set_site_switches_exactly_that_sites_nodes_in_every_graph():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    g1 = captured(nodes, driver, 1, 11, [(1, 100), (2, 200)])
    g2 = captured(nodes, driver, 2, 22, [(5, 100), (6, 200), (7, 100)])
    nodes.set_site(100, False)
    assert states(driver, 11, [1, 2]) == [False, True]
    assert states(driver, 22, [5, 6, 7]) == [False, True, False]
    calls = driver.calls
    nodes.set_site(100, False)  # unchanged: no driver call
    nodes.set_site(200, True)
    assert driver.calls == calls
    nodes.set_site(100, True)
    assert all(states(driver, 11, [1, 2]) + states(driver, 22, [5, 6, 7]))
    assert nodes.status()["nodes_disabled"] == 0
    del g1, g2


def test_pinned_site_is_never_disabled():
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned={100})
    graph = captured(nodes, driver, 1, 11, [(1, 100)])
    nodes.set_site(100, False)
    assert driver.calls == 0 and driver.is_enabled(11, 1)
    del graph


def test_a_launch_whose_node_is_not_known_stays_enabled_and_is_counted():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.note_launch(100, stream=3)  # not capturing
    driver.capturing[3] = (1, [4, 5])  # two dependencies: which one is ours is unknown
    nodes.note_launch(100, stream=3)
    driver.capturing[3] = (1, [])
    nodes.note_launch(100, stream=3)
    assert nodes.unnoted_launches == 3
    graph = FakeGraph(11)
    nodes.adopt(graph, 1)
    nodes.set_site(100, False)
    assert driver.calls == 0
    assert nodes.status()["graphs"] == 0


def test_launches_are_kept_apart_by_the_graph_they_were_captured_into():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    # Two captures interleaved (as two streams would): each graph gets its own nodes.
    driver.capturing[1] = (10, [1])
    nodes.note_launch(100, stream=1)
    driver.capturing[2] = (20, [2])
    nodes.note_launch(100, stream=2)
    driver.capturing[1] = (10, [3])
    nodes.note_launch(200, stream=1)
    g10, g20 = FakeGraph(110), FakeGraph(120)
    nodes.adopt(g10, 10)
    nodes.adopt(g20, 20)
    nodes.set_site(100, False)
    assert states(driver, 110, [1, 3]) == [False, True]
    assert states(driver, 120, [2]) == [False]
    assert not driver.is_enabled(110, 1) and (110, 2) not in driver.enabled


def test_a_failed_disable_leaves_every_graphs_nodes_enabled():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    g1 = captured(nodes, driver, 1, 11, [(1, 100), (2, 100)])
    g2 = captured(nodes, driver, 2, 22, [(3, 100)])
    driver.fail.add((22, 3, False))  # the second graph refuses
    nodes.set_site(100, False)
    assert all(states(driver, 11, [1, 2]) + states(driver, 22, [3]))
    assert nodes.status()["nodes_disabled"] == 0
    # The site is not taken for off, so switching it on later is not skipped as "no change".
    driver.fail.clear()
    nodes.set_site(100, False)
    assert states(driver, 11, [1, 2]) + states(driver, 22, [3]) == [False, False, False]
    nodes.set_site(100, True)
    assert all(states(driver, 11, [1, 2]) + states(driver, 22, [3]))
    del g1, g2


def test_a_failed_enable_raises():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    graph = captured(nodes, driver, 1, 11, [(1, 100)])
    nodes.set_site(100, False)
    driver.fail.add((11, 1, True))
    with pytest.raises(RuntimeError, match="stays disabled"):
        nodes.set_site(100, True)
    del graph


def test_freed_and_reset_graphs_are_skipped():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    gone = captured(nodes, driver, 1, 11, [(1, 100)])
    reset = captured(nodes, driver, 2, 22, [(2, 100)])
    kept = captured(nodes, driver, 3, 33, [(3, 100)])
    del gone
    gc.collect()
    reset.raw_exec = None  # torch raises for a graph that is not instantiated
    nodes.set_site(100, False)
    assert (11, 1) not in driver.enabled and (22, 2) not in driver.enabled
    assert not driver.is_enabled(33, 3)
    nodes.forget(kept)
    assert nodes.status()["graphs"] == 1  # `reset` is still alive (it may be captured again)


def test_without_a_driver_nothing_is_noted_or_switched():
    nodes = GraphNodes(None)
    nodes.note_launch(100, stream=1)
    nodes.adopt(FakeGraph(11), 1)
    nodes.set_site(100, False)
    assert nodes.status()["nodes"] == 0


class FakeTorchGraph:
    """torch.cuda.CUDAGraph's constructor and capture methods."""

    # As torch's pybind class: __new__ ignores its arguments, __init__ takes keep_graph.
    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, keep_graph: bool = False):
        self.keep_graph, self.instantiated, self.was_reset = keep_graph, False, False

    def capture_end(self):
        if not self.keep_graph:
            self.instantiate()  # torch then destroys the graph: its node handles dangle

    def instantiate(self):
        self.instantiated = True

    def raw_cuda_graph(self):
        assert self.keep_graph, "keep_graph must be True"
        return 1

    def raw_cuda_graph_exec(self):
        assert self.instantiated
        return 11

    def reset(self):
        self.was_reset = True


def test_kept_graph_keeps_its_graph_instantiates_and_hands_over_its_nodes(monkeypatch):
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.set_site(200, False)
    monkeypatch.setattr(graph_nodes, "_active", nodes)
    kept = graph_nodes.kept_graph_class(FakeTorchGraph)
    graph = kept()  # vLLM's call: no arguments
    assert graph.keep_graph
    driver.capturing[7] = (1, [5])
    nodes.note_launch(200, stream=7)
    graph.capture_end()
    assert graph.instantiated
    assert not driver.is_enabled(11, 5)
    graph.reset()
    assert graph.was_reset and nodes.status()["graphs"] == 0
