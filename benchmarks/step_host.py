#!/usr/bin/env python3
"""Capture's host time on the step path, without an engine: what a decode step costs the host.

A ``CaptureGraphState`` with ``--layers`` hidden-state sites and a ``CaptureSession`` with one
stream (``--reduce``: last, mean or all), driven as the runner wrappers drive them
(``begin_step`` with the runner's host buffers as ``StepBuffers``, then ``end_step``):
``--requests`` requests prefill 32 tokens in one step, then decode ``--steps`` steps. No forward
runs, so this is the host's part alone, in a hot loop. Inside vLLM the same timers
(``host_timers``: begin_step, end_step) read more: the same code runs slower between vLLM's own
work, and their averages include the steps that are planned (prefill, joins). On the H200
host (session 15), before steady decode skipped the geometry: 48 us of geometry and 63 us of
``begin_step`` a step at 64 requests inside vLLM, against 13 and 20 us here; after: 31-39 us of
begin + end inside vLLM, 5 us here.

Part of that difference is the caches. ``--evict-mb`` reads a buffer larger than the last-level
cache before each step (outside the timing), so that the step's data comes from memory, as
after vLLM's work between two steps. On the CPU VM (32 MiB L3, session 38), a repeated
last-token step: 1.95 us hot and 4.4 us with 64 MiB read before e64ebd8, 1.37 and 3.3 after
(three alternated runs each, within 0.1 us). Earlier runs that session read 10-37 us with
32-128 MiB, as the VM's memory was slower then; the CPU engine's timers read 10-14 us before
e64ebd8 (``harvest_ablation.py --model tiny --in-process``). So compare variants in alternated
runs.

    python3 benchmarks/step_host.py [--layers 16 --requests 64 --steps 2000 --device cuda]
                                    [--evict-mb 64]

Prints one JSON line: microseconds per decode step (median and 90th percentile) for
begin + end, the plan copies the decode steps made (one: the first decode step's; steady decode
makes none) and, for ``all``, the steps that only set the device plan's step count.

``--first-steps N`` times a generate's first steps instead, N generates in a row, as vLLM runs
them: the prefill split over two steps (the requests that arrived first, then the rest), then
four decode steps; each generate's requests are new, and finish and are fetched after it. On the
1B benchmark's engine these steps' ``begin_step`` costs about 4.5 ms a generate (session 51, an
H100), where the steady step costs 12 us. ``--busy-ms`` keeps the GPU busy that long before
each step (a sleep kernel, as the forward in flight), so that a call that waits for the device
shows as a long step; ``--cprofile STEP`` prints that step's functions (``prefill0``,
``prefill1``, ``decode0``..``decode3``).
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
from vllm_capture.selection import StepBuffers  # noqa: E402
from vllm_capture.session.session import CaptureSession  # noqa: E402

HS = "hidden_states"
PROMPT = 32


def capture_session(layers: int, width: int, requests: int, reduce: str,
                    device: torch.device) -> tuple[CaptureGraphState, CaptureSession]:
    """A graph state of ``layers`` hidden-state sites and a session with one stream on, room for
    ``requests`` prompts of ``PROMPT`` tokens in one step."""
    capacity = requests * PROMPT
    state = CaptureGraphState(device=device, capacity=capacity, acc_slots=requests)
    for layer in range(layers):
        state.add_site(HS, layer, f"model.layers.{layer}", width, torch.bfloat16)
    state.allocate()
    state.set_input_ids(torch.zeros(capacity, dtype=torch.int32, device=device))
    state.await_kernels()  # the compile process (on a GPU) would contend with the measurement
    session = CaptureSession(state, {HS: {}})
    session.enable_stream(HS, reduce=reduce)
    return state, session


def measure(layers: int, width: int, requests: int, steps: int, reduce: str,
            device: torch.device, evict_mb: int = 0) -> dict:
    state, session = capture_session(layers, width, requests, reduce, device)
    req_ids = [f"req-{i}" for i in range(requests)]
    params = types.SimpleNamespace(extra_args={}, n=1)
    for r in req_ids:
        session.add_request(r, list(range(PROMPT)), params)
    # The runner's buffers are longer than the batch (max_num_seqs + 1 start offsets), int32.
    spare = np.zeros(8, dtype=np.int32)
    prefill = np.concatenate([np.arange(requests + 1, dtype=np.int32) * PROMPT, spare])
    decode = np.concatenate([np.arange(requests + 1, dtype=np.int32), spare])
    computed = np.zeros(requests + 8, dtype=np.int32)
    step_us = []
    evicting = np.zeros(evict_mb << 17)  # float64: 2**17 of them make a MiB

    def step(query_start_loc, position: int, rows: int) -> None:
        computed[:] = position
        evicting.sum()  # read, not written: no dirty lines for the step to write back
        t0 = time.perf_counter()
        session.begin_step(StepBuffers(req_ids, query_start_loc, computed, rows))
        session.end_step()
        step_us.append((time.perf_counter() - t0) * 1e6)

    step(prefill, 0, state.capacity)
    uploads, moved = state.plan_uploads, state.plan_steps
    step_us.clear()
    for k in range(steps):
        step(decode, PROMPT + k, requests)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"device": device.type, "layers": layers, "requests": requests, "reduce": reduce,
            "steps": steps, "evict_mb": evict_mb,
            "begin_end_us": round(statistics.median(step_us), 2),
            "begin_end_us_p90": round(float(np.percentile(step_us, 90)), 2),
            "plan_uploads": state.plan_uploads - uploads, "plan_steps": state.plan_steps - moved}


def measure_first_steps(layers: int, width: int, requests: int, generates: int,
                        device: torch.device, busy_ms: float = 0.0,
                        cprofile_step: str | None = None) -> dict:
    import cProfile
    import io
    import pstats

    _, session = capture_session(layers, width, requests, "last", device)
    params = types.SimpleNamespace(extra_args={}, n=1)
    spare = np.zeros(requests + 8, dtype=np.int32)
    first = requests // 4
    busy_cycles = 0
    if busy_ms and device.type == "cuda":
        rate = torch.cuda.get_device_properties(device).clock_rate  # kHz
        busy_cycles = int(busy_ms * rate)
    profile = cProfile.Profile() if cprofile_step else None
    times: dict[str, list[float]] = {}

    def step(name: str, req_ids: list[str], query_start_loc, computed: int) -> None:
        qsl = np.concatenate([np.asarray(query_start_loc, dtype=np.int32), spare])
        comp = np.concatenate([np.full(len(req_ids), computed, dtype=np.int32), spare])
        if busy_cycles:
            torch.cuda._sleep(busy_cycles)
        if name == cprofile_step:
            profile.enable()
        t0 = time.perf_counter()
        session.begin_step(StepBuffers(req_ids, qsl, comp, int(qsl[len(req_ids)])))
        session.end_step()
        times.setdefault(name, []).append((time.perf_counter() - t0) * 1e6)
        if name == cprofile_step:
            profile.disable()

    for g in range(generates):
        req_ids = [f"gen{g}-req{i}" for i in range(requests)]
        for r in req_ids:
            session.add_request(r, list(range(PROMPT)), params)
        step("prefill0", req_ids[:first], np.arange(first + 1) * PROMPT, 0)
        step("prefill1", req_ids[first:], np.arange(requests - first + 1) * PROMPT, 0)
        for k in range(4):
            step(f"decode{k}", req_ids, np.arange(requests + 1), PROMPT + k)
        session.finish_requests(req_ids)
        session.fetch_stream(HS)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    out = {"device": device.type, "layers": layers, "requests": requests,
           "generates": generates, "busy_ms": busy_ms,
           "step_us": {k: round(statistics.median(v), 1) for k, v in times.items()},
           "first_steps_us": round(sum(statistics.median(v) for v in times.values()), 1)}
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        out["cprofile"] = text.getvalue()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--reduce", default="last", choices=("last", "mean", "all"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--evict-mb", type=int, default=0,
                   help="before each step, read this many MiB (more than the last-level cache), "
                        "as vLLM's work between two steps moves the step's code and data out of "
                        "the caches")
    p.add_argument("--first-steps", type=int, default=0, metavar="GENERATES",
                   help="time a generate's first steps (two prefill, four decode) instead")
    p.add_argument("--busy-ms", type=float, default=0.0,
                   help="with --first-steps: keep the GPU busy this long before each step")
    p.add_argument("--cprofile", default=None, metavar="STEP",
                   help="with --first-steps: print this step's functions under cProfile")
    args = p.parse_args()
    if args.first_steps:
        out = measure_first_steps(args.layers, args.width, args.requests, args.first_steps,
                                  torch.device(args.device), args.busy_ms, args.cprofile)
        text = out.pop("cprofile", None)
        print(json.dumps(out))
        if text:
            print(text)
        return 0
    print(json.dumps(measure(args.layers, args.width, args.requests, args.steps, args.reduce,
                             torch.device(args.device), args.evict_mb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
