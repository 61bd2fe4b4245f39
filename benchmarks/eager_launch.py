#!/usr/bin/env python3
"""What one eager capture launch costs the host (no engine).

A forward outside CUDA graphs runs the capture op's Python body at every site, and each launches
the capture kernel from Python. Session 35's ablation put the 1B's 16 such launches in the
benchmark's second engine iteration at about 0.2 ms each (the part of the prefill that runs
outside graphs). This times, on the current device, host microseconds a call (median of
``--rounds`` rounds of ``--calls`` calls, the device synchronized around each round, not inside):

* ``launch_us``: ``launch_capture`` as the op body calls it, for a last-token plan of
  ``--segments`` requests over ``--tokens`` bf16 rows of ``--width`` with a residual;
* ``check_us``: its layout checks alone (``_check``); ``rest_us`` is the difference, Triton's
  launcher on a GPU (the torch reference elsewhere);
* ``jit_us``: the same kernel launched through Triton's JIT at every call, as before
  ``launch_kernel`` bound the compiled kernel (on a GPU);
* ``op_us``: ``torch.ops.vllm_capture.capture`` with a handler that returns at once: what the
  dispatcher adds to each site's call.

``rows_right`` says the timed launches did the work they stand for: each request's last row
reduced into its accumulator slot. ``keys_agree`` (on a GPU) says the bound launches pick the
kernel the JIT would (see :func:`keys_agree`). Prints one JSON line.

    python3 benchmarks/eager_launch.py [--tokens 2048 --width 2048 --segments 64]
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

import torch  # noqa: E402

from vllm_capture.kernels import capture as C  # noqa: E402
from vllm_capture.kernels import layout as L  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_us(call, device: torch.device, calls: int, rounds: int) -> float:
    call()  # compile or load outside the timing
    times = []
    for _ in range(rounds):
        _sync(device)
        t = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - t) * 1e6 / calls)
        _sync(device)
    return round(statistics.median(times), 2)


def measure(tokens: int, width: int, segments: int, calls: int, rounds: int,
            device: torch.device) -> dict:
    if segments < 1 or tokens % segments:
        raise ValueError(f"--segments must divide --tokens ({tokens}), got {segments}")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, width, generator=g).to(device, torch.bfloat16)
    residual = torch.randn(tokens, width, generator=g).to(device, torch.bfloat16)
    ids = torch.arange(tokens, dtype=torch.int32, device=device)
    meta, plan = L.new_plan_buffers(tokens, device)
    ring, ring_labels = L.new_ring_buffers(0, width, torch.bfloat16, device)
    acc, acc_labels, acc_count = L.new_acc_buffers(segments, width, device)
    site = L.new_site_buffer(device)
    length = tokens // segments
    starts = torch.arange(segments, dtype=torch.int32, device=device) * length
    meta[L.META_MODE], meta[L.META_COUNT] = L.MODE_LAST, segments
    plan[L.PLAN_SEG_START, :segments] = starts
    plan[L.PLAN_SEG_COUNT, :segments] = length
    plan[L.PLAN_SEG_SLOT, :segments] = torch.arange(segments, dtype=torch.int32, device=device)
    plan[L.PLAN_SEG_REQ, :segments] = torch.arange(segments, dtype=torch.int32, device=device)
    buffers = (meta, plan, site, ring, ring_labels, acc, acc_labels, acc_count)

    def launch():
        C.launch_capture(x, residual, ids, *buffers)

    def check():
        C._check(x, residual, ids, *buffers)

    out = {"device": device.type, "triton": C.HAVE_TRITON and device.type == "cuda",
           "tokens": tokens, "width": width, "segments": segments, "calls": calls,
           "launch_us": _host_us(launch, device, calls, rounds),
           "check_us": _host_us(check, device, calls, rounds)}
    out["rest_us"] = round(out["launch_us"] - out["check_us"], 2)
    # A package from before the bound launch (PACKAGE_AT) launches through the JIT only.
    if out["triton"] and hasattr(C, "launch_kernel"):
        grid, args, constexprs = C.kernel_arguments(x, residual, ids, *buffers)
        out["jit_us"] = _host_us(lambda: C.capture_site_kernel[grid](*args, **constexprs),
                                 device, calls, rounds)
        out["keys_agree"] = keys_agree(device)
    out["op_us"] = _op_us(x, residual, site, device, calls, rounds)
    _sync(device)
    last = (x.float() + residual.float())[starts.long() + length - 1]
    out["rows_right"] = bool(torch.equal(acc.cpu(), last.cpu()))
    return out


def keys_agree(device: torch.device) -> bool:
    """Whether ``capture.bound_key`` tells launches apart exactly where Triton's JIT picks another
    compiled kernel: from one launch, each argument the JIT may specialize on changed in turn
    (dtypes, residual, token ids, column stride, a static buffer's alignment, views' offsets,
    the token count), equal keys must mean the same kernel object and different keys different
    ones. The site is disabled: the launches only count."""
    W, T = 70, 16
    meta, plan = L.new_plan_buffers(T, device)
    site = L.new_site_buffer(device)
    site[L.SITE_ENABLED] = 0
    acc, acc_labels, acc_count = L.new_acc_buffers(4, W, device)
    odd_acc = torch.zeros(5, W, device=device)[1:]  # 280 bytes in: not 16-byte aligned

    def case(dtype=torch.bfloat16, x=None, residual=True, ids=torch.int32, a=acc):
        x = torch.zeros(T, W, dtype=dtype, device=device) if x is None else x
        ring, ring_labels = L.new_ring_buffers(T, W, dtype, device)
        if ids is not None and not isinstance(ids, torch.Tensor):
            ids = torch.zeros(T, dtype=ids, device=device)
        return (x, x if residual else None, ids, meta, plan, site, ring, ring_labels, a,
                acc_labels, acc_count)

    bf16 = torch.bfloat16
    cases = [case(), case(torch.float32), case(residual=False), case(ids=torch.int64),
             case(ids=None), case(ids=torch.zeros(T + 1, dtype=torch.int32, device=device)[1:]),
             case(a=odd_acc), case(x=torch.zeros(T + 1, W + 1, dtype=bf16, device=device)[1:, 1:]),
             case(x=torch.zeros(W, T, dtype=bf16, device=device).t()),
             case(x=torch.zeros(4 * T, W, dtype=bf16, device=device))]
    kernels, keys = [], []
    for c in cases:
        grid, args, constexprs = C.kernel_arguments(*c)
        keys.append(C.bound_key(args, constexprs, torch.cuda.current_device()))
        kernels.append(C.capture_site_kernel[grid](*args, **constexprs))
    _sync(device)
    return all((keys[i] == keys[j]) == (kernels[i] is kernels[j])
               for i in range(len(cases)) for j in range(i))


def _op_us(x, residual, site, device, calls: int, rounds: int) -> float | None:
    """The custom op's call with a handler that returns at once (None without vLLM)."""
    try:
        from vllm_capture.kernels import ops
        ops.register_op()
    except ImportError:
        return None
    ops.set_site_handler(lambda *_: None)
    try:
        return _host_us(lambda: torch.ops.vllm_capture.capture(x, residual, site),
                        device, calls, rounds)
    finally:
        ops.set_site_handler(None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--segments", type=int, default=64)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    print(json.dumps(measure(args.tokens, args.width, args.segments, args.calls, args.rounds,
                             torch.device(args.device))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
