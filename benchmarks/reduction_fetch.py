#!/usr/bin/env python3
"""A last-token capture's fetch without an engine: the worker's path for `hidden-last`.

A ``CaptureGraphState`` with ``--layers`` hidden-state sites of ``--width`` columns (bf16 on a
GPU, fp32 on the CPU) and a ``CaptureSession`` with a last-token stream, driven as vLLM's runner
drives them: each run, ``--requests`` requests prefill ``--prompt`` tokens in one step and decode
``--steps`` steps (the capture kernel reduces every site's rows), then finish (``--early`` of them a
step before the others, as vLLM reports them); then the fetch, as
the worker runs it (``CaptureWorkerExtension.fetch_captured``: the store of the closing
reductions, serialize, the write into ``/dev/shm``) and as the client decodes it
(``shm.read_replies``, ``join_shards``). The fetched rows are checked against the last step's
activations, bit for bit.

Prints one line per run (the worker's stages from ``host_timers``, the write's parts, the
client's decode), so that a stall shows as an outlier, then the median and the largest of each.
On the H200 a fetch of 8B's shape inside vLLM took 14-71 ms, with 27-51 ms stalls in letting go of
the rows' sources in a quarter of the reps: this shows whether they happen without vLLM, in a
process small enough for a native profiler.

    python3 benchmarks/reduction_fetch.py [--layers 32 --width 4096 --requests 64 --runs 30]
"""

from __future__ import annotations

import argparse
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

from vllm_capture.api import join_shards  # noqa: E402
from vllm_capture.capture_graph.state import CaptureGraphState  # noqa: E402
from vllm_capture.engine.worker_ext import SESSION_ATTR, CaptureWorkerExtension  # noqa: E402
from vllm_capture.selection import StepBuffers  # noqa: E402
from vllm_capture.session import shm  # noqa: E402
from vllm_capture.session.session import CaptureSession  # noqa: E402

HS = "hidden_states"
WORKER_STAGES = ("fetch_finalize", "fetch_drain", "fetch_wait", "fetch_store", "fetch_serialize",
                 "fetch_write")
WRITE_TIMERS = ("fetch_write_copy", "fetch_write_release", "fetch_write_release_cpu")


class Bench:
    def __init__(self, layers: int, width: int, requests: int, prompt: int):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.layers, self.width, self.requests, self.prompt = layers, width, requests, prompt
        rows = requests * prompt
        self.state = CaptureGraphState(device=self.device, capacity=rows, ring_slots=2,
                                       acc_slots=requests)
        self.counters = [self.state.add_site(HS, layer, f"model.layers.{layer}", width, self.dtype)
                         for layer in range(layers)]
        self.state.allocate()
        self.input_ids = torch.zeros(rows, dtype=torch.int32, device=self.device)
        self.state.set_input_ids(self.input_ids)
        self.session = CaptureSession(self.state, {HS: {}})
        self.session.enable_stream(HS, reduce="last")
        self.worker = CaptureWorkerExtension()
        setattr(self.worker, SESSION_ATTR, self.session)
        self.runs = 0

    def step(self, req_ids: list[str], first: int, rows: int) -> torch.Tensor:
        """One step of ``rows`` rows per request from position ``first``: the layers' outputs
        (x + residual, in fp32) of each request's last row."""
        n = len(req_ids) * rows
        step = StepBuffers(req_ids, np.arange(len(req_ids) + 1, dtype=np.int32) * rows,
                           np.full(len(req_ids), first, dtype=np.int64), n)
        last = torch.empty(self.layers, len(req_ids), self.width, device=self.device)
        self.session.begin_step(step)
        try:
            for layer, counter in enumerate(self.counters):
                x = torch.randn(n, self.width, device=self.device).to(self.dtype)
                residual = torch.randn(n, self.width, device=self.device).to(self.dtype)
                self.state.handle(x, residual, counter)
                last[layer] = (x.float() + residual.float())[rows - 1::rows]
        finally:
            self.session.end_step()
        return last

    def run(self, steps: int, early: int = 0) -> dict[str, float]:
        """One generate and its fetch. ``early`` requests finish a step before the others, as
        vLLM reports one or two of many equal requests (their reductions close at that step)."""
        req_ids = [f"run{self.runs}-req{i}" for i in range(self.requests)]
        self.runs += 1
        params = types.SimpleNamespace(extra_args={}, n=1)
        for rid in req_ids:
            self.session.add_request(rid, [1] * self.prompt, params)
        want = self.step(req_ids, 0, self.prompt)
        # Timers before any finish: a status hands the reductions held for the fetch to the
        # harvest thread.
        before = self._timers()
        running = req_ids
        for k in range(steps):
            if early and k == steps - 1:
                # Late in the batch, as vLLM's early finishers may be: their rows come first
                # in the reduction's read unless the session orders it.
                self.session.finish_requests(req_ids[-early:])  # vLLM's notice with the next step
                running = req_ids[:-early]
            want[:, :len(running)] = self.step(running, self.prompt + k, 1)
        self.session.finish_requests(running)
        t0 = time.perf_counter()
        reply = self.worker.fetch_captured(HS, shm_probe=shm.client_probe())
        t1 = time.perf_counter()
        tensors, meta, _ = join_shards(HS, shm.read_replies([reply]))
        t2 = time.perf_counter()
        after = self._timers()
        want = want.to(self.dtype).cpu()
        right = sorted(tensors) == list(range(self.layers)) and all(
            meta[layer].req_ids == req_ids and torch.equal(tensors[layer], want[layer])
            for layer in range(self.layers))
        if not right:
            raise SystemExit(f"run {self.runs}: the fetched rows are not the last step's rows")
        out = {name: after[f"{name}_ms"] - before[f"{name}_ms"] for name in WORKER_STAGES + WRITE_TIMERS}
        out.update(worker=(t1 - t0) * 1e3, client=(t2 - t1) * 1e3)
        return out

    def _timers(self) -> dict[str, float]:
        return self.session.stream_status(HS)["host_timers"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=4, help="decode steps per run")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--early", type=int, default=1,
                   help="requests that finish a step before the others (vLLM reports one of 16 "
                        "equal requests a step early in most generates)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's CPU threads: 1, as vLLM sets them in a GPU worker")
    args = p.parse_args()
    torch.set_num_threads(args.torch_threads)
    bench = Bench(args.layers, args.width, args.requests, args.prompt)
    mb = args.layers * args.requests * args.width * bench.dtype.itemsize / 1e6
    print(f"{bench.device.type}, {bench.dtype}, {args.layers} layers x {args.requests} rows "
          f"x {args.width} = {mb:.1f} MB a fetch; ms per run:", flush=True)
    results = []
    for _ in range(args.runs):
        out = bench.run(args.steps, args.early)
        results.append(out)
        print(" ".join(f"{k} {v:.2f}" for k, v in out.items()), flush=True)
    for label, pick in (("median", statistics.median), ("max", max)):
        print(label, " ".join(f"{k} {pick(r[k] for r in results):.2f}" for k in results[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
