"""What the benchmark suite measures, as data: models, workloads, engines, scenarios, suites.

Pure: no torch, no vLLM, no GPU. ``run.py`` turns these into engines and timed generates;
``report.py`` turns the measurements into ratios, pass/fail lines and files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

HIDDEN, HEADS, ROUTER = "hidden_states", "attention_heads", "router_logits"
# Bytes of one row's labels (req_idx, position, token id as int32) in the device ring.
LABEL_BYTES = 12
RING_SLOTS = 2


# ---- models ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """A model by shape. ``tiny`` names a ``vllm_capture.tiny_models`` checkpoint (real weights);
    otherwise the suite writes ``config()`` and runs it with ``load_format="dummy"``."""

    key: str
    label: str
    arch: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    tiny: str | None = None
    extra: dict = field(default_factory=dict, hash=False, compare=False)
    # Guesses of engine start-up seconds (graph, eager) on the H200, replaced by what the run sees.
    # Too high a guess skips engines that would have fitted the budget (8B at 170 s skipped both
    # engines of a 240 s run, 2026-11-30); measured 8B inits: graph 38-67 s, eager 25-40 s.
    startup_s: tuple[float, float] = (120.0, 60.0)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    def width(self, stream: str) -> int:
        """Elements of one captured row of ``stream`` in one layer."""
        return {HIDDEN: self.hidden, HEADS: self.heads * self.head_dim, ROUTER: self.experts}[stream]

    @property
    def weight_bytes(self) -> int:
        """Bytes of the bf16 weights (embeddings, attention, MLP or experts and gate)."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.moe:
            mlp = self.experts * 3 * self.hidden * self.moe_intermediate + self.hidden * self.experts
        else:
            mlp = 3 * self.hidden * self.intermediate
        tied = self.extra.get("tie_word_embeddings", False)
        return 2 * (self.vocab * self.hidden * (1 if tied else 2) + self.layers * (attn + mlp))

    def config(self) -> dict:
        """A Hugging Face config.json for this shape (dummy weights)."""
        cfg = {
            "architectures": [self.arch], "model_type": self.model_type,
            "hidden_size": self.hidden, "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim,
            "vocab_size": self.vocab, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16",
            # The copied tiny tokenizer's special ids; prompts are token ids and ignore_eos is on.
            "bos_token_id": 1, "eos_token_id": 2,
        }
        if self.moe:
            cfg.update(num_experts=self.experts, num_experts_per_tok=self.experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate, norm_topk_prob=True,
                       decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
        cfg.update(self.extra)
        return cfg


_LLAMA_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

_LLAMA_1B = ModelShape(
    "1b", "Llama-3.2-1B (dummy weights)", "LlamaForCausalLM", "llama",
    hidden=2048, layers=16, heads=32, kv_heads=8, head_dim=64, intermediate=8192,
    vocab=128256, startup_s=(80.0, 35.0),
    extra={"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
           "tie_word_embeddings": True, "rope_scaling": {**_LLAMA_ROPE, "factor": 32.0}})

MODELS: dict[str, ModelShape] = {m.key: m for m in (
    ModelShape("8b", "Llama-3.1-8B (dummy weights)", "LlamaForCausalLM", "llama",
               hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336,
               vocab=128256, startup_s=(100.0, 45.0),
               extra={"rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
                      "rope_scaling": {**_LLAMA_ROPE, "factor": 8.0}}),
    _LLAMA_1B,
    # The 1B's rows (16 layers of width 2,048) from a forward the CPU VM runs in seconds: its MLP
    # 128 wide. For host-path profiles there (extract_inputs.py, extract_profile.py): the fetch,
    # the store and the client handle as many bytes a row as on the GPU.
    replace(_LLAMA_1B, key="1b-rows", label="Llama-3.2-1B's rows, a 128-wide MLP (dummy weights)",
            intermediate=128),
    ModelShape("moe", "Qwen3-30B-A3B shape (dummy weights)", "Qwen3MoeForCausalLM", "qwen3_moe",
               hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128, intermediate=6144,
               vocab=151936, experts=128, experts_per_tok=8, moe_intermediate=768,
               startup_s=(220.0, 90.0),
               extra={"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                      "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48}),
    ModelShape("tiny", "tiny Llama (vllm_capture.tiny_models)", "LlamaForCausalLM", "llama",
               hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=512,
               tiny="llama", startup_s=(50.0, 30.0)),
    ModelShape("tiny-moe", "tiny Qwen3-MoE (vllm_capture.tiny_models)", "Qwen3MoeForCausalLM",
               "qwen3_moe", hidden=128, layers=4, heads=4, kv_heads=2, head_dim=32, intermediate=256,
               vocab=512, experts=4, experts_per_tok=2, moe_intermediate=64, tiny="qwen3_moe",
               startup_s=(60.0, 30.0)),
)}


def spread_layers(num_layers: int, k: int = 4) -> list[int]:
    """``k`` layers spread evenly from the first to the last (all of them if there are fewer)."""
    if num_layers <= k:
        return list(range(num_layers))
    return sorted({round(i * (num_layers - 1) / (k - 1)) for i in range(k)})


def ring_buffer_bytes(shape: ModelShape, rows_per_step: int, dtype_bytes: int = 2,
                      ring_slots: int = RING_SLOTS) -> int:
    """Device bytes that hold ``rows_per_step`` rows at every call site of every component.

    Router logits are counted at 4 bytes (an over-estimate if the gate runs in bf16). A margin
    keeps the engine's own rounding from dropping a row of a full step.
    """
    per_row = shape.layers * (shape.width(HIDDEN) * dtype_bytes + LABEL_BYTES)
    per_row += shape.layers * (shape.width(HEADS) * dtype_bytes + LABEL_BYTES)
    if shape.moe:
        per_row += shape.layers * (shape.width(ROUTER) * 4 + LABEL_BYTES)
    return int(per_row * ring_slots * rows_per_step * 1.05) + (16 << 20)


# ---- workloads -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    kind: str  # "decode" | "prefill"
    prompt_len: int
    new_tokens: int
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.kind}-c{self.concurrency}"

    @property
    def generated_tokens(self) -> int:
        return self.concurrency * self.new_tokens

    @property
    def positions_per_request(self) -> int:
        """Rows one request feeds through the model (the last sampled token is never fed back)."""
        return self.prompt_len + self.new_tokens - 1


