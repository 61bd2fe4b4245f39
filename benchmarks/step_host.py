#!/usr/bin/env python3
"""Capture's host time on the step path, without an engine: what a decode step costs the host.

A ``CaptureGraphState`` with ``--layers`` hidden-state sites and a ``CaptureSession`` with one
stream (``--reduce``: last, mean or all), driven as the runner wrappers drive them (the step's
geometry from the runner's host buffers, ``begin_step``, ``end_step``): ``--requests`` requests
prefill 32 tokens in one step, then decode ``--steps`` steps. No forward runs, so this is the
host's part alone, uncontended: inside vLLM the same timers (``host_timers``: geometry,
begin_step, end_step) also count the waits for the GIL that vLLM's own threads hold. On the H200
host, ``begin_step`` alone read 0.07-0.10 ms a step at 64 requests (session 14).

    python3 benchmarks/step_host.py [--layers 16 --requests 64 --steps 2000 --device cuda]

Prints one JSON line: microseconds per decode step (medians) for the geometry and for
begin + end, and the plan copies the decode steps made (for last and mean, one: the first decode
step's; steady decode makes none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from vllm_capture.capture_graph.state import CaptureGraphState  # noqa: E402
from vllm_capture.engine import runners  # noqa: E402
from vllm_capture.session.session import CaptureSession  # noqa: E402

HS = "hidden_states"
PROMPT = 32


def measure(layers: int, width: int, requests: int, steps: int, reduce: str,
            device: torch.device) -> dict:
    capacity = requests * PROMPT
    state = CaptureGraphState(device=device, capacity=capacity, acc_slots=requests)
    for layer in range(layers):
        state.add_site(HS, layer, f"model.layers.{layer}", width, torch.bfloat16)
    state.allocate()
    state.set_input_ids(torch.zeros(capacity, dtype=torch.int32, device=device))
    state.await_kernels()  # the compile thread (on a GPU) would contend with the measurement
    session = CaptureSession(state, {HS: {}})
    session.enable_stream(HS, reduce=reduce)
    req_ids = [f"req-{i}" for i in range(requests)]
    params = types.SimpleNamespace(extra_args={}, n=1)
    for r in req_ids:
        session.add_request(r, list(range(PROMPT)), params, 0)
    # The runner's buffers are longer than the batch (max_num_seqs + 1 start offsets).
    spare = np.zeros(8, dtype=np.int32)
    prefill = np.concatenate([np.arange(requests + 1, dtype=np.int32) * PROMPT, spare])
    decode = np.concatenate([np.arange(requests + 1, dtype=np.int32), spare])
    geometry_us, step_us = [], []

    def step(query_start_loc, position: int, rows: int) -> None:
        computed = np.full(requests + 8, position, dtype=np.int64)
        t0 = time.perf_counter()
        geometry = runners._geometry(req_ids, query_start_loc, computed, rows)
        t1 = time.perf_counter()
        session.begin_step(geometry)
        session.end_step()
        t2 = time.perf_counter()
        geometry_us.append((t1 - t0) * 1e6)
        step_us.append((t2 - t1) * 1e6)

    step(prefill, 0, capacity)
    uploads = state.plan_uploads
    geometry_us.clear()
    step_us.clear()
    for k in range(steps):
        step(decode, PROMPT + k, requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"device": device.type, "layers": layers, "requests": requests, "reduce": reduce,
            "steps": steps, "geometry_us": round(statistics.median(geometry_us), 2),
            "begin_end_us": round(statistics.median(step_us), 2),
            "begin_end_us_p90": round(float(np.percentile(step_us, 90)), 2),
            "plan_uploads": state.plan_uploads - uploads}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--reduce", default="last", choices=("last", "mean", "all"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    print(json.dumps(measure(args.layers, args.width, args.requests, args.steps, args.reduce,
                             torch.device(args.device))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
