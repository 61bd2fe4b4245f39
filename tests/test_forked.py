"""Hidden-state kernels forked off a FULL graph's critical path (capture_graph/forked.py).

The fork itself needs CUDA graphs; here: the fork/join bookkeeping against stand-in streams, the
instrumented layers' joins (each layer joins the site before it with that site's own tensors,
after its own work), and a CPU engine built with the option, whose rows match transformers'.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from vllm_capture.capture_graph.forked import ForkedLaunches
from vllm_capture.capture_graph.state import CaptureGraphState
from vllm_capture.engine.instrument import find_targets, instrument
from vllm_capture.kernels import ops
from vllm_capture.session.components import HIDDEN_STATES

from tests.engine_support import (
    FidelityReport,
    HFReference,
    assert_close_rows,
    compare_with_hf,
    fed_tokens,
    make_llm,
    shutdown_llm,
    tokens_prompt,
)


class _Streams:
    """Stands in for CudaStreams: records the stream operations in order."""

    def __init__(self):
        self.log: list[str] = []
        self.current = "main"

    def fork(self):
        self.log.append("fork")

    def on_side(self):
        streams = self

        class _Side:
            def __enter__(self):
                streams.current = "side"

            def __exit__(self, *exc):
                streams.current = "main"

        return _Side()

    def join(self):
        self.log.append("join")


def test_a_fork_happens_only_in_a_full_graph_capture_and_is_joined_once():
    streams, full = _Streams(), [False]
    forks = ForkedLaunches(streams, in_full_capture=lambda: full[0])
    x, res = torch.zeros(4, 3), torch.ones(4, 3)
    launched_on = []

    def launch():
        launched_on.append(streams.current)

    # Eager steps and piecewise captures: the caller launches on its own stream.
    assert forks.launch(1, x, res, launch) is False and launched_on == [] and forks.pending == 0
    full[0] = True
    assert forks.launch(1, x, res, launch) is True
    assert launched_on == ["side"] and streams.log == ["fork"] and forks.pending == 1
    forks.join(2, x, res)  # another site: nothing forked there
    assert streams.log == ["fork"]
    forks.join(1, x, res)
    assert streams.log == ["fork", "join"] and forks.pending == 0
    forks.join(1, x, res)  # joined already
    assert streams.log == ["fork", "join"]
    forks.launch(3, x, None, launch)
    forks.reset()
    assert forks.pending == 0


def test_a_join_with_other_tensors_than_the_forked_kernels_raises_and_still_joins():
    streams = _Streams()
    forks = ForkedLaunches(streams, in_full_capture=lambda: True)
    x, res = torch.zeros(4, 3), torch.ones(4, 3)
    forks.launch(1, x, res, lambda: None)
    with pytest.raises(RuntimeError, match="fork_hidden_states"):
        forks.join(1, x.clone(), res)
    assert streams.log == ["fork", "join"]
    forks.launch(1, x, None, lambda: None)
    with pytest.raises(RuntimeError, match="next layer's inputs"):
        forks.join(1, x, res)


def test_only_a_full_graph_capture_forks_as_vllms_forward_context_says():
    from vllm.config import CUDAGraphMode, VllmConfig
    from vllm.forward_context import set_forward_context

    from vllm_capture.capture_graph.forked import in_full_graph_capture

    assert in_full_graph_capture() is False  # outside any forward
    config = VllmConfig()
    for mode, forks in ((CUDAGraphMode.NONE, False), (CUDAGraphMode.PIECEWISE, False),
                        (CUDAGraphMode.FULL, True)):
        with set_forward_context(None, config, cudagraph_runtime_mode=mode):
            assert in_full_graph_capture() is forks, mode


class _Attention(nn.Module):
    pass


class _DecoderLayer(nn.Module):
    """vLLM's decoder-layer call: (positions, hidden_states, residual) -> (hidden, residual)."""

    def __init__(self, scale: float):
        super().__init__()
        self.self_attn = _Attention()
        self.scale = scale

    def forward(self, positions, hidden_states, residual):
        residual = hidden_states if residual is None else hidden_states + residual
        return residual * self.scale, residual