def decode(concurrency: int, prompt_len: int = 32, new_tokens: int = 256) -> Workload:
    return Workload("decode", prompt_len, new_tokens, concurrency)


def prefill(concurrency: int, prompt_len: int = 2048, new_tokens: int = 8) -> Workload:
    return Workload("prefill", prompt_len, new_tokens, concurrency)


# ---- engines and scenarios ----------------------------------------------------------------------

@dataclass(frozen=True)
class Engine:
    name: str
    capture: bool
    eager: bool


ENGINES: dict[str, Engine] = {e.name: e for e in (
    Engine("vanilla-graph", capture=False, eager=False),   # the baseline
    Engine("vanilla-graph-b", capture=False, eager=False),  # the control: a second baseline
    Engine("capture-graph", capture=True, eager=False),
    Engine("capture-eager", capture=True, eager=True),
    Engine("vanilla-eager", capture=False, eager=True),
)}
BASELINE = "vanilla"
IDLE = "idle"  # capture installed, no stream: the reference for capture's own cost
# A second vanilla engine beside the first: how far two engines of one kind sit apart in a run
# (named only; on the 1B's host-bound step idle read 0.916-1.024 across runs).
CONTROL = "vanilla-b"


@dataclass(frozen=True)
class Capture:
    stream: str
    layers: str  # "all" | "spread4"
    reduce: str  # "all" | "last"

    def layer_ids(self, shape: ModelShape) -> list[int] | None:
        return None if self.layers == "all" else spread_layers(shape.layers, 4)

    def num_layers(self, shape: ModelShape) -> int:
        ids = self.layer_ids(shape)
        return shape.layers if ids is None else len(ids)

    def rows_per_layer(self, w: Workload) -> int:
        """Rows of one layer one generate must deliver (reduce="last": one per request)."""
        return w.concurrency * (1 if self.reduce == "last" else w.positions_per_request)

    def expected_bytes(self, shape: ModelShape, w: Workload, dtype_bytes: int = 2) -> int:
        item = 4 if self.stream == ROUTER else dtype_bytes
        return self.rows_per_layer(w) * self.num_layers(shape) * shape.width(self.stream) * item


@dataclass(frozen=True)
class Scenario:
    name: str
    engine: str
    capture: Capture | None = None
    moe_only: bool = False
    heavy: bool = False
    note: str = ""


