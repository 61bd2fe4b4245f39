"""Shared helpers for the tests that start a real vLLM engine (CPU, float32).

Nothing here imports ``vllm_capture.selection``: the brute-force row selection
(``tests/select_reference.py``) is written from the SelectSpec rules (docs/architecture.md, the
spec's field reference), so it checks the planner instead of repeating it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from tests.select_reference import selected_positions

# Engine geometry shared by the engine test modules. A small token budget per step makes every
# prompt longer than 64 tokens a chunked prefill; a small block makes prefix-cache hits happen
# on prompts of a few dozen tokens (prefix caching stays at vLLM's default: on).
MAX_MODEL_LEN = 256
MAX_BATCHED_TOKENS = 64
BLOCK_SIZE = 32
ENGINE_KWARGS = dict(
    dtype="float32",
    max_model_len=MAX_MODEL_LEN,
    max_num_batched_tokens=MAX_BATCHED_TOKENS,
    max_num_seqs=16,
    block_size=BLOCK_SIZE,
    seed=0,
)

# The tiny models' word-level tokenizer has 100 entries; ids 0..3 are specials.
FIRST_WORD_ID = 4
TOKENIZER_VOCAB = 100

COMPONENT_NAMES = ("hidden_states", "attention_heads", "router_logits")


# ---- engine -------------------------------------------------------------------------------------

def make_llm(path: str | os.PathLike, **overrides):
    """A capture-ready engine on the tiny checkpoint at ``path``; returns (llm, start-up s)."""
    import vllm_capture

    kwargs = {**ENGINE_KWARGS, **overrides}
    t0 = time.perf_counter()
    llm = vllm_capture.LLM(str(path), **kwargs)
    return llm, time.perf_counter() - t0


def shutdown_llm(llm) -> None:
    """Stop the engine's processes now, so the next module's engine has the machine to itself."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # pragma: no cover - best effort at teardown
        pass
    del llm
    gc.collect()


def generate_together(llm, prompts, params):
    """``llm.generate`` with every request in the scheduler before its first step, so that two
    calls on the same prompts run the same steps. A plain ``generate`` sends the requests one by
    one while the engine core already steps: its first steps hold those that arrived by then,
    and a row's value depends on the batch it ran in (session 52, ``tests/gpu/gpu_checks.py``
    on an H100: a layer subset's bf16 rows up to 0.0625 off the full run's, one batch apart).
    The scheduler is paused (vLLM's ``pause_scheduler``, mode "keep": requests queue, no step
    runs) while the requests are sent, and resumed by a message sent right after the last of
    them, from the same thread (a ZMQ socket takes one sender at a time). An in-process engine
    adds them all before stepping anyway."""
    core = llm.llm_engine.engine_core
    if not hasattr(core, "call_utility"):  # InprocClient
        return llm.generate(prompts, params, use_tqdm=False)
    add_request, sent = core.add_request, []

    def add_then_resume(request) -> None:
        add_request(request)
        sent.append(request.request_id)
        if len(sent) == len(prompts):
            core.call_utility("resume_scheduler")

    core.call_utility("pause_scheduler", "keep", False)
    core.add_request = add_then_resume
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        del core.add_request
        if len(sent) < len(prompts):  # generate failed before its last request
            core.call_utility("resume_scheduler")


# ---- prompts ------------------------------------------------------------------------------------

