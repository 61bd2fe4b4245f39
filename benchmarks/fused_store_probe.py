#!/usr/bin/env python3
"""Whether a decoder layer's output could be captured without a kernel of its own.

The capture op is opaque to Inductor, so every hooked layer adds a kernel to each step's graph:
16 nodes a decode step for the 1B's last token, about 2 us each on the GPU (session 37), while
on the H200 the steady iterations are where last-token capture costs most (+0.067 ms an
iteration against idle over 740 reps, session 46). A store written as traced torch ops, the
layer's residual stream put into a static ring with ``index_put_``, is visible to Inductor,
which can fuse it into the next layer's add + RMSNorm kernel, where that sum is made anyway.

This patches vLLM's ``LlamaDecoderLayer`` in this process (no vllm_capture plugin): with
``--store fused`` each layer writes ``hidden + residual`` of every token of the step into a
static ring of its own, token t to row ``t % ROWS`` (every row: more stores than a last-token
capture makes); ``--store shared`` the same into one fp32 tensor of every layer's rows, each
layer from its own first row (a 0-dim buffer), as capture's accumulators are laid out;
``--store none`` leaves the model as it is; ``--store op`` is vllm-capture as it
ships, the last token of every layer's hidden states (the benchmark's hidden-last), fetched after
each timed generate (outside its time): since session 54 stored by traced torch ops too, into a
tensor a layer (``vllm_capture/capture_graph/last_rows.py``), with the capture op acting at the
first layer only, for labels and counts. Each layer's ring is a
tensor of its own: a store into a view of one shared ring was functionalized into a copy of the
whole view every forward (the CPU VM, session 52). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with vLLM's compile cache off (a cache made without the
store would be loaded silently), graphs as vLLM's defaults. It times the quick suite's decode
workload (64 prompts of 32 tokens, 256 new tokens each).

    python3 benchmarks/fused_store_probe.py --store fused [--model 1b --reps 6]

Prints one JSON line: tok/s of each timed generate and their median; the engine's start-up
seconds and ``compiled_modules``, the modules Inductor generated (more than none's where the
stores keep vLLM from reusing one compiled piece across layers); ``kernel_launches``, the
launch sites in every module Inductor generated (kernels, library calls and custom ops, summed;
a piece the layers share counts once: equal to none's where every store fused into a kernel
that runs anyway), and ``launches_by_module``, each module's launches by name; the kernels
whose names say they store (``index_put``; Inductor shortens long names, so not every one says
it); whether every ring holds rows (op: whether every request's every layer came back);
``tokens_sha``, a hash of the first generate's tokens (greedy: the same in every mode where the
stores leave the model's arithmetic alone).

On the CPU VM (tiny Llama, session 52): 18 launches with no store and with the fused ones, the
stores in the next layer's add + RMSNorm kernels (the last layer's in the final norm's). On an
H100 (session 53, the 1B): 30 launch sites and 3 modules with and without the stores, all in
one kernel (``triton_red_fused_add_fused_add_rms_norm_index_put_slice_2``), tok/s level with
none's. ``shared`` on the CPU VM (session 53) miscompiled: the generated tokens changed (tiny
Llama, 8 prompts: ``tokens_sha`` differs from none's and fused's, which agree), and in one run
the last layer's rows never reached the tensor; a storing kernel read the last layer's o_proj
output before the matmul that writes it. Right with ``enforce_eager``, and under plain
``torch.compile`` of a model that stores the same way. Session 54 (an H100): ``op``, now
vllm-capture's traced stores, kept none's tokens (``tokens_sha``) and 3 modules, with 34 launch
sites against none's 30 (on the CPU VM, tiny Llama: exactly the capture op's calls added, 8 for
4 layers of hidden states and heads, the stores in the add + RMSNorm kernels). Alternate the
modes in fresh processes on one host to compare their speed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROWS = 2048  # ring rows a layer; a step's token t goes to row t % ROWS
KERNEL_NAME = re.compile(r"\b((?:triton|cpp)_\w*fused\w*)")
# A launch in a generated module's call(): an Inductor kernel, a library call (a matmul), or a
# custom op Inductor leaves opaque (the capture op among them).
LAUNCH = re.compile(
    r"^\s+((?:triton|cpp)_\w+(?:\.run)?|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(",
    re.M)


class StoredRows:
    """The static rings the patched layers store into, and each token's row, made once before
    the engine compiles the model: a [ROWS, width] tensor a layer in the model's dtype, or
    (``shared``) one fp32 tensor of every layer's ROWS + 1 rows, as a capture's accumulators
    would be (the extra row a sink for tokens a step does not capture)."""

    def __init__(self, layers: int, width: int, max_tokens: int, dtype, device,
                 shared: bool = False) -> None:
        import torch

        self.device = device
        self.row_of_token = torch.arange(max_tokens, device=device) % ROWS
        self.layers_built = 0
        self.base = None
        if shared:
            self.base = torch.zeros(layers * (ROWS + 1), width, dtype=torch.float32, device=device)
            self.rings = list(self.base.view(layers, ROWS + 1, width)[:, :ROWS])
        else:
            self.rings = [torch.zeros(ROWS, width, dtype=dtype, device=device)
                          for _ in range(layers)]


def patch_llama(stored: StoredRows) -> None:
    """Each ``LlamaDecoderLayer`` stores its residual stream into its ring as it returns.
    Its layer number is set as it is built, so the traced forward reads a constant; with a
    shared tensor, the layer's first row is a 0-dim buffer of the layer instead (an input of the
    compiled piece, as the capture op's site tensor is), so the layers can share one piece."""
    import torch
    from vllm.model_executor.models import llama
    from vllm.model_executor.models.utils import extract_layer_index

    init, forward = llama.LlamaDecoderLayer.__init__, llama.LlamaDecoderLayer.forward

    def init_numbered(self, *args, prefix: str = "", **kwargs):
        init(self, *args, prefix=prefix, **kwargs)
        self.probe_layer = extract_layer_index(prefix)
        if stored.base is not None:
            self.register_buffer("probe_offset", torch.tensor(
                self.probe_layer * (ROWS + 1), device=stored.device), persistent=False)
        stored.layers_built += 1

    def forward_storing(self, positions, hidden_states, residual, **kwargs):
        hidden_states, residual = forward(self, positions, hidden_states, residual, **kwargs)
        rows = stored.row_of_token[:hidden_states.shape[0]]
        if stored.base is not None:
            stored.base.index_put_((self.probe_offset + rows,),
                                   (hidden_states + residual).float())
        else:
            ring = stored.rings[self.probe_layer]
            ring.index_put_((rows,), (hidden_states + residual).to(ring.dtype))
        return hidden_states, residual

    llama.LlamaDecoderLayer.__init__ = init_numbered
    llama.LlamaDecoderLayer.forward = forward_storing


