#!/usr/bin/env python3
"""The client's copies of an extract batch, without an engine: ``group_rows`` of one fetched
batch (its layers into prompt order) and a shard's concatenation of its batches, with their
destinations on huge pages (``host_pages``) and without.

    python3 benchmarks/client_copies.py [--rows 18229 --layers 4 --width 2048 --batches 4]

The default batch is the 1B's every-prompt-row extract (256 prompts of 20-120 words, 4 layers:
18,229 rows a layer, 75 MB of bfloat16), whose copies ran on the extract's main thread (the
grouping) and its writer thread (the concatenation). Each case alternates with the other, REPS
times; prints one JSON line of medians in ms and the host's transparent huge page mode.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import vllm_capture.host_pages as host_pages  # noqa: E402
from benchmarks.host_cpu import thp_mode  # noqa: E402
from vllm_capture.api import group_rows  # noqa: E402
from vllm_capture.session.wire import CaptureMeta  # noqa: E402


def fetched_batch(rows: int, layers: int, width: int, prompts: int = 256):
    """Layers as a fetch hands them over: rows grouped by request, one label set per layer."""
    rng = np.random.default_rng(0)
    lengths = rng.multinomial(rows - prompts, [1 / prompts] * prompts) + 1
    labels = [f"p{i}-0123abcd" for i in range(prompts) for _ in range(lengths[i])]
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths]).astype(np.int32))
    tokens = torch.from_numpy(rng.integers(0, 32000, rows).astype(np.int32))
    tensors = {layer: torch.randn(rows, width).to(torch.bfloat16) for layer in range(layers)}
    meta = {layer: CaptureMeta(list(labels), positions.clone(), tokens.clone())
            for layer in range(layers)}
    return tensors, meta, [f"p{i}" for i in range(prompts)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=18229)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batches", type=int, default=4, help="batches a shard concatenates")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    tensors, meta, request_ids = fetched_batch(args.rows, args.layers, args.width)
    parts = [tensors[0]] * args.batches
    threshold = host_pages.MIN_BYTES
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> None:
        t0 = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e3)
        del out

    for _ in range(args.reps):
        for huge in (True, False):
            host_pages.MIN_BYTES = threshold if huge else 1 << 62
            tag = "huge" if huge else "small"
            timed(f"group_rows_{tag}", lambda: group_rows(tensors, meta, request_ids))
            timed(f"concat_{tag}", lambda: host_pages.cat_on_huge_pages(parts))
    host_pages.MIN_BYTES = threshold
    print(json.dumps({"rows": args.rows, "layers": args.layers, "width": args.width,
                      "batches": args.batches, "reps": args.reps, "thp": thp_mode(),
                      "torch_threads": torch.get_num_threads(),
                      **{k: round(statistics.median(v), 1) for k, v in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