def random_prompt(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(FIRST_WORD_ID, TOKENIZER_VOCAB, size=length).tolist()


def tokens_prompt(ids: Sequence[int]) -> dict:
    return {"prompt_token_ids": [int(t) for t in ids]}


def fed_tokens(prompt_ids: Sequence[int], output) -> list[int]:
    """Every token the engine fed for a finished request: the prompt, then each generated token
    except the last (sampled, never fed back)."""
    gen = list(output.outputs[0].token_ids)
    return list(prompt_ids) + gen[:-1]


# ---- Hugging Face reference ---------------------------------------------------------------------

class HFReference:
    """transformers' own forward on the same checkpoint, float32, eager attention.

    ``run(tokens)`` returns ``{component: {layer: Tensor[len(tokens), width]}}`` collected with
    hooks: a decoder layer's first output (the residual stream after the layer; HF's
    ``output_hidden_states[-1]`` is post-final-norm, so hidden states come from hooks), the input
    of each ``self_attn.o_proj`` and, for MoE layers, the gate's first output (router logits).
    """

    def __init__(self, path: str | os.PathLike):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            str(path), torch_dtype=torch.float32, attn_implementation="eager")
        self.model.eval()
        self._cache: dict[tuple[int, ...], dict] = {}
        self.layers = list(self.model.model.layers)

    @staticmethod
    def _gate(layer):
        for block_name in ("mlp", "block_sparse_moe", "moe"):
            block = getattr(layer, block_name, None)
            if block is not None and hasattr(block, "gate") and hasattr(block, "experts"):
                return block.gate
        return None

    def run(self, tokens: Sequence[int]) -> dict[str, dict[int, torch.Tensor]]:
        key = tuple(int(t) for t in tokens)
        if key in self._cache:
            return self._cache[key]
        out: dict[str, dict[int, torch.Tensor]] = {c: {} for c in COMPONENT_NAMES}
        handles = []

        def first(x):
            return x[0] if isinstance(x, (tuple, list)) else x

        for i, layer in enumerate(self.layers):
            def hidden_hook(mod, args, output, i=i):
                out["hidden_states"][i] = first(output)[0].detach().clone()

            def heads_hook(mod, args, i=i):
                out["attention_heads"][i] = args[0][0].detach().clone()

            handles.append(layer.register_forward_hook(hidden_hook))
            handles.append(layer.self_attn.o_proj.register_forward_pre_hook(heads_hook))
            gate = self._gate(layer)
            if gate is not None:
                def gate_hook(mod, args, output, i=i):
                    logits = first(output)
                    out["router_logits"][i] = logits.reshape(len(key), -1).detach().clone()

                handles.append(gate.register_forward_hook(gate_hook))
        try:
            with torch.inference_mode():
                self.model(input_ids=torch.tensor([key], dtype=torch.long), use_cache=False)
        finally:
            for h in handles:
                h.remove()
        out = {c: v for c, v in out.items() if v}
        self._cache[key] = out
        return out


# ---- fidelity bookkeeping -----------------------------------------------------------------------

@dataclass
class ErrorStats:
    rows: int = 0
    max_abs: float = 0.0
    # max over rows of max|captured - reference| / max|reference| (row-normalised)
    max_rel: float = 0.0
    max_ref: float = 0.0

    def add(self, captured: torch.Tensor, reference: torch.Tensor) -> None:
        captured = captured.to(torch.float64)
        reference = reference.to(torch.float64)
        diff = (captured - reference).abs()
        if diff.numel() == 0:
            return
        scale = reference.abs().amax(dim=-1).clamp(min=1e-30)
        self.rows += int(captured.shape[0])
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float((diff.amax(dim=-1) / scale).max()))
        self.max_ref = max(self.max_ref, float(reference.abs().max()))


@dataclass
class FidelityReport:
    """Collects errors per component (and per component x phase) and writes them out."""

    name: str
    stats: dict[str, ErrorStats] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, captured: torch.Tensor, reference: torch.Tensor) -> None:
        self.stats.setdefault(key, ErrorStats()).add(captured, reference)

    def as_dict(self) -> dict:
        return {"name": self.name, "device": "cpu", "dtype": "float32", **self.notes,
                "components": {k: vars(v) for k, v in sorted(self.stats.items())}}

    def emit(self) -> None:
        print(f"\n[fidelity {self.name}] vs Hugging Face transformers (CPU, float32)")
        for key, s in sorted(self.stats.items()):
            print(f"  {key:32s} rows={s.rows:5d}  max_abs={s.max_abs:.3e}  "
                  f"max_rel={s.max_rel:.3e}  max|ref|={s.max_ref:.3g}")
        write_report(f"fidelity_{self.name}", self.as_dict())


