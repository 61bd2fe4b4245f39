#!/usr/bin/env python3
"""Dynamo's tracing of a model while the capture kernels compile beside it: on a thread of the
same process (how the engine compiled them before b635ec6), in a child process
(``kernels.compile_process``, how it does since), or not at all. Runs without a GPU: the
kernels compile for an sm_90 target through Triton's NVIDIA backend, the model is traced with a
backend that compiles nothing, so the seconds are Dynamo's alone, in this process.

    python3 benchmarks/compile_beside_tracing.py [--reps 6] [--layers 32] [--out DIR]

Each rep traces once per mode (in turn), each compile into an empty Triton cache and, on the
thread, with the JIT's in-memory cache cleared, so every compile is cold. Prints each mode's
seconds and a compile that failed; writes ``compile_beside_tracing.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

os.environ.pop("TRITON_INTERPRET", None)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

from vllm_capture.kernels import capture, compile_process  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)
MODES = ("alone", "thread", "process")
HIDDEN, INTERMEDIATE = 256, 512


class Layer(nn.Module):
    """A decoder layer's shape of ops (norms, projections, residual adds), small widths."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up = nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.down = nn.Linear(INTERMEDIATE, HIDDEN, bias=False)
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)

    def forward(self, hidden, residual):
        residual = hidden + residual
        q, k, v = self.qkv(self.norm1(residual)).chunk(3, -1)
        residual = self.o_proj(q * k.sigmoid() + v) + residual
        return self.down(nn.functional.silu(self.up(self.norm2(residual)))), residual


class Stack(nn.Module):
    def __init__(self, layers: int):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(layers))

    def forward(self, x):
        hidden, residual = x, torch.zeros_like(x)
        for layer in self.layers:
            hidden, residual = layer(hidden, residual)
        return hidden + residual


def trace_seconds(model: nn.Module) -> float:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward, dynamic=True)
    started = time.perf_counter()
    compiled(torch.randn(7, HIDDEN))
    return time.perf_counter() - started


def compile_on_thread(failures: list[str]) -> threading.Thread:
    capture.capture_site_kernel.device_caches.clear()

    def run():
        try:
            capture.compile_variants([torch.bfloat16], ids_dtypes=[torch.int64])
        except Exception as e:  # noqa: BLE001 - reported, not raised: the thread's own failure
            failures.append(f"{type(e).__name__}: {e}")

    thread = threading.Thread(target=run, name="compile")
    thread.start()
    return thread


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", help="folder for compile_beside_tracing.json")
    args = p.parse_args()
    driver.set_active(compile_process.TargetOnlyDriver("cuda", 90, 32))
    model = Stack(args.layers)
    trace_seconds(model)  # Dynamo's own first-use costs, outside the reps
    seconds = {mode: [] for mode in MODES}
    failures = {mode: [] for mode in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-beside-")
            thread = compile_on_thread(failures[mode]) if mode == "thread" else None
            child = (compile_process.start(SM90, [torch.bfloat16], [torch.int64])
                     if mode == "process" else None)
            seconds[mode].append(round(trace_seconds(model), 3))
            if thread is not None:
                thread.join()
            if child is not None and (failure := child.wait()) is not None:
                failures[mode].append(failure)
    print(f"Dynamo tracing of {args.layers} layers, {args.reps} reps, "
          f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print("| compile beside | median s | mean s | against alone (medians) | failed compiles |")
    print("|---|---|---|---|---|")
    alone = statistics.median(seconds["alone"])
    for mode in MODES:
        median = statistics.median(seconds[mode])
        print(f"| {mode} | {median:.3f} | {statistics.mean(seconds[mode]):.3f} | "
              f"{median / alone:.3f} | {len(failures[mode])} |")
    for mode in MODES:
        for failure in failures[mode]:
            print(f"{mode} compile failed: {failure[:300]}")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "compile_beside_tracing.json").write_text(json.dumps(
            {"layers": args.layers, "reps": args.reps, "cpus": os.cpu_count(),
             "python": sys.version.split()[0], "seconds": seconds, "failures": failures},
            indent=1))


if __name__ == "__main__":
    main()
