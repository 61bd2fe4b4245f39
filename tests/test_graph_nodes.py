"""graph_nodes: which copy of each captured CUDA graph replays run, without which capture nodes.

The driver is a fake that records the copies it makes (graph, nodes left out) and which it
destroys, and can be told to fail; the graphs are fakes with torch's CUDAGraph methods. The real
driver calls run on the H200 (``tests/gpu/gpu_checks.py``)."""

from __future__ import annotations

import gc
import itertools

import pytest

from vllm_capture.capture_graph import graph_nodes
from vllm_capture.capture_graph.graph_nodes import DriverError, GraphNodes


class FakeDriver:
    def __init__(self):
        self.copies: dict[int, tuple[int, frozenset]] = {}  # live exec -> (graph, nodes left out)
        self.destroyed: list[int] = []
        self.launched: list[tuple[int, int]] = []
        self.fail = False
        self.capturing: dict[int, tuple[int, list[int]]] = {}  # stream -> (graph, tail nodes)
        self._handles = itertools.count(1000)

    def capture_tail(self, stream):
        return self.capturing.get(stream)

    def exec_without(self, graph, nodes):
        if self.fail:
            raise DriverError("cuGraphInstantiateWithFlags failed with CUresult 1")
        handle = next(self._handles)
        self.copies[handle] = (graph, frozenset(nodes))
        return handle

    def launch(self, graph_exec, stream):
        assert graph_exec in self.copies, "launched a destroyed copy"
        self.launched.append((graph_exec, stream))

    def destroy_exec(self, graph_exec):
        del self.copies[graph_exec]
        self.destroyed.append(graph_exec)


class FakeGraph:
    """The registry only needs a weakly referenceable object per graph."""


def captured(nodes: GraphNodes, driver: FakeDriver, raw_graph: int,
             launches: list[tuple[int, int]], checked: bool = True) -> FakeGraph:
    """Capture a graph with ``launches`` = [(node, site key)], adopt it, and (``checked``) let
    its first replay by torch show that it draws no random numbers."""
    for node, key in launches:
        driver.capturing[7] = (raw_graph, [node])
        nodes.note_launch(key, stream=7)
    driver.capturing.pop(7, None)
    graph = FakeGraph()
    nodes.adopt(graph, raw_graph)
    if checked:
        nodes.replayed_by_torch(graph, draws_random=False)
    return graph


def left_out(nodes: GraphNodes, driver: FakeDriver, graph) -> frozenset | None:
    """The nodes the graph's replays leave out now; None: torch's replay (every node)."""
    graph_exec = nodes.launch_for(graph)
    return None if graph_exec is None else driver.copies[graph_exec][1]


def test_idle_sites_nodes_are_left_out_of_a_graph_adopted_later_but_the_pinned_sites_stay():
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned={100})
    nodes.set_sites({100: False, 200: False, 300: True})  # before any graph exists
    assert driver.copies == {}
    graph = captured(nodes, driver, raw_graph=1, launches=[(1, 100), (2, 200), (3, 300), (4, 200)])
    assert left_out(nodes, driver, graph) == {2, 4}
    status = nodes.status()
    assert status.pop("copy_ms") >= 0
    assert status == {"graphs": 1, "nodes": 4, "nodes_left_out": 2, "graph_copies": 1,
                      "copy_failures": 0, "unnoted_launches": 0, "copy_replays": 0,
                      "idle_nodes_replayed": 0}
    # Every site on: torch's own executable graph, which has every node.
    nodes.set_sites({200: True})
    assert nodes.launch_for(graph) is None
    assert nodes.status()["nodes_left_out"] == 0


def test_set_sites_switches_every_graph_and_reuses_the_copies_it_made():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    g1 = captured(nodes, driver, 1, [(1, 100), (2, 200)])
    g2 = captured(nodes, driver, 2, [(5, 100), (6, 200), (7, 100)])
    assert nodes.launch_for(g1) is None and driver.copies == {}  # every site on
    nodes.set_sites({100: False})
    assert left_out(nodes, driver, g1) == {1}
    assert left_out(nodes, driver, g2) == {5, 7}
    made = len(driver.copies)
    nodes.set_sites({100: False, 200: True})  # no change: no copy
    assert len(driver.copies) == made
    nodes.set_sites({100: True, 200: False})
    assert left_out(nodes, driver, g1) == {2} and left_out(nodes, driver, g2) == {6}
    first = nodes.launch_for(g1)
    nodes.set_sites({100: False, 200: True})
    nodes.set_sites({100: True, 200: False})
    assert nodes.launch_for(g1) == first  # kept, not made again
    assert len(driver.copies) == 4 and driver.destroyed == []
    del g1, g2


