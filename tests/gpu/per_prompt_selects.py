"""Per-request selections under CUDA graphs, by hand on a GPU (CI has none).

The tiny Llama (bf16, default graphs): 48 prompts, a third carrying one clause of their own, a
third another (so the worker decodes each payload once for many requests), the rest the call's
``select``. Every prompt's rows of every layer against the brute-force selector (owners,
positions, token ids), then against an all-rows capture of the same prompts on the same engine
(rows at the same positions of requests that fed the same tokens; max abs difference printed).

    python3 tests/gpu/per_prompt_selects.py [--models /tmp/tiny]

Prints one JSON line; exits 1 on a wrong row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from tests.engine_support import (brute_force_positions, check_result_labels,  # noqa: E402
                                  fed_tokens, random_prompt, tokens_prompt)

MAX_TOKENS = 6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="/tmp/tiny")
    p.add_argument("--prompts", type=int, default=48)
    args = p.parse_args()

    import vllm_capture as vc
    from vllm_capture.tiny_models import build

    path = build("llama", Path(args.models) / "llama")
    llm = vc.LLM(str(path), dtype="bfloat16", max_model_len=512, max_num_seqs=64, seed=0,
                 gpu_memory_utilization=0.3)
    rng = np.random.default_rng(5)
    ids = [random_prompt(rng, int(n)) for n in rng.integers(4, 60, args.prompts)]
    prompts = [tokens_prompt(i) for i in ids]
    default = vc.SelectSpec(prompt_positions=(-1,))
    clauses = [vc.SelectSpec(prompt_positions=(0, 2), generation_positions=(1, 3)),
               vc.SelectSpec(prompt_window=(-5, None), generation_window=(2, None))]
    own = [clauses[i % 3] if i % 3 < 2 else None for i in range(len(prompts))]
    picked = vc.capture(llm, prompts, max_tokens=MAX_TOKENS, ignore_eos=True, select=default,
                        per_prompt_selects=own)
    fed = [fed_tokens(i, o) for i, o in zip(ids, picked.outputs)]
    wanted = [brute_force_positions((s or default).to_wire(), i, f[len(i):])
              for s, i, f in zip(own, ids, fed)]
    check_result_labels(picked, fed, wanted)  # raises AssertionError on a wrong row

    whole = vc.capture(llm, prompts, max_tokens=MAX_TOKENS, ignore_eos=True)
    same = [i for i, o in enumerate(whole.outputs)
            if fed_tokens(ids[i], o) == fed[i]]
    diff, compared = 0.0, 0
    for layer, rows in picked.layers.items():
        for i in same:
            positions = picked.meta(layer).positions[picked.offsets[i]:picked.offsets[i + 1]]
            mine = rows[picked.offsets[i]:picked.offsets[i + 1]].float()
            theirs = whole.sample_rows(i, layer)[positions.long()].float()
            diff = max(diff, float((mine - theirs).abs().max()) if len(mine) else 0.0)
            compared += len(mine)
    status = vc.capture_status(llm, vc.HIDDEN_STATES)
    print(json.dumps({"prompts": len(prompts), "rows_checked_labels": sum(
        len(w) for w in wanted) * len(picked.layers), "same_tokens": len(same),
        "rows_compared": compared, "max_abs_vs_all_rows": diff,
        "graph_replays": status.get("graph_replays"),
        "eager_capture_forwards": status.get("eager_capture_forwards")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