def compare_with_hf(result, prompts, fed, hf: "HFReference", stream: str, num_layers: int,
                    report: "FidelityReport", checks: list, what: str = "",
                    per_layer: bool = False) -> None:
    """Pair every captured row of ``stream`` with HF's row at the same absolute position.

    Errors go to ``report`` (all rows, prompt rows, generated rows); the pairs are appended to
    ``checks`` as ``(got, want, label)`` for the caller's tolerance assertion.
    """
    for i, (p, f) in enumerate(zip(prompts, fed)):
        ref = hf.run(f)[stream]
        pos = result.sample_positions(i).long()
        for layer in range(num_layers):
            got, want = result.sample_rows(i, layer), ref[layer][pos]
            prompt_rows = pos < len(p)
            report.add(stream, got, want)
            report.add(f"{stream}/prompt", got[prompt_rows], want[prompt_rows])
            report.add(f"{stream}/generation", got[~prompt_rows], want[~prompt_rows])
            if per_layer:
                report.add(f"{stream}/layer{layer}", got, want)
            checks.append((got, want, f"{what}{stream} prompt {i} (len {len(p)}) layer {layer}"))


def write_report(name: str, data: dict) -> None:
    """Write ``data`` as JSON under ``$VLLM_CAPTURE_TEST_REPORT`` (if set)."""
    folder = os.environ.get("VLLM_CAPTURE_TEST_REPORT")
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.json").write_text(json.dumps(data, indent=1, sort_keys=True))


def assert_close_rows(captured: torch.Tensor, reference: torch.Tensor, *, rtol: float,
                      atol: float, what: str) -> None:
    """Elementwise |c - r| <= atol + rtol * |r|, with atol scaled by the row's magnitude."""
    captured = captured.to(torch.float64)
    reference = reference.to(torch.float64)
    assert captured.shape == reference.shape, f"{what}: shape {captured.shape} vs {reference.shape}"
    scale = reference.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
    bound = atol * scale + rtol * reference.abs()
    bad = (captured - reference).abs() > bound
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        raise AssertionError(
            f"{what}: {int(bad.sum())} element(s) out of tolerance; first at row {r} col {c}: "
            f"captured {float(captured[r, c])!r} reference {float(reference[r, c])!r} "
            f"(max abs err {float((captured - reference).abs().max()):.3e})")


# ---- brute-force SelectSpec evaluation ----------------------------------------------------------

def brute_force_positions(wire: dict | None, prompt_ids: Sequence[int],
                          gen_fed: Sequence[int]) -> set[int]:
    """Absolute positions a SelectSpec wire dict selects for one request (``None``: every row)."""
    return selected_positions(wire, prompt_ids, gen_fed)


def wire_of(spec) -> dict | None:
    if spec is None or isinstance(spec, dict):
        return spec
    return spec.to_wire()


# ---- label checks -------------------------------------------------------------------------------

def owner_of(meta, request_ids: Sequence[str]) -> np.ndarray:
    """Index into ``request_ids`` of each row's owner (-1: none), via match_capture_request_id."""
    from vllm_capture import match_capture_request_id

    owner = np.full(len(meta.req_ids), -1, dtype=np.int64)
    for j, rid in enumerate(meta.req_ids):
        hits = [i for i, client in enumerate(request_ids) if match_capture_request_id(rid, client)]
        assert len(hits) <= 1, f"row label {rid!r} matches several requests {hits}"
        if hits:
            owner[j] = hits[0]
    return owner


def check_result_labels(result, fed: Sequence[Sequence[int]],
                        expected_positions: Sequence[Iterable[int]] | None = None) -> None:
    """Every prompt's rows of every layer: right owner, sorted unique positions, right token ids,
    and (when given) exactly the expected positions."""
    from vllm_capture import match_capture_request_id

    n = len(fed)
    assert len(result.offsets) == n + 1, (len(result.offsets), n)
    for layer in result.layers:
        meta = result.meta(layer)
        assert len(meta) == result.layers[layer].shape[0]
        for i in range(n):
            lo, hi = result.offsets[i], result.offsets[i + 1]
            rid = result.outputs[i].request_id
            assert all(match_capture_request_id(r, rid) for r in meta.req_ids[lo:hi]), \
                f"layer {layer} prompt {i}: rows labelled with another request"
            pos = meta.positions[lo:hi].tolist()
            assert pos == sorted(set(pos)), f"layer {layer} prompt {i}: positions {pos}"
            toks = meta.token_ids[lo:hi].tolist()
            want = [fed[i][p] for p in pos]
            assert toks == want, f"layer {layer} prompt {i}: token ids {toks} != {want}"
            if expected_positions is not None:
                exp = sorted(set(expected_positions[i]))
                assert pos == exp, (f"layer {layer} prompt {i}: captured positions {pos} != "
                                    f"brute force {exp}")