def test_copies_beyond_the_limit_are_destroyed_oldest_first_never_the_one_in_use():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    keys = [100 + i for i in range(graph_nodes.VARIANTS_PER_GRAPH + 2)]
    graph = captured(nodes, driver, 1, [(i + 1, key) for i, key in enumerate(keys)])
    made = []
    for key in keys:
        nodes.set_sites({k: k != key for k in keys})
        made.append(nodes.launch_for(graph))
    assert driver.destroyed == made[:2]
    assert set(driver.copies) == set(made[2:])
    assert nodes.launch_for(graph) == made[-1]
    assert nodes.status()["graph_copies"] == graph_nodes.VARIANTS_PER_GRAPH


def test_a_graph_with_only_the_pinned_site_idle_replays_as_captured():
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned={100})
    graph = captured(nodes, driver, 1, [(1, 100)])
    nodes.set_sites({100: False})
    assert nodes.launch_for(graph) is None and driver.copies == {}


def test_a_launch_whose_node_is_not_known_is_counted_and_its_graph_not_tracked():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.note_launch(100, stream=3)  # not capturing
    driver.capturing[3] = (1, [4, 5])  # two dependencies: which one is ours is unknown
    nodes.note_launch(100, stream=3)
    driver.capturing[3] = (1, [])
    nodes.note_launch(100, stream=3)
    assert nodes.unnoted_launches == 3
    graph = FakeGraph()
    nodes.adopt(graph, 1)
    nodes.set_sites({100: False})
    assert nodes.launch_for(graph) is None and driver.copies == {}
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
    g10, g20 = FakeGraph(), FakeGraph()
    nodes.adopt(g10, 10)
    nodes.adopt(g20, 20)
    for g in (g10, g20):
        nodes.replayed_by_torch(g, draws_random=False)
    nodes.set_sites({100: False})
    assert driver.copies[nodes.launch_for(g10)] == (10, frozenset({1}))
    assert driver.copies[nodes.launch_for(g20)] == (20, frozenset({2}))


def test_a_graph_the_driver_cannot_copy_replays_with_every_node_and_is_counted():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    g1 = captured(nodes, driver, 1, [(1, 100), (2, 200)])
    driver.fail = True
    nodes.set_sites({100: False})
    assert nodes.launch_for(g1) is None
    assert nodes.status()["copy_failures"] == 1 and nodes.status()["nodes_left_out"] == 0
    driver.fail = False
    nodes.set_sites({100: True, 200: False})
    assert left_out(nodes, driver, g1) == {2}


def test_a_graph_is_copied_only_once_its_first_replay_drew_no_random_numbers():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.set_sites({200: False})
    plain = captured(nodes, driver, 1, [(1, 100), (2, 200)], checked=False)
    draws = captured(nodes, driver, 2, [(3, 100), (4, 200)], checked=False)
    assert nodes.unchecked(plain) and nodes.launch_for(plain) is None
    assert nodes.status()["nodes_left_out"] == 0  # torch replays them until checked
    nodes.replayed_by_torch(plain, draws_random=False)
    nodes.replayed_by_torch(draws, draws_random=True)
    assert not nodes.unchecked(plain) and not nodes.unchecked(draws)
    assert left_out(nodes, driver, plain) == {2}
    assert nodes.launch_for(draws) is None and nodes.status()["nodes_left_out"] == 1
    nodes.set_sites({100: False})
    assert nodes.launch_for(draws) is None
    assert {graph for graph, _ in driver.copies.values()} == {1}


def test_freed_and_reset_graphs_lose_their_copies():
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.set_sites({100: False})
    gone = captured(nodes, driver, 1, [(1, 100)])
    reset = captured(nodes, driver, 2, [(2, 100)])
    kept = captured(nodes, driver, 3, [(3, 100)])
    copies = {g: nodes.launch_for(g) for g in (reset, kept)}
    del gone
    gc.collect()
    assert len(driver.destroyed) == 1 and nodes.status()["graphs"] == 2
    nodes.forget(reset)
    assert driver.destroyed[-1] == copies[reset] and nodes.launch_for(reset) is None
    assert nodes.launch_for(kept) == copies[kept]
    assert nodes.status()["graphs"] == 1


def test_without_a_driver_nothing_is_noted_or_copied():
    nodes = GraphNodes(None)
    nodes.note_launch(100, stream=1)
    graph = FakeGraph()
    nodes.adopt(graph, 1)
    nodes.set_sites({100: False})
    assert nodes.launch_for(graph) is None
    assert nodes.status()["nodes"] == 0


