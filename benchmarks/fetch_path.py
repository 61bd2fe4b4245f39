"""The fetch path alone, without an engine: store -> /dev/shm reply -> client tensors.

Fills a StreamStore with decode-like appends (one chunk per layer per drain of
``--steps-per-drain`` steps, one row per request per step), then times each stage of a fetch as the worker and the client run it: ``serialize`` (planning the
gather), ``write_reply`` (the copy into the shared-memory file), ``read_replies`` and
``deserialize_captured``. Prints one line per run.

    python3 benchmarks/fetch_path.py [--layers 16 --width 2048 --rows 64 --steps 150 --runs 3]
                                     [--steps-per-drain 1] [--write-threads N] [--fresh | --spare]

``--spare``: as the worker does while rows arrive, each append asks for the spare reply file
(``shm.want_spare``), which a thread populates in the background; the fetch runs once that
thread is done (a generate longer than the populating) and no pooled file is left to serve it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from vllm_capture.session import shm
from vllm_capture.session.config import StreamConfig
from vllm_capture.session.store import StreamStore
from vllm_capture.session.wire import deserialize_captured


def one_fetch(layers: int, width: int, rows: int, steps: int, per_drain: int, spare: bool) -> str:
    store = StreamStore(StreamConfig())
    index = torch.tensor([store.request_index(f"r{i}") for i in range(rows)], dtype=torch.int32)
    values = torch.randn(rows * per_drain, width).to(torch.bfloat16)
    names = {layer: f"model.layers.{layer}" for layer in range(layers)}
    t0 = time.perf_counter()
    for first in range(0, steps, per_drain):
        labels = torch.zeros(rows * per_drain, 3, dtype=torch.int32)
        labels[:, 0] = index.repeat(per_drain)  # step after step, as the ring holds them
        labels[:, 1] = 32 + first + torch.arange(per_drain).repeat_interleave(rows)
        store.append_layers({layer: values for layer in range(layers)}, labels, names)
        if spare:
            shm.want_spare(store.bytes_stored, owner=os.getpid())
    append = time.perf_counter() - t0
    note = ""
    if spare:
        for path, _ in shm._files(f"{shm.FREE}{os.getpid()}-"):
            os.unlink(path)  # this process's pooled files: none may serve the fetch
        thread = shm._spare.thread if shm._spare is not None else None
        if thread is not None:
            thread.join()
        populated = shm._spare.ready if shm._spare is not None else 0
        note = (f" (spare {populated / 1e6:.0f} MB populated in the background, "
                f"by {time.perf_counter() - t0:.3f}s)")
    stages = {}
    t0 = time.perf_counter()
    reply = {"layers": {str(k): v for k, v in store.serialize(raw_data=True,
                                                             clear_selected=True).items()}}
    stages["serialize"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    shm.write_reply(reply, shared=True, owner=os.getpid() if spare else None)
    stages["write"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    shm.read_replies([reply])
    stages["read"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tensors, _ = deserialize_captured(reply["layers"])
    stages["decode"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    checksum = sum(float(t[:, 0].float().sum()) for t in tensors.values())  # touch every layer
    stages["first read"] = time.perf_counter() - t0
    total = sum(stages.values())
    nbytes = layers * rows * per_drain * -(-steps // per_drain) * width * 2
    parts = " ".join(f"{k} {v:.3f}" for k, v in stages.items())
    return (f"{nbytes / 1e6:.0f} MB append {append:.3f}s {parts} total {total:.3f} = "
            f"{nbytes / total / 1e9:.2f} GB/s (checksum {checksum:.1f}){note}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--rows", type=int, default=64, help="rows per step (requests)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--steps-per-drain", type=int, default=1,
                   help="steps whose rows reach the store in one append (the engine drains "
                        "many decode steps at once)")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--write-threads", type=int, default=shm.WRITE_THREADS,
                   help="threads that populate and fill the reply file")
    files = p.add_mutually_exclusive_group()
    files.add_argument("--fresh", action="store_true",
                       help="no file pool: every fetch makes a new file")
    files.add_argument("--spare", action="store_true",
                       help="every fetch writes into the spare populated while the rows arrived")
    args = p.parse_args()
    shm.WRITE_THREADS = args.write_threads
    if args.fresh:
        shm.POOL_FILES = 0
    kind = "fresh files" if args.fresh else "the spare" if args.spare else "pooled files"
    print(f"write threads {shm.WRITE_THREADS}, {kind}")
    for _ in range(args.runs):
        print(one_fetch(args.layers, args.width, args.rows, args.steps, args.steps_per_drain,
                        args.spare), flush=True)


if __name__ == "__main__":
    main()
