"""The capture calls awaited on vLLM's ``AsyncLLM`` (``vllm_capture.aio``), on the CPU engine with
the tiny Llama: rows of requests generated concurrently, equal to transformers' forward on the
same weights, and a worker's error raised as its type."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import vllm_capture as vc
from tests.engine_support import (
    ENGINE_KWARGS,
    HFReference,
    assert_close_rows,
    owner_of,
    random_prompt,
)
from vllm_capture import aio

pytestmark = pytest.mark.engine

NUM_LAYERS = 4
RTOL = ATOL = 1e-5  # as test_engine_dense.py


async def _generate(engine, prompt: list[int], request_id: str, max_tokens: int) -> list[int]:
    """Every token the request fed: the prompt, then each generated token but the last."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
        final = output
    assert final.finished
    return prompt + list(final.outputs[0].token_ids)[:-1]


async def _session(model_path) -> dict:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    rng = np.random.default_rng(21)
    prompts = [random_prompt(rng, n) for n in (6, 80, 30)]
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_path), enforce_eager=True, **ENGINE_KWARGS, **vc.engine_kwargs()))
    try:
        with pytest.raises(ValueError, match="^stream: unknown capture stream 'x'"):
            await aio.start_capture(engine, "x")
        status = await aio.start_capture(engine, vc.HIDDEN_STATES, reduce="all")
        assert status["enabled"] and sorted(status["layouts"]) == list(range(NUM_LAYERS))
        fed = await asyncio.gather(*(_generate(engine, p, f"r{i}", 4)
                                     for i, p in enumerate(prompts)))
        stored = (await aio.capture_status(engine, vc.HIDDEN_STATES))["tokens_stored"]
        first = await aio.fetch_captured(engine, vc.HIDDEN_STATES, req_ids=["r0"])
        rest = await aio.fetch_captured(engine, vc.HIDDEN_STATES)
        await aio.clear_captured(engine, vc.HIDDEN_STATES)
        await aio.stop_capture(engine, vc.HIDDEN_STATES)
        after = await aio.capture_status(engine, vc.HIDDEN_STATES, all_ranks=True)
    finally:
        engine.shutdown()
    return dict(fed=fed, stored=stored, first=first, rest=rest, after=after)


def test_awaited_calls_on_an_async_engine(tiny_model):
    model_path = tiny_model("llama")
    got = asyncio.run(_session(model_path))
    fed = got["fed"]
    assert got["stored"] == sum(len(f) for f in fed)
    assert [r["enabled"] for r in got["after"]] == [False]
    hf = HFReference(model_path)
    for part, request_ids in ((got["first"], ["r0"]), (got["rest"], ["r1", "r2"])):
        tensors, meta, _ = part
        assert sorted(tensors) == list(range(NUM_LAYERS))
        for layer in range(NUM_LAYERS):
            owner = owner_of(meta[layer], request_ids)
            assert (owner >= 0).all()
            for i, rid in enumerate(request_ids):
                f = fed[int(rid[1:])]
                rows = np.flatnonzero(owner == i)
                positions = meta[layer].positions[rows].long()
                assert positions.tolist() == list(range(len(f)))
                assert meta[layer].token_ids[rows].tolist() == f
                assert_close_rows(tensors[layer][rows], hf.run(f)["hidden_states"][layer][positions],
                                  rtol=RTOL, atol=ATOL, what=f"layer {layer} request {rid}")
