#!/usr/bin/env python3
"""What puts the capture engine's GPU work into its slow state, and what takes it out: one
capture engine, a sequence of steps run in its worker (triggers and resets), and after each the
FULL decode graph replayed alone (``engine_state.device_state``) and one idle generate.

    python3 benchmarks/slow_state.py --model 8b --out /tmp/out [--steps other-process,capture,...]

Why: session 26's ``after_capture.py --vanilla-between none`` (the capture engine's generates
back to back, as an engine alone on its GPU runs them) reproduced the 8B's slow idle: after two
hidden-4l captures idle ran at 0.976 of its speed before, through a 5 s wait, a device
synchronize, the graph's replays alone, the graph copies, the worker's shared-memory files and
torch's device and pinned host caches let go, and the FULL decode graph replayed alone took
5,672-5,691 us on the GPU; a 256 MiB copy and a 4096-square matmul beside it did not move. After
another process ran 2 s of matmuls on the GPU, idle ran at 1.003 and the graph took 5,531 us.
So the state is the device's, for this process's context, and another context's work ends it.

What it found (session 26, ``benchmarks/results/2026-12-02-h200-session26/``): the trigger is
device work of the worker on a second stream (``side-kernel``: index gathers on the capture's copy
stream into memory already held; ``gather`` too), not pinned memory, copies to the host, new device
memory or the same kernels on the current stream; a second CUDA context, even made and destroyed
empty in the worker's own process, ends it. The package's drains gathered on the copy stream;
since session 26 they gather on the current stream, and two hidden-4l captures then left the
graph at 5,531-5,537 us.

Steps (``--steps``, in order; each followed by the probe and an idle generate):

- ``capture``: a generate capturing ``--capture`` (hidden-4l), fetched and stopped;
- triggers run in the worker, each sized like a hidden-4l generate's drains (``--mb`` MiB in
  ``--chunk-mb`` pieces): ``pin`` (pinned host blocks allocated afresh, torch's host cache
  emptied first, then freed), ``d2h`` (device rows copied into fresh pinned blocks on the
  capture's copy stream, as a drain copies them), ``d2h-pageable`` (the same into pageable
  memory), ``gather`` (a device index gather of that many bytes on the copy stream, no copy
  out), ``prepare`` (device scratch for the next two, made on the current stream),
  ``side-kernel`` and ``main-kernel`` (index gathers into that scratch, no allocation, on the
  copy stream or on the current one), ``alloc-main`` and ``alloc-side`` (device cache emptied,
  then fresh blocks allocated for the current or the copy stream, no kernel);
- resets: ``other-process`` (``after_capture.OTHER_PROCESS``: 2 s of matmuls in a process of its
  own), ``context-only`` (a process that makes a CUDA context, one small tensor, and exits),
  ``second-context`` (a second CUDA context in the worker's own process, made with the driver
  API, 256 MiB memset in it 50 times, destroyed), ``second-context-empty`` (made and destroyed,
  no work), ``wait`` (5 s).

The probe right after ``start`` replays the touch generate's short sequences: not comparable.

One line per step (its label, what it returned, the graph's GPU us, the copy's and matmul's,
the idle generate's tok/s) and ``OUT/slow_state.json``.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import engine_state as E  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402
from benchmarks.after_capture import OTHER_PROCESS  # noqa: E402
from benchmarks.profile_step import capture_and_generate, quick_decode_engine  # noqa: E402
from benchmarks.run import TOUCH, descendants, pin, touch_capture  # noqa: E402

MB = 1 << 20
#: A process that makes a CUDA context and one small tensor, and exits: another context that
#: does no work to speak of.
CONTEXT_ONLY = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
WORKER_TRIGGERS = ("pin", "d2h", "d2h-pageable", "gather", "prepare", "side-kernel",
                   "main-kernel", "alloc-main", "alloc-side")
CLIENT_STEPS = ("capture", "other-process", "context-only", "wait")
WORKER_RESETS = ("second-context", "second-context-empty")
STEPS = (*CLIENT_STEPS, *WORKER_TRIGGERS, *WORKER_RESETS)
DEFAULT_STEPS = ("other-process", "capture", "second-context-empty", "second-context",
                 "context-only", "other-process", "pin", "d2h", "other-process", "gather",
                 "d2h-pageable", "other-process", "capture", "wait", "other-process")


# ---- in the worker (sent by collective_rpc as pickled functions) --------------------------------

def _copy_stream(worker):
    """The capture's copy stream where the worker has one, else a new side stream."""
    import torch

    from vllm_capture.engine.worker_ext import SESSION_ATTR

    session = getattr(worker, SESSION_ATTR, None)
    state = None if session is None else session.graph_state
    stream = None if state is None else getattr(state, "_copy_stream", None)
    return stream if stream is not None else torch.cuda.Stream()


