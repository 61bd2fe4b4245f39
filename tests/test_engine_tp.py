"""Tensor parallelism on a real vLLM engine: the CPU engine at tensor_parallel_size=2 (two worker
processes, gloo), the tiny Llama and the tiny Qwen3-MoE, float32, eager.

Attention heads are sharded by head: each rank captures its two of the four heads, and the client
joins them in global head order; hidden states and router logits are replicated, and come from
rank 0 alone. Every row is checked against transformers' forward on the same weights, for every
row and for `last` reductions (reduced on each rank, then joined).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import vllm_capture as vc
from tests.engine_support import (
    FidelityReport,
    HFReference,
    assert_close_rows,
    check_result_labels,
    compare_with_hf,
    fed_tokens,
    make_llm,
    owner_of,
    random_prompt,
    shutdown_llm,
    tokens_prompt,
)

pytestmark = pytest.mark.engine

NUM_LAYERS = 4
HEADS, HEAD_SIZE = 4, 32
RTOL = ATOL = 1e-5  # as test_engine_dense.py

CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("llama")


def _tp2_engine(path):
    if len(CPUS) < 2:
        pytest.skip("tensor_parallel_size=2 on the CPU engine needs two CPUs, one per rank")
    with pytest.MonkeyPatch.context() as env:
        # One CPU per rank: vLLM's automatic binding wants a NUMA node per rank.
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", f"{CPUS[0]}|{CPUS[1]}")
        engine, _ = make_llm(path, tensor_parallel_size=2, enforce_eager=True)
    return engine


@pytest.fixture(scope="module")
def llm(model_path):
    engine = _tp2_engine(model_path)
    yield engine
    shutdown_llm(engine)


@pytest.fixture(scope="module")
def hf(model_path):
    return HFReference(model_path)


def _check_rows(res, prompts, hf, stream) -> None:
    fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
    check_result_labels(res, fed, [range(len(f)) for f in fed])
    assert sorted(res.layers) == list(range(NUM_LAYERS))
    checks: list = []
    compare_with_hf(res, prompts, fed, hf, stream, NUM_LAYERS, FidelityReport(f"tp2_{stream}"),
                    checks, what="tp=2 ")
    for got, want, what in checks:
        assert_close_rows(got, want, rtol=RTOL, atol=ATOL, what=what)


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_prompt(rng, n) for n in (5, 70, 33)]  # 70: a chunked prefill


@pytest.mark.parametrize("stream", [vc.ATTENTION_HEADS, vc.HIDDEN_STATES])
def test_every_row_of_each_stream_across_two_ranks(llm, hf, stream):
    prompts = _prompts(1)
    res = vc.capture(llm, [tokens_prompt(p) for p in prompts], stream=stream, max_tokens=3)
    _check_rows(res, prompts, hf, stream)
    if stream == vc.ATTENTION_HEADS:
        assert all(res.layouts[layer] == {"width": HEADS * HEAD_SIZE, "num_heads": HEADS,
                                          "head_size": HEAD_SIZE, "tp_size": 2,
                                          "heads_per_rank": [2, 2]}
                   for layer in range(NUM_LAYERS))
    ranks = vc.capture_status(llm, stream, all_ranks=True)
    assert [r["tp_rank"] for r in ranks] == [0, 1] and all(r["tp_size"] == 2 for r in ranks)


def test_last_reductions_of_head_shards_join(llm, hf):
    from vllm import SamplingParams

    prompts = _prompts(2)
    vc.start_capture(llm, vc.ATTENTION_HEADS, reduce="last", layers=[0, 3])
    try:
        outputs = llm.generate([tokens_prompt(p) for p in prompts],
                               SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
        tensors, meta, layouts = vc.fetch_captured(llm, vc.ATTENTION_HEADS)
    finally:
        vc.stop_capture(llm, vc.ATTENTION_HEADS)
    fed = [fed_tokens(p, o) for p, o in zip(prompts, outputs)]
    assert sorted(tensors) == [0, 3] and layouts[3]["heads_per_rank"] == [2, 2]
    for layer in (0, 3):
        owner = owner_of(meta[layer], [o.request_id for o in outputs])
        assert sorted(owner.tolist()) == [0, 1, 2]
        for row, i in enumerate(owner.tolist()):
            last = len(fed[i]) - 1
            assert int(meta[layer].positions[row]) == last
            assert_close_rows(tensors[layer][row:row + 1],
                              hf.run(fed[i])[vc.ATTENTION_HEADS][layer][last:last + 1],
                              rtol=RTOL, atol=ATOL, what=f"last, layer {layer} prompt {i}")


def test_router_logits_of_a_mixture_of_experts_across_two_ranks(tiny_model):
    """The experts are sharded across the ranks, the router is not: its logits come from rank 0."""
    path = tiny_model("qwen3_moe")
    engine = _tp2_engine(path)
    try:
        prompts = _prompts(3)
        res = vc.capture(engine, [tokens_prompt(p) for p in prompts], stream=vc.ROUTER_LOGITS,
                         max_tokens=3)
    finally:
        shutdown_llm(engine)
    _check_rows(res, prompts, HFReference(path), vc.ROUTER_LOGITS)