class _Model(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(_DecoderLayer(1.0 + i) for i in range(n))

    def forward(self, positions, hidden_states):
        residual = None
        for i, layer in enumerate(self.layers):
            if i % 2:  # by keyword in odd layers, as some models call them
                hidden_states, residual = layer(positions, hidden_states=hidden_states,
                                                residual=residual)
            else:
                hidden_states, residual = layer(positions, hidden_states, residual)
        return hidden_states + residual


def test_each_layer_joins_the_site_before_it_with_that_sites_tensors_after_its_own_work():
    ops.register_op()
    model = _Model(4)
    state = CaptureGraphState(device=torch.device("cpu"), capacity=8, acc_slots=2)
    targets = [t for t in find_targets(model, 3, torch.float32) if t.component == HIDDEN_STATES]
    assert [t.layer_id for t in targets] == [0, 1, 2, 3]
    instrument(targets, state.add_site, fork_site=state.fork_site)
    layer_of = {s.counter.data_ptr(): s.layer_id for s in state.sites.values()}
    # Every site but the last forks: the next layer joins it.
    assert [s.fork for s in state.sites_of(HIDDEN_STATES)] == [True, True, True, False]
    calls = []
    ops.set_site_handler(
        lambda x, res, site: calls.append(("capture", layer_of[site.data_ptr()], x, res)),
        join=lambda x, res, site: calls.append(("join", layer_of[site.data_ptr()], x, res)))
    try:
        model(torch.arange(2), torch.randn(2, 3))
    finally:
        ops.set_site_handler(None)
    assert [(kind, layer) for kind, layer, *_ in calls] == [
        ("capture", 0), ("join", 0), ("capture", 1), ("join", 1), ("capture", 2),
        ("join", 2), ("capture", 3)]
    captured = {layer: (x, res) for kind, layer, x, res in calls if kind == "capture"}
    for kind, layer, x, res in calls:
        if kind == "join":
            assert x is captured[layer][0] and res is captured[layer][1]


def test_without_the_option_no_layer_joins():
    ops.register_op()
    model = _Model(3)
    state = CaptureGraphState(device=torch.device("cpu"), capacity=8, acc_slots=2)
    instrument(find_targets(model, 3, torch.float32), state.add_site)
    assert not any(s.fork for s in state.sites.values())
    joins = []
    ops.set_site_handler(lambda *a: None, join=lambda *a: joins.append(a))
    try:
        model(torch.arange(2), torch.randn(2, 3))
    finally:
        ops.set_site_handler(None)
    assert joins == []


@pytest.mark.engine
def test_an_engine_built_to_fork_captures_rows_as_transformers_computes_them(tiny_model):
    """On the CPU nothing forks (no CUDA graphs), but the joins are traced into the compiled
    model: its rows must stay those of transformers' forward, every layer."""
    path = tiny_model("llama")
    t0 = time.perf_counter()
    llm, _ = make_llm(path, capture_fork_hidden_states=True)
    try:
        prompts = [[10, 11, 12, 13, 14], list(range(20, 90))]
        from vllm_capture.api import capture

        res = capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=4, ignore_eos=True)
        assert sorted(res.layers) == [0, 1, 2, 3]
        fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
        report, checks = FidelityReport("forked_llama", notes={"fork_hidden_states": True}), []
        compare_with_hf(res, prompts, fed, HFReference(path), "hidden_states", 4, report, checks)
        assert len(checks) == 2 * 4
        for got, want, what in checks:  # test_engine_dense.py's tolerances
            assert_close_rows(got, want, rtol=1e-5, atol=1e-5, what=what)
    finally:
        shutdown_llm(llm)
    print(f"\n[engine forked] {time.perf_counter() - t0:.1f} s")
