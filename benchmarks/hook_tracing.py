#!/usr/bin/env python3
"""What capture's instrumented layers add to Dynamo's tracing: a stack of decoder-shaped layers
traced plain and with ``engine.instrument`` on every layer (hidden states, attention heads at each
``o_proj``, or both), in one process, in turn. Runs without a GPU: the backend compiles nothing,
so the seconds are Dynamo's alone, which an engine spends on every start, warm ones included. The
input's token dimension is marked dynamic and nothing else, as vLLM marks its inputs.

    python3 benchmarks/hook_tracing.py [--reps 9] [--layers 16] [--out DIR]

A warm start of the 1B shape on an H100 spent 1.4-1.6 s in Dynamo, and capture's starts from
-0.1 to +0.9 s more (sessions 62 and 63), too spread to take apart there; this stack gives the
same kind of extra on the CPU VM. Each trace follows a ``gc.collect()``, since a collection inside
a trace moved single readings by half; the minimum of each kind is printed beside the median.
Writes ``hook_tracing.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.compile_beside_tracing import HIDDEN, Stack  # noqa: E402
from vllm_capture.capture_graph.state import CaptureGraphState  # noqa: E402
from vllm_capture.engine.instrument import Target, instrument  # noqa: E402
from vllm_capture.kernels import ops  # noqa: E402
from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES  # noqa: E402

HEADS = 4


def instrumented(layers: int, components: tuple[str, ...]) -> Stack:
    """A ``Stack`` whose layers carry capture's sites of ``components``, as at model load."""
    model = Stack(layers)
    state = CaptureGraphState(device=torch.device("cpu"), capacity=64, acc_slots=8)
    targets = []
    for i, layer in enumerate(model.layers):
        if HIDDEN_STATES in components:
            targets.append(Target(HIDDEN_STATES, i, f"layers.{i}", layer, HIDDEN, torch.float32,
                                  {"width": HIDDEN}))
        if ATTENTION_HEADS in components:
            targets.append(Target(ATTENTION_HEADS, i, f"layers.{i}.o_proj", layer.o_proj, HIDDEN,
                                  torch.float32, {"width": HIDDEN, "num_heads": HEADS,
                                                  "head_size": HIDDEN // HEADS}))
    instrument(targets, state)
    state.allocate()
    return model


def trace_seconds(model: Stack) -> float:
    """One trace of ``model`` from a reset Dynamo, its input's token dimension dynamic."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=lambda gm, example_inputs: gm.forward, dynamic=False)
    x = torch.randn(7, HIDDEN)
    torch._dynamo.mark_dynamic(x, 0)
    started = time.perf_counter()
    compiled(x)
    return time.perf_counter() - started


def measure(layers: int, reps: int) -> dict[str, list[float]]:
    """Seconds of each kind's trace, ``reps`` each, the kinds in turn."""
    ops.register_op()
    models = {"plain": Stack(layers),
              "hidden": instrumented(layers, (HIDDEN_STATES,)),
              "heads": instrumented(layers, (ATTENTION_HEADS,)),
              "both": instrumented(layers, (HIDDEN_STATES, ATTENTION_HEADS))}
    for model in models.values():
        trace_seconds(model)  # Dynamo's own first-use costs, outside the reps
    seconds: dict[str, list[float]] = {kind: [] for kind in models}
    for _ in range(reps):
        for kind, model in models.items():
            gc.collect()
            seconds[kind].append(round(trace_seconds(model), 4))
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--out", help="folder for hook_tracing.json")
    args = p.parse_args()
    seconds = measure(args.layers, args.reps)
    plain = seconds["plain"]
    print(f"Dynamo tracing of {args.layers} layers, {args.reps} reps, {os.cpu_count()} CPUs, "
          f"Python {sys.version.split()[0]}, torch {torch.__version__}")
    print("| sites | median s | over plain (medians) | min s | over plain (minima) |")
    print("|---|---|---|---|---|")
    for kind, values in seconds.items():
        median, low = statistics.median(values), min(values)
        print(f"| {kind} | {median:.3f} | {median / statistics.median(plain):.3f} | {low:.3f} | "
              f"{low / min(plain):.3f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "hook_tracing.json").write_text(json.dumps(
            {"layers": args.layers, "reps": args.reps, "cpus": os.cpu_count(),
             "python": sys.version.split()[0], "torch": torch.__version__,
             "seconds": seconds}, indent=1))


if __name__ == "__main__":
    main()
