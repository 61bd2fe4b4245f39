#!/usr/bin/env python3
"""The harvest thread's store of finalized reductions, against a busy main thread (any machine).

    python3 benchmarks/harvest_contention.py [--layers 32 --requests 64 --width 4096 --runs 7]

The worker's harvest thread shares the GIL with vLLM's main thread, which polls its shared-memory
queue in Python between RPCs (``SpinCondition``: a busy loop for a second after each read). A
thread that gives up the GIL, as most torch operations do, then waits for the busy thread's
switch interval (5 ms) to get it back. This stores one step's finalized last-token reductions
(``CaptureSession._store_reduced``, the rows in one host block per ring group, as the device
copy leaves them) on a thread of its own while the main thread is quiet, polls with
``os.sched_yield`` as vLLM's loop does, or runs pure Python, and prints each case's
milliseconds (median, and every run).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import statistics
import threading
import time

import torch

from vllm_capture.capture_graph.state import DrainedRows
from vllm_capture.session.config import StreamConfig
from vllm_capture.session.session import CaptureSession, Stream, _Reduced
from vllm_capture.session.store import StreamStore


def reductions(layers: int, requests: int, width: int) -> _Reduced:
    config = StreamConfig(reduce="last")
    store = StreamStore(config)
    req_ids = [f"req-{i}" for i in range(requests)]
    index = [store.request_index(r) for r in req_ids]
    stream = Stream("hidden_states", config, store)
    rows = torch.randn(layers, requests, width).to(torch.bfloat16)
    labels = torch.zeros(requests, 3, dtype=torch.int32)
    counts = torch.ones(layers, requests, dtype=torch.int32)
    acc = DrainedRows("hidden_states", requests,
                      {k: (rows[k], labels, counts[k]) for k in range(layers)},
                      {k: f"model.layers.{k}" for k in range(layers)})
    return _Reduced(stream, req_ids, index, list(range(requests)), acc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--runs", type=int, default=7)
    args = p.parse_args()
    logging.disable(logging.WARNING)
    session = CaptureSession.__new__(CaptureSession)  # the store path alone: no engine
    session._host_s = {"harvest_sync": 0.0}

    # One long-lived thread, as the harvest thread is (a thread's first torch operations set up
    # its own thread pool, which a fresh thread per store would time).
    jobs: queue.Queue = queue.Queue()

    def harvest() -> None:
        while True:
            item, out, done = jobs.get()
            t0 = time.perf_counter()
            CaptureSession._store_reduced(session, [item])
            out.append((time.perf_counter() - t0) * 1e3)
            done.set()

    threading.Thread(target=harvest, daemon=True).start()

    def pure_python():
        x = 0
        for k in range(1000):
            x += k

    main_thread = {"quiet": None, "sched_yield": os.sched_yield, "pure Python": pure_python}
    for name, work in main_thread.items():
        times: list[float] = []
        for _ in range(args.runs):
            done = threading.Event()
            jobs.put((reductions(args.layers, args.requests, args.width), times, done))
            while work is not None and not done.is_set():
                work()
            done.wait()
        print(f"main thread {name:12s} store {statistics.median(times):8.2f} ms "
              f"(runs: {', '.join(f'{t:.1f}' for t in times)})")


if __name__ == "__main__":
    main()