class GeneratedCode(logging.Handler):
    """Inductor's generated modules (its ``output_code`` log): the kernels' names, and the
    launches their ``call()`` makes, summed over every module compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()
        self.launches = 0
        self.modules = 0
        self.module_launches: list[list[str]] = []  # per module, what its call() launches

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.names.update(KERNEL_NAME.findall(text))
        launches = LAUNCH.findall(text)
        self.launches += len(launches)
        if "def call(" in text:
            self.modules += 1
            self.module_launches.append(launches)


def fetch_last_rows(llm, layers: int) -> int:
    """Fetch the capture's rows (``--store op``) and return the fewest requests a layer holds."""
    from benchmarks import scenarios as S
    from vllm_capture import api

    tensors, _, _ = api.fetch_captured(llm, S.HIDDEN, clear=True)
    return min(len(tensors.get(layer, ())) for layer in range(layers))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", choices=("fused", "shared", "none", "op"), required=True)
    p.add_argument("--model", default="1b", help="a benchmark shape (1b, 8b) or tiny")
    p.add_argument("--reps", type=int, default=6, help="timed generates after one warm-up")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--work", default="/tmp/fused_store_probe")
    args = p.parse_args()

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams

    from benchmarks import scenarios as S
    from benchmarks.run import prepare_model
    from vllm_capture import tiny_models

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    max_tokens = 8192
    kwargs = dict(dtype=str(dtype).removeprefix("torch."), max_model_len=512,
                  max_num_batched_tokens=max_tokens, max_num_seqs=args.prompts, seed=0)
    if args.model == "tiny":
        folder = tiny_models.build("llama")
        config = json.loads((folder / "config.json").read_text())
        layers, width = config["num_hidden_layers"], config["hidden_size"]
    else:
        shape = S.MODELS[args.model]
        folder = prepare_model(shape, Path(args.work))
        layers, width = shape.layers, shape.hidden
        kwargs["load_format"] = "dummy"
    if cuda:
        kwargs["gpu_memory_utilization"] = 0.5
    stored = None
    if args.store in ("fused", "shared"):
        stored = StoredRows(layers, width, max_tokens, dtype, "cuda" if cuda else "cpu",
                            shared=args.store == "shared")
        patch_llama(stored)
    code = GeneratedCode()
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor").addHandler(code)

    started = time.perf_counter()
    if args.store == "op":
        import vllm_capture
        from vllm_capture import api

        if args.model != "tiny":
            kwargs["capture_buffer_bytes"] = S.ring_buffer_bytes(shape, max_tokens)
        llm = vllm_capture.LLM(str(folder), **kwargs)
        api.start_capture(llm, S.HIDDEN, reduce="last")
    else:
        llm = LLM(str(folder), **kwargs)
    init_s = time.perf_counter() - started
    prompts = [{"prompt_token_ids": [3 + (i * 7 + j) % 200 for j in range(32)]}
               for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params, use_tqdm=False)
    tokens_sha = hashlib.sha256(json.dumps(
        [list(o.outputs[0].token_ids) for o in first]).encode()).hexdigest()[:16]
    fetched = fetch_last_rows(llm, layers) if args.store == "op" else None
    tok_s = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        tok_s.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
        if args.store == "op":
            fetched = fetch_last_rows(llm, layers)
    storing = sorted(n for n in code.names if "index_put" in n)
    print(json.dumps({
        "store": args.store, "model": args.model, "device": "cuda" if cuda else "cpu",
        "tok_s": [round(t) for t in tok_s], "tok_s_median": round(statistics.median(tok_s)),
        "kernel_launches": code.launches, "storing_kernels": storing,
        "compiled_modules": code.modules, "init_s": round(init_s, 1), "tokens_sha": tokens_sha,
        "launches_by_module": code.module_launches,
        "layers_patched": None if stored is None else stored.layers_built,
        "rings_hold_rows": (fetched == args.prompts if args.store == "op"
                            else None if stored is None
                            else all(bool(r.abs().sum() > 0) for r in stored.rings)),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