_CAPTURES = (
    ("hidden-last", Capture(HIDDEN, "all", "last"), False, False, "last token, hidden states, all layers"),
    ("hidden-4l", Capture(HIDDEN, "spread4", "all"), False, False, "hidden states, 4 layers, all positions"),
    ("heads-4l", Capture(HEADS, "spread4", "all"), False, False, "attention heads, 4 layers, all positions"),
    ("router-all", Capture(ROUTER, "all", "all"), True, False, "router logits, all layers, all positions"),
    ("heavy", Capture(HIDDEN, "all", "all"), False, True, "hidden states, all layers, all positions"),
)

SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(BASELINE, "vanilla-graph", note="plain vllm.LLM, CUDA graphs (baseline)"),
    Scenario(CONTROL, "vanilla-graph-b", note="a second plain vllm.LLM, CUDA graphs (control)"),
    Scenario("vanilla-eager", "vanilla-eager", note="plain vllm.LLM, enforce_eager=True"),
    Scenario(IDLE, "capture-graph", note="capture installed, no stream enabled"),
    *(Scenario(n, "capture-graph", c, moe, heavy, note) for n, c, moe, heavy, note in _CAPTURES),
    *(Scenario(f"eager-{n}", "capture-eager", c, moe, heavy, f"{note}, enforce_eager=True")
      for n, c, moe, heavy, note in _CAPTURES),
)}


# ---- suites ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Suite:
    name: str
    model: str
    workloads: tuple[Workload, ...]  # in priority order: later ones are skipped first
    scenarios: tuple[str, ...]
    optional_workloads: tuple[Workload, ...] = ()  # run only when named (--workloads)
    reps: int = 2
    budget_s: float = 540.0
    eager_workloads: tuple[str, ...] | None = None  # workloads eager engines run (None: all)
    force_eager: bool = False  # CPU: every engine runs eagerly
    max_num_batched_tokens: int = 8192
    max_capture_gb: float = 12.0  # skip scenarios whose rows per generate exceed this (host RAM)
    dtype: str = "bfloat16"
    grace_s: float = 60.0  # past budget_s, workers are stopped (the report is written anyway)
    tensor_parallel_size: int = 1
    # The graph engines (vanilla and capture) share the GPU in one worker and take turns, rep by
    # rep, so every ratio compares generates of the same minutes (see engine_groups).
    side_by_side: bool = True
    # Side by side, the baseline starts last (an edge of a later start goes to it); True
    # reverses the start order, the baseline first, to measure what start order alone is worth.
    baseline_first: bool = False
    gpu_memory_utilization: float = 0.85  # of all engines of a group together

    def scenarios_for(self, shape: ModelShape) -> list[Scenario]:
        return [SCENARIOS[n] for n in self.scenarios if shape.moe or not SCENARIOS[n].moe_only]

    def engines_for(self, shape: ModelShape) -> list[str]:
        used = {s.engine for s in self.scenarios_for(shape)}
        return [e for e in ENGINES if e in used]

    def workloads_for(self, engine: str) -> list[Workload]:
        if ENGINES[engine].eager and self.eager_workloads is not None:
            return [w for w in self.workloads if w.name in self.eager_workloads]
        return list(self.workloads)

    @property
    def max_model_len(self) -> int:
        need = max(w.prompt_len + w.new_tokens for w in self.workloads)
        return int(math.ceil((need + 16) / 256) * 256)

    @property
    def max_num_seqs(self) -> int:
        return max(w.concurrency for w in self.workloads)


_ALL = tuple(n for n in SCENARIOS if n != CONTROL)
# Under 3 minutes with start-up (2 engines, 158-170 s on the H200); eager engines in `full`.
_QUICK = (BASELINE, IDLE, "hidden-last", "hidden-4l")


def make_suite(name: str, model: str | None = None) -> Suite:
    if name == "quick":
        return Suite("quick", model or "1b", (decode(64),), _QUICK, reps=2, budget_s=170.0,
                     grace_s=30.0)
    if name == "full":
        # Trimmed to fit 10 minutes of device time: prefill at 256 (512k prompt tokens a
        # generate) only when named, eager engines only at 64 concurrent, later workloads
        # skipped when the time budget runs out (the report lists what was skipped and why).
        workloads = (decode(64), prefill(64), decode(256), decode(1), prefill(1))
        return Suite("full", model or "8b", workloads, _ALL, reps=2, budget_s=470.0,
                     eager_workloads=("decode-c64", "prefill-c64"),
                     optional_workloads=(prefill(256),))
    if name == "tiny-cpu":
        workloads = (decode(8, prompt_len=16, new_tokens=16), prefill(4, prompt_len=256, new_tokens=4))
        scenarios = tuple(s for s in _ALL if SCENARIOS[s].engine != "vanilla-eager")
        return Suite("tiny-cpu", model or "tiny", workloads, scenarios, reps=2, budget_s=900.0,
                     grace_s=300.0, force_eager=True, max_num_batched_tokens=1024,
                     max_capture_gb=1.0)
    raise ValueError(f"unknown suite {name!r}; choose quick, full or tiny-cpu")


