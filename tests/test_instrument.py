"""Where capture finds its call sites in a model (engine/instrument.py's find_targets), on stand-in
modules shaped like vLLM's: the attributes it reads are the ones vLLM's classes carry."""

import numpy as np
import pytest
import torch
from torch import nn

from vllm_capture.capture_graph.state import CaptureGraphState
from vllm_capture.engine.instrument import (LAST_DEST_BUFFER, LAST_ROWS_BUFFER, SITE_BUFFER, Target,
                                            find_targets, instrument)
from vllm_capture.kernels import ops
from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES, ROUTER_LOGITS


class _OProj(nn.Linear):
    """A RowParallelLinear's input width on this rank."""

    def __init__(self, width):
        super().__init__(width, 8)
        self.input_size_per_partition = width


class _Attention(nn.Module):
    def __init__(self, width, **heads):
        super().__init__()
        self.o_proj = _OProj(width)
        for name, value in heads.items():
            setattr(self, name, value)


class _DecoderLayer(nn.Module):
    def __init__(self, width=64, **heads):
        super().__init__()
        self.self_attn = _Attention(width, **({"num_heads": 4, "head_dim": width // 4} | heads))


class _MambaLayer(nn.Module):  # a hybrid model's layer without attention (Jamba, Qwen3-Next)
    def __init__(self):
        super().__init__()
        self.mixer = nn.Linear(8, 8)


class _Decoder(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)


class _CausalLM(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.model = _Decoder(layers)


class _VisionTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = _Decoder([_DecoderLayer(width=32) for _ in range(2)])


def _sites(targets, component):
    return [(t.layer_id, t.name) for t in targets if t.component == component]


def test_a_multimodal_models_vision_tower_is_left_out():
    class Gemma3Like(nn.Module):
        def __init__(self):
            super().__init__()
            self.vision_tower = _VisionTower()  # built first, as in gemma3_mm.py
            self.language_model = _CausalLM([_DecoderLayer() for _ in range(2)])

        def get_language_model(self):
            return self.language_model

    targets = find_targets(Gemma3Like(), 64, torch.bfloat16)
    assert _sites(targets, HIDDEN_STATES) == [(0, "language_model.model.layers.0"),
                                             (1, "language_model.model.layers.1")]
    assert {t.width for t in targets} == {64}


def test_two_layer_stacks_the_model_does_not_tell_apart_are_refused():
    class EncoderDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = _Decoder([_DecoderLayer() for _ in range(2)])
            self.decoder = _Decoder([_DecoderLayer() for _ in range(2)])

    with pytest.raises(ValueError, match=r"hidden_states layer 0 found twice, at encoder\.layers"
                                         r"\.0 and decoder\.layers\.0"):
        find_targets(EncoderDecoder(), 64, torch.bfloat16)


def test_a_hybrid_models_layers_without_attention_are_decoder_layers_too():
    model = _CausalLM([_DecoderLayer(), _MambaLayer(), _MambaLayer(), _DecoderLayer()])
    targets = find_targets(model, 64, torch.bfloat16)
    assert [layer for layer, _ in _sites(targets, HIDDEN_STATES)] == [0, 1, 2, 3]
    assert [layer for layer, _ in _sites(targets, ATTENTION_HEADS)] == [0, 3]


@pytest.mark.parametrize("width, heads, layout", [
    # Llama at tensor-parallel size 2: num_heads is this rank's.
    (64, {"num_heads": 2, "head_dim": 32}, (2, 32)),
    # DeepSeek-V2 at size 2: num_heads is the total, num_local_heads this rank's, values of
    # v_head_dim each (MLA: head_dim is not set).
    (64, {"num_heads": 4, "num_local_heads": 2, "v_head_dim": 32, "head_dim": None}, (2, 32)),
    (64, {"num_heads": 4, "num_local_heads": 2, "head_dim": None}, (2, 32)),
    # CLIP-like: the rank's count in num_heads_per_partition.
    (64, {"num_heads": 8, "num_heads_per_partition": 4, "head_dim": None}, (4, 16)),
])
def test_heads_layout_is_this_ranks(width, heads, layout):
    model = _CausalLM([_DecoderLayer(width=width, **heads)])
    (target,) = [t for t in find_targets(model, 128, torch.bfloat16)
                 if t.component == ATTENTION_HEADS]
    assert (target.layout["num_heads"], target.layout["head_size"]) == layout
    assert target.layout["width"] == target.width == width


class _ReplicatedLinear(nn.Linear):
    """vLLM's linear layers carry their output width as output_size; their weights are in the
    model's dtype unless the model asks for another (Ernie-4.5-MoE's float32 gate), or quantized."""

    def __init__(self, width, experts, dtype=torch.bfloat16):
        super().__init__(width, experts, dtype=dtype)
        self.output_size = experts


def _quantized_gate(width, experts):
    gate = _ReplicatedLinear(width, experts)
    gate.weight = nn.Parameter(torch.zeros(experts, width, dtype=torch.int8), requires_grad=False)
    return gate


class _MoE(nn.Module):
    def __init__(self, router_name, router):
        super().__init__()
        setattr(self, router_name, router)
        self.experts = nn.Module()


class _MoELayer(_DecoderLayer):
    def __init__(self, block_name, router_name, router):
        super().__init__()
        setattr(self, block_name, _MoE(router_name, router))


@pytest.mark.parametrize("block_name, router_name, router, dtype", [
    ("mlp", "gate", _ReplicatedLinear(64, 8), torch.bfloat16),  # Mixtral, Qwen-MoE
    ("mlp", "gate", nn.Linear(64, 8, dtype=torch.float32), torch.float32),  # GLM-4-MoE
    ("mlp", "router", _ReplicatedLinear(64, 8), torch.bfloat16),  # GPT-OSS
    ("feed_forward", "router", _ReplicatedLinear(64, 8), torch.bfloat16),  # Llama 4
    ("mlp", "gate", _ReplicatedLinear(64, 8, dtype=torch.float32), torch.float32),  # Ernie-4.5
    ("mlp", "gate", _quantized_gate(64, 8), torch.bfloat16),  # an int8 gate returns the model's
])
def test_routers_are_found_by_either_name_beside_the_experts(block_name, router_name, router,
                                                              dtype):
    model = _CausalLM([_MoELayer(block_name, router_name, router)])
    (target,) = [t for t in find_targets(model, 64, torch.bfloat16)
                 if t.component == ROUTER_LOGITS]
    assert target.name == f"model.layers.0.{block_name}.{router_name}"
    assert target.module is router
    assert (target.width, target.dtype) == (8, dtype)


class _ReturnsTuple(nn.Module):
    """A decoder layer that returns what it is given: vLLM's return (hidden, residual), HunYuan's
    (hidden, residual, kv states), Gemma-3n's one [inputs, tokens, hidden] tensor."""

    def forward(self, out):
        return out


@pytest.fixture
def op_calls(monkeypatch):
    ops.register_op()
    calls = []
    monkeypatch.setattr(ops, "_handler", lambda x, residual, site: calls.append((x, residual)))
    return calls


def _captured_layer(state: CaptureGraphState | None = None, width: int = 4):
    state = state or CaptureGraphState(device=torch.device("cpu"), capacity=8, acc_slots=4)
    layer = _ReturnsTuple()
    instrument([Target(HIDDEN_STATES, 0, "model.layers.0", layer, width, torch.bfloat16,
                       {"width": width})], state)
    return layer


@pytest.mark.parametrize("extra", [(), (torch.ones(3, 4),)])
def test_hidden_states_are_the_layers_output_plus_its_residual_whatever_follows(op_calls, extra):
    hidden, residual = torch.randn(3, 4), torch.randn(3, 4)
    out = (hidden, residual, *extra)
    assert _captured_layer()(out) is out
    ((x, res),) = op_calls
    assert x is hidden and res is residual


def test_a_layer_without_residual_is_captured_as_it_returns(op_calls):
    hidden = torch.randn(3, 4)
    _captured_layer()((hidden, None))
    _captured_layer()(hidden)
    assert [(x is hidden, res) for x, res in op_calls] == [(True, None), (True, None)]


def test_hidden_states_of_another_shape_are_refused_with_the_component_to_leave_out(op_calls):
    with pytest.raises(ValueError, match=r"shaped \(4, 3, 8\).*capture_components"):
        _captured_layer()(torch.randn(4, 3, 8))
    assert op_calls == []


def test_an_eager_layer_stores_its_last_rows_only_while_a_stream_reads_them(op_calls):
    """Eager, the hook stores each token's residual stream at its ``dest`` row only while a
    ``last`` stream is on (traced, it always stores: Dynamo sees ``is_compiling()``)."""
    state = CaptureGraphState(device=torch.device("cpu"), capacity=8, acc_slots=4)
    layer = _captured_layer(state, width=3)
    state.allocate()
    (site,) = state.sites_of(HIDDEN_STATES)
    plan = state.last_row_plans[HIDDEN_STATES]
    assert getattr(layer, SITE_BUFFER) is site.counter
    assert getattr(layer, LAST_ROWS_BUFFER) is site.last_rows
    assert getattr(layer, LAST_DEST_BUFFER) is plan.dest
    hidden = torch.randn(5, 3, dtype=torch.bfloat16)
    residual = torch.randn(5, 3, dtype=torch.bfloat16)
    segments = (np.array([0, 2]), np.array([2, 3]), np.array([3, 1]))  # starts, counts, slots

    plan.point(*segments)  # a plan, but no stream reads the rows
    layer((hidden, residual))
    assert not site.last_rows.any()

    state.set_enabled(HIDDEN_STATES, None, last=True)
    plan.point(*segments)
    layer((hidden, residual))
    expected = (hidden.float() + residual.float()).to(torch.bfloat16)
    assert torch.equal(site.last_rows[3], expected[1])
    assert torch.equal(site.last_rows[1], expected[4])
    assert not site.last_rows[[0, 2]].any()
