"""Client-side join of tensor-parallel capture shards (synthetic per-rank payloads, no engine)."""

import pytest
import torch

from vllm_capture.api import join_shards
from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES
from vllm_capture.session.wire import serialize_capture_layer

HEADS, HEAD_SIZE, ROWS = 8, 4, 6


def _meta(rows=ROWS, shift=0):
    return torch.tensor([[i % 2, i + shift, 100 + i] for i in range(rows)], dtype=torch.int32)


def _reply(rank, tp, layers, full, meta=None, stream=ATTENTION_HEADS):
    """What rank ``rank`` of a TP=``tp`` engine returns for ``full`` [rows, HEADS*HEAD_SIZE]."""
    per = HEADS // tp
    out = {}
    for layer in layers:
        if stream == ATTENTION_HEADS:
            shard = full[layer][:, rank * per * HEAD_SIZE:(rank + 1) * per * HEAD_SIZE].contiguous()
            layout = {"width": per * HEAD_SIZE, "num_heads": per, "head_size": HEAD_SIZE}
        else:
            shard, layout = full[layer], {"width": full[layer].shape[1]}
        wire = serialize_capture_layer(shard, _meta() if meta is None else meta,
                                       ["a-0123abcd", "b-89abcdef"], f"layers.{layer}")
        wire["layout"] = layout
        out[str(layer)] = wire
    return {"tp_rank": rank, "tp_size": tp, "layers": out}


@pytest.fixture
def full():
    g = torch.Generator().manual_seed(0)
    return {layer: torch.randn(ROWS, HEADS * HEAD_SIZE, generator=g) for layer in (0, 3)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_heads_join_in_global_head_order(full, tp):
    replies = [_reply(r, tp, full, full) for r in reversed(range(tp))]  # any reply order
    tensors, meta, layouts = join_shards(ATTENTION_HEADS, replies)
    for layer in full:
        assert torch.equal(tensors[layer], full[layer])
        assert meta[layer].positions.tolist() == list(range(ROWS))
        assert layouts[layer]["width"] == HEADS * HEAD_SIZE
        assert layouts[layer]["num_heads"] == HEADS
        if tp > 1:
            assert layouts[layer]["heads_per_rank"] == [HEADS // tp] * tp


def test_replicated_components_come_from_rank_zero(full):
    replies = [_reply(r, 2, full, full, stream=HIDDEN_STATES) for r in (1, 0)]
    tensors, _, _ = join_shards(HIDDEN_STATES, replies)
    assert all(torch.equal(tensors[k], full[k]) for k in full)


def test_missing_rank_is_refused(full):
    with pytest.raises(RuntimeError, match=r"incomplete capture shards: ranks \[1\]"):
        join_shards(ATTENTION_HEADS, [_reply(0, 2, full, full)])


@pytest.mark.parametrize("rank0_layers, rank1_layers", [((0, 3), (0,)), ((0,), (0, 3))])
def test_a_layer_missing_on_one_rank_is_refused(full, rank0_layers, rank1_layers):
    replies = [_reply(0, 2, rank0_layers, full), _reply(1, 2, rank1_layers, full)]
    with pytest.raises(RuntimeError, match=r"incomplete capture shards: rank 1 holds rows of "
                                           rf"layers \[{', '.join(map(str, rank1_layers))}\]"):
        join_shards(ATTENTION_HEADS, replies)


def test_ranks_with_different_dtypes_are_refused(full):
    half = {layer: t.half() for layer, t in full.items()}
    replies = [_reply(0, 2, full, full), _reply(1, 2, full, half)]
    with pytest.raises(RuntimeError, match="layer 0 are torch.float32 on rank 0 and "
                                           "torch.float16 on rank 1"):
        join_shards(ATTENTION_HEADS, replies)


@pytest.mark.parametrize("column", [0, 1, 2])  # request, position, token id
def test_ranks_with_different_rows_are_refused(full, column):
    other = _meta()
    # The other of the table's two requests, or the next position or token id.
    other[:, column] = 1 - other[:, column] if column == 0 else other[:, column] + 1
    replies = [_reply(0, 2, full, full), _reply(1, 2, full, full, meta=other)]
    with pytest.raises(RuntimeError, match="different rows"):
        join_shards(ATTENTION_HEADS, replies)


def test_duplicate_rank_and_size_mismatch_are_refused(full):
    with pytest.raises(RuntimeError, match="twice"):
        join_shards(ATTENTION_HEADS, [_reply(0, 2, full, full), _reply(0, 2, full, full)])
    bad = _reply(1, 2, full, full)
    bad["tp_size"] = 4
    with pytest.raises(RuntimeError, match="tp_size"):
        join_shards(ATTENTION_HEADS, [_reply(0, 2, full, full), bad])
    with pytest.raises(RuntimeError, match="no worker"):
        join_shards(ATTENTION_HEADS, [])


class _FakeTPEngine:
    """Stands in for a vllm.LLM whose workers reply out of rank order."""

    def __init__(self, replies):
        self.replies = replies

    def collective_rpc(self, method, args=()):
        return list(self.replies)


def test_status_of_rank_zero_or_of_every_rank_in_rank_order():
    from vllm_capture.api import capture_status

    llm = _FakeTPEngine([{"tp_rank": 1, "tp_size": 2, "graph_replays": 7},
                         {"tp_rank": 0, "tp_size": 2, "graph_replays": 7}])
    assert [r["tp_rank"] for r in capture_status(llm, HIDDEN_STATES, all_ranks=True)] == [0, 1]
    assert capture_status(llm, HIDDEN_STATES)["tp_rank"] == 0