class FakeTorchGraph:
    """torch.cuda.CUDAGraph's constructor, capture and replay methods."""

    # As torch's pybind class: __new__ ignores its arguments, __init__ takes keep_graph.
    def __new__(cls, *args, **kwargs):
        return super().__new__(cls)

    def __init__(self, keep_graph: bool = False):
        self.keep_graph, self.instantiated, self.was_reset = keep_graph, False, False
        self.replays = 0

    def capture_end(self):
        if not self.keep_graph:
            self.instantiate()  # torch then destroys the graph: its node handles dangle

    def instantiate(self):
        self.instantiated = True

    def raw_cuda_graph(self):
        assert self.keep_graph, "keep_graph must be True"
        return 1

    def replay(self):
        self.replays += 1

    def reset(self):
        self.was_reset = True


def test_kept_graph_keeps_its_graph_and_replays_from_the_copy_after_torchs_first_replay(
        monkeypatch):
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.set_sites({200: False})
    monkeypatch.setattr(graph_nodes, "_active", nodes)
    monkeypatch.setattr(graph_nodes, "_current_stream", lambda: 7)
    monkeypatch.setattr(graph_nodes, "_generator_offset", lambda: 0)
    kept = graph_nodes.kept_graph_class(FakeTorchGraph)
    graph = kept()  # vLLM's call: no arguments
    assert graph.keep_graph
    driver.capturing[7] = (1, [5])
    nodes.note_launch(200, stream=7)
    driver.capturing.clear()
    graph.capture_end()
    assert graph.instantiated
    graph.replay()  # torch's: the generator did not move
    assert graph.replays == 1 and driver.launched == []
    graph.replay()
    graph.replay()
    assert graph.replays == 1
    assert driver.launched == [(nodes.launch_for(graph), 7)] * 2
    assert driver.copies[nodes.launch_for(graph)] == (1, frozenset({5}))
    graph.reset()
    assert graph.was_reset and nodes.status()["graphs"] == 0 and driver.copies == {}


def test_kept_graph_that_draws_random_numbers_is_always_replayed_by_torch(monkeypatch):
    driver = FakeDriver()
    nodes = GraphNodes(driver)
    nodes.set_sites({200: False})
    offsets = itertools.count(0, 4)  # each torch replay advances the generator
    monkeypatch.setattr(graph_nodes, "_active", nodes)
    monkeypatch.setattr(graph_nodes, "_current_stream", lambda: 7)
    monkeypatch.setattr(graph_nodes, "_generator_offset", lambda: next(offsets))
    graph = graph_nodes.kept_graph_class(FakeTorchGraph)()
    driver.capturing[7] = (1, [5])
    nodes.note_launch(200, stream=7)
    driver.capturing.clear()
    graph.capture_end()
    for _ in range(3):
        graph.replay()
    assert graph.replays == 3 and driver.launched == [] and driver.copies == {}


@pytest.mark.parametrize("pinned", [set(), {100}])
def test_status_counts_only_left_out_nodes_of_graphs_that_replay_a_copy(pinned):
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned=pinned)
    graph = captured(nodes, driver, 1, [(1, 100), (2, 200)])
    nodes.set_sites({100: False, 200: False})
    assert nodes.status()["nodes_left_out"] == (1 if pinned else 2)
    assert left_out(nodes, driver, graph) == ({2} if pinned else {1, 2})


def test_replays_count_those_from_a_copy_and_the_idle_nodes_that_torchs_replays_ran(monkeypatch):
    driver = FakeDriver()
    nodes = GraphNodes(driver, pinned={400})  # the replay counter's site: its node always runs
    nodes.set_sites({200: False, 400: False})
    monkeypatch.setattr(graph_nodes, "_active", nodes)
    monkeypatch.setattr(graph_nodes, "_current_stream", lambda: 7)
    monkeypatch.setattr(graph_nodes, "_generator_offset", lambda: 0)
    graph = graph_nodes.kept_graph_class(FakeTorchGraph)()
    for node, key in [(8, 400), (5, 200), (6, 200), (7, 300)]:
        driver.capturing[7] = (1, [node])
        nodes.note_launch(key, stream=7)
    driver.capturing.clear()
    graph.capture_end()

    def counted():
        status = nodes.status()
        return status["copy_replays"], status["idle_nodes_replayed"], graph.replays

    graph.replay()  # torch's first: site 200's two nodes ran
    assert counted() == (0, 2, 1)
    graph.replay()
    graph.replay()
    assert counted() == (2, 2, 1)
    nodes.set_sites({200: True})  # every site on: torch's replay runs no idle node
    graph.replay()
    assert counted() == (2, 2, 2)
    nodes.set_sites({300: False})
    graph.replay()
    assert counted() == (3, 2, 2)
    driver.fail = True  # no copy without both sites: torch replays, their three nodes with it
    nodes.set_sites({200: False})
    graph.replay()
    assert counted() == (3, 5, 3)