SUITES = ("quick", "full", "tiny-cpu")


# ---- time budget -----------------------------------------------------------------------------

def engine_weight(suite: Suite, shape: ModelShape, engine: str) -> float:
    """Relative measuring time of an engine: generates it runs, eager ones counted 3x slower."""
    n_scen = sum(s.engine == engine for s in suite.scenarios_for(shape))
    gens = len(suite.workloads_for(engine)) * (1 + suite.reps * n_scen)
    return gens * (3.0 if ENGINES[engine].eager else 1.0)


def engine_deadline(now: float, end: float, startups: list[float], weights: list[float]) -> float:
    """Soft deadline of the engine about to start (index 0 of the remaining engines).

    Every remaining engine keeps its start-up time; what is left is shared by measuring weight.
    """
    spare = max(0.0, end - now - sum(startups))
    total = sum(weights) or 1.0
    return now + startups[0] + spare * weights[0] / total


def workload_fits(now: float, deadline: float, warmup_s: float, generates: int) -> bool:
    """Whether ``generates`` more timed generates (each about a warm-up's time) end by ``deadline``."""
    return now + warmup_s * generates <= deadline


def layer_groups(layers: list[int], bytes_per_layer: float, max_bytes: float) -> list[list[int] | None]:
    """Split a fetch into messages of at most ``max_bytes`` (one group ``[None]``: fetch all at once)."""
    if not layers or bytes_per_layer * len(layers) <= max_bytes:
        return [None]
    per = max(1, int(max_bytes // max(bytes_per_layer, 1)))
    return [layers[i:i + per] for i in range(0, len(layers), per)]


# ---- per-engine plan and settings --------------------------------------------------------------

def dtype_bytes(suite: Suite, shape: ModelShape) -> int:
    """Bytes of one captured element (the engine's dtype; used for estimates only)."""
    return 4 if suite.dtype == "float32" else 2


def engine_kwargs(suite: Suite, shape: ModelShape, engine: str) -> dict:
    """``vllm.LLM`` / ``vllm_capture.LLM`` keyword arguments; identical across engines but for
    eager mode and the capture buffer size, so every ratio compares like with like."""
    e = ENGINES[engine]
    kw = dict(dtype=suite.dtype, max_model_len=suite.max_model_len, max_num_seqs=suite.max_num_seqs,
              max_num_batched_tokens=suite.max_num_batched_tokens, seed=0)
    if suite.tensor_parallel_size != 1:
        kw["tensor_parallel_size"] = suite.tensor_parallel_size
    if shape.tiny is None:
        kw["load_format"] = "dummy"
    if not suite.force_eager:
        share = next(len(g) for g in engine_groups(suite, shape) if engine in g)
        kw["gpu_memory_utilization"] = round(suite.gpu_memory_utilization / share, 3)
    if e.eager or suite.force_eager:
        kw["enforce_eager"] = True
    if e.capture:
        kw["capture_buffer_bytes"] = ring_buffer_bytes(shape, suite.max_num_batched_tokens,
                                                       dtype_bytes(suite, shape))
    return kw


# Side by side, each engine gets half of the memory; weights above this leave too little KV cache.
SIDE_BY_SIDE_MAX_WEIGHT_BYTES = 24e9

GIB = 1 << 30
# What vLLM holds beside weights, capture buffers and KV cache: peak activations, CUDA graphs and
# memory outside torch (the 8B at 8,192 batched tokens on an H100, session 55: 1.1, 0.22 and
# 0.22 GiB), rounded up.
ENGINE_OVERHEAD_BYTES = 2 * GIB


def engine_floor_bytes(suite: Suite, shape: ModelShape, engine: str) -> dict[str, int]:
    """The least GPU memory an engine starts with, by part: vLLM refuses to start an engine whose
    share leaves no KV cache for one sequence of ``max_model_len`` tokens."""
    tp = suite.tensor_parallel_size
    kv_per_token = shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes(suite, shape)
    return {"weights": shape.weight_bytes // tp,
            "capture buffers": engine_kwargs(suite, shape, engine).get("capture_buffer_bytes", 0),
            "one sequence's KV cache": suite.max_model_len * kv_per_token // tp,
            "activations and graphs": ENGINE_OVERHEAD_BYTES}


def memory_shortfall(suite: Suite, shape: ModelShape, group: list[str],
                     gpu_bytes: int | None) -> str | None:
    """Why an engine of ``group`` cannot start on a GPU of ``gpu_bytes`` with its
    ``gpu_memory_utilization`` share, or None (it fits, or the share or the GPU is unknown: CPU).

    Checked before a group starts, so that a run on a smaller GPU than the suite was sized for
    (the 8B's three engines side by side need an H200) says so instead of spending the engines'
    start-up on vLLM's "No available memory for the cache blocks".
    """
    if not gpu_bytes:
        return None
    for e in group:
        share = engine_kwargs(suite, shape, e).get("gpu_memory_utilization")
        if share is None:
            continue
        parts = engine_floor_bytes(suite, shape, e)
        need = sum(parts.values())
        if need > share * gpu_bytes:
            detail = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts.items())
            remedy = ("run fewer engines side by side, or on a GPU with more memory"
                      if len(group) > 1 else "run on a GPU with more memory")
            return (f"{e} needs at least {need / GIB:.1f} GiB ({detail}), more than the "
                    f"{share * gpu_bytes / GIB:.1f} GiB its gpu_memory_utilization of {share} "
                    f"gives on this GPU of {gpu_bytes / GIB:.1f} GiB: {remedy}")
    return None


def engine_groups(suite: Suite, shape: ModelShape) -> list[list[str]]:
    """Engines that run in one worker, in start order.

    Vanilla and capture engines with graphs run side by side when the weights fit twice: their
    generates alternate, so the ratios the targets are judged by do not depend on which engine
    ran in which minutes (single generates of the same engine varied by +-15 % over minutes on
    the H200 host). Eager engines, and every engine of a model too large to load twice, run alone.
    (On CPU, ``force_eager``, the "graph" engines run eagerly but still side by side.)
    """
    engines = suite.engines_for(shape)
    # Capture starts first, so that any edge of the engine started later goes to the baseline
    # (two vanilla engines side by side showed none beyond per-generate noise: engine_order.py).
    # The control starts before both: an edge of starting first shows in its ratio, not capture's
    # (session 16: the engine started first, capture's, read 0.95-0.98 idle; the control, third,
    # 0.996 and 1.023).
    graph = sorted((e for e in engines if not ENGINES[e].eager),
                   key=lambda e: (e != SCENARIOS[CONTROL].engine, not ENGINES[e].capture))
    if suite.baseline_first:
        # Sessions 17-21: the control, started first, read 0.983 of the baseline over nine runs;
        # reversed (session 21, two runs), the baseline read lowest: idle 1.028, the control
        # 1.038 of it. No engine read slower than one started before it, in either order.
        graph.reverse()
    if (suite.side_by_side and len(graph) > 1
            and shape.weight_bytes <= SIDE_BY_SIDE_MAX_WEIGHT_BYTES):
        return [graph] + [[e] for e in engines if e not in graph]
    return [[e] for e in engines]


def compile_warmers(suite: Suite, shape: ModelShape, group: list[str]) -> list[str]:
    """The engines of ``group`` that ``--warm-cache`` starts once before it, so that every timed
    engine loads its compiled model from vLLM's compile cache: one per distinct set of engine
    arguments (the control's equal the baseline's), engines with graphs only.

    Without it, in a run's fresh model folder the first engine of each set compiles in its own
    process and a second of the same set loads what the first saved: the capture engine always
    compiled, and of the two vanilla engines the one started last loaded. Over the eleven 1B runs
    with a control to session 21, the vanilla engine that loaded read ahead of the one that
    compiled in eight (by 1.7% over the nine started capture first, 1.3% and 9.3% in the two
    started vanilla first), so the compile state may be worth as much as capture's idle cost.
    """
    seen: set[str] = set()
    out = []
    for e in group:
        key = json.dumps([ENGINES[e].capture, engine_kwargs(suite, shape, e)], sort_keys=True)
        if not ENGINES[e].eager and key not in seen:
            seen.add(key)
            out.append(e)
    return out


def cpu_groups(cores: list[list[int]], groups: int, max_cores: int = 4) -> list[list[int]]:
    """Disjoint CPU sets for ``groups`` process groups, each of whole physical cores (``cores``:
    the logical CPUs of each physical core, in order), as many as share evenly, at most
    ``max_cores`` each. Side by side, the client and each engine get their own cores, so that
    neither engine's placement favours it; the engines rotate over their groups (``rotated_cpus``).
    (On the H200 the 1B's ratios spread as widely pinned as not, session 15: the idle engine read
    1.024 and 0.916 unpinned, 0.956 pinned.)"""
    per = min(max_cores, len(cores) // groups) if groups else 0
    if per < 1:
        raise ValueError(f"cpu_groups: {len(cores)} physical cores for {groups} groups")
    return [sorted(c for core in cores[g * per:(g + 1) * per] for c in core) for g in range(groups)]


def rotated_cpus(engines: list[str], groups: list[list[int]], rep: int) -> dict[str, list[int]]:
    """The CPU set of each engine in ``rep``: the engines move one group every two reps, so each
    runs on every group, and no engine's ratio is its cores'. Two reps a group, because the
    order of a rep's scenarios flips every rep: each group sees an engine in both orders."""
    return {e: groups[(i + rep // 2) % len(groups)] for i, e in enumerate(engines)}


def plan_group(suite: Suite, shape: ModelShape, engines: list[str]):
    """``plan_engine`` for engines that take turns: per workload, every engine's scenarios."""
    plans, skips = {}, []
    for e in engines:
        plans[e], skipped = plan_engine(suite, shape, e)
        skips += skipped
    merged = []
    for w in suite.workloads:
        scens = [s for e in engines for pw, ss in plans[e] if pw == w for s in ss]
        if scens:
            merged.append((w, scens))
    return merged, skips


def plan_engine(suite: Suite, shape: ModelShape, engine: str):
    """``([(workload, [scenario, ...]), ...], skips)`` for one engine, in priority order.

    Scenarios whose rows of one generate would exceed ``max_capture_gb`` of host memory are
    skipped here, with the reason.
    """
    plan, skips = [], []
    item = dtype_bytes(suite, shape)
    for w in suite.workloads_for(engine):
        keep = []
        for s in suite.scenarios_for(shape):
            if s.engine != engine:
                continue
            size = s.capture.expected_bytes(shape, w, item) if s.capture else 0
            if size > suite.max_capture_gb * 1e9:
                skips.append({"engine": engine, "workload": w.name, "scenario": s.name,
                              "reason": f"{size / 1e9:.1f} GB of rows per generate > "
                                        f"{suite.max_capture_gb:g} GB host cap (--max-capture-gb)"})
            else:
                keep.append(s)
        if keep:
            plan.append((w, keep))
    return plan, skips


def select(suite: Suite, engines: str | None = None, workloads: str | None = None,
           scenarios: str | None = None) -> Suite:
    """The suite restricted to comma-listed engines, workload names and/or scenario names (None:
    unchanged)."""
    if scenarios:
        keep = [s.strip() for s in scenarios.split(",") if s.strip()]
        known = (*suite.scenarios, CONTROL)  # every suite runs the control when it is named
        bad = [s for s in keep if s not in known]
        if bad:
            raise ValueError(f"--scenarios: unknown {bad}; this suite has {list(known)}")
        suite = replace(suite, scenarios=tuple(s for s in known if s in keep))
    if engines:
        keep = [e.strip() for e in engines.split(",") if e.strip()]
        bad = [e for e in keep if e not in ENGINES]
        if bad:
            raise ValueError(f"--engines: unknown {bad}; choose from {list(ENGINES)}")
        suite = replace(suite, scenarios=tuple(s for s in suite.scenarios if SCENARIOS[s].engine in keep))
    if workloads:
        keep = [w.strip() for w in workloads.split(",") if w.strip()]
        known = suite.workloads + suite.optional_workloads
        bad = [w for w in keep if w not in {k.name for k in known}]
        if bad:
            raise ValueError(f"--workloads: unknown {bad}; this suite has "
                             f"{sorted(k.name for k in known)}")
        suite = replace(suite, workloads=tuple(w for w in known if w.name in keep))
    return suite