def trigger(worker, name: str, mb: int, chunk_mb: int) -> dict | None:
    """Run trigger ``name`` (``WORKER_TRIGGERS``) in the worker; its ms, None off CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    chunks, rows = max(1, mb // chunk_mb), chunk_mb * MB // 4096
    stream, main = _copy_stream(worker), torch.cuda.current_stream()
    t = time.perf_counter()
    if name == "pin":
        torch._C._host_emptyCache()
        blocks = [torch.empty(rows * 4096, dtype=torch.uint8, pin_memory=True)
                  for _ in range(chunks)]
        del blocks
    elif name == "prepare":
        worker._slow_state_scratch = (
            torch.randint(0, 255, (chunks, rows, 4096), dtype=torch.uint8, device="cuda"),
            torch.randperm(rows, device="cuda"),
            torch.empty((rows, 4096), dtype=torch.uint8, device="cuda"))
    elif name in ("side-kernel", "main-kernel"):
        src, index, out = worker._slow_state_scratch
        on = stream if name == "side-kernel" else main
        on.wait_stream(main)
        with torch.cuda.stream(on):
            for k in range(chunks):
                torch.index_select(src[k], 0, index, out=out)
        main.wait_stream(on)
    elif name in ("alloc-main", "alloc-side"):
        torch.cuda.empty_cache()
        with torch.cuda.stream(stream if name == "alloc-side" else main):
            blocks = [torch.empty((rows, 4096), dtype=torch.uint8, device="cuda")
                      for _ in range(chunks)]
        del blocks
    else:
        src = torch.randint(0, 255, (chunks, rows, 4096), dtype=torch.uint8, device="cuda")
        index = torch.randperm(rows, device="cuda")
        torch._C._host_emptyCache()
        stream.wait_stream(main)
        kept = []
        with torch.cuda.stream(stream):
            for k in range(chunks):
                if name == "gather":
                    kept.append(src[k, index].sum(dtype=torch.int64))
                else:
                    host = torch.empty((rows, 4096), dtype=torch.uint8, pin_memory=name == "d2h")
                    host.copy_(src[k], non_blocking=name == "d2h")
                    kept.append(host)
        stream.synchronize()
        del kept, src, index
    torch.cuda.synchronize()
    return {"ms": round((time.perf_counter() - t) * 1e3, 1), "chunks": chunks}


def second_context(worker, work: bool) -> dict | None:
    """A second CUDA context in the worker's process (driver API), ``work``: 50 memsets of 256 MiB
    in it, then destroyed; the primary context torch uses is current again after."""
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    rc = {"get_device": lib.cuCtxGetDevice(ctypes.byref(dev))}
    rc["create"] = lib.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
    if rc["create"] != 0:
        return rc
    if work:
        size = ctypes.c_size_t(256 * MB)
        rc["alloc"] = lib.cuMemAlloc_v2(ctypes.byref(ptr), size)
        if rc["alloc"] == 0:
            for i in range(50):
                lib.cuMemsetD8_v2(ptr, ctypes.c_ubyte(i), size)
            rc["sync"] = lib.cuCtxSynchronize()
            rc["free"] = lib.cuMemFree_v2(ptr)
    rc["destroy"] = lib.cuCtxDestroy_v2(ctx)
    torch.cuda.synchronize()  # the primary context answers again
    return rc


# ---- the client ---------------------------------------------------------------------------------

def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="8b", choices=sorted(S.MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--capture", default="hidden-4l", help="a graph scenario of the suite")
    p.add_argument("--suite", default="full", choices=("quick", "full"))
    p.add_argument("--steps", default=",".join(DEFAULT_STEPS),
                   help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--mb", type=int, default=640, help="MiB a trigger moves (hidden-4l's drains)")
    p.add_argument("--chunk-mb", type=int, default=16, help="MiB a piece (a drain's size)")
    args = p.parse_args()
    steps = [s for s in args.steps.split(",") if s]
    if set(steps) - set(STEPS):
        p.error(f"--steps: unknown {', '.join(sorted(set(steps) - set(STEPS)))}")
    if args.capture not in S.SCENARIOS or S.SCENARIOS[args.capture].capture is None:
        p.error(f"--capture: a capture scenario, one of "
                f"{', '.join(k for k, v in S.SCENARIOS.items() if v.capture)}")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the steps travel as functions
    from vllm_capture import api

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, shape, w, params, prompts = quick_decode_engine(args.model, "capture-graph", args.suite)
    engine_pids = descendants(os.getpid())
    if len(os.sched_getaffinity(0)) >= 8:  # as after_capture.py runs them
        pin([os.getpid()], [0, 1, 2, 3])
        pin(engine_pids, [4, 5, 6, 7])
    llm.generate(prompts.make(w), params, use_tqdm=False)
    cap = S.SCENARIOS[args.capture].capture
    small = params.clone()
    small.max_tokens = TOUCH.new_tokens
    touch_capture(api, llm, cap, shape, prompts, small)
    api.stop_capture(llm, cap.stream)

    def run_step(name: str):
        if name == "capture":
            gen_s, _ = capture_and_generate(llm, cap, shape, w, params, prompts)
            api.fetch_captured(llm, cap.stream, clear=True)
            api.stop_capture(llm, cap.stream)
            return {"capture_tok_s": round(w.generated_tokens / gen_s)}
        if name in ("other-process", "context-only"):
            code = OTHER_PROCESS if name == "other-process" else CONTEXT_ONLY
            return subprocess.run([sys.executable, "-c", code], timeout=120).returncode
        if name == "wait":
            time.sleep(E.WAIT_S)
            return None
        if name in WORKER_TRIGGERS:
            return llm.collective_rpc(trigger, kwargs={"name": name, "mb": args.mb,
                                                       "chunk_mb": args.chunk_mb})[0]
        return llm.collective_rpc(second_context,
                                  kwargs={"work": name == "second-context"})[0]

    rows = []
    for i, name in enumerate(["start", *steps]):
        result = None if name == "start" else run_step(name)
        state = llm.collective_rpc(E.device_state, kwargs={"tokens": w.concurrency})[0]
        gen_s, _ = capture_and_generate(llm, None, shape, w, params, prompts)
        graph = None if state is None else state["graph"]
        row = {"i": i, "step": name, "result": result,
               "graph_gpu_us": None if graph is None else round(graph["gpu_us"], 1),
               "copy_us": None if state is None else round(state["reference"]["copy_256mb"]["gpu_us"], 1),
               "matmul_us": None if state is None else round(state["reference"]["matmul_4096"]["gpu_us"], 1),
               "idle_tok_s": round(w.generated_tokens / gen_s),
               "memory": None if state is None else state["memory"]}
        rows.append(row)
        print(f"{i:>2} {name:<22} graph {row['graph_gpu_us']} us  copy {row['copy_us']} us  "
              f"matmul {row['matmul_us']} us  idle {row['idle_tok_s']} tok/s  {result}",
              flush=True)
    (out / "slow_state.json").write_text(json.dumps(
        {"model": args.model, "capture": args.capture, "mb": args.mb, "chunk_mb": args.chunk_mb,
         "rows": rows}, indent=1, default=str))
    print(f"{'step':<24}{'graph us':>10}{'idle tok/s':>12}")
    for r in rows:
        print(f"{r['i']:>2} {r['step']:<21}{str(r['graph_gpu_us']):>10}{r['idle_tok_s']:>12}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
