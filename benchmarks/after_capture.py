#!/usr/bin/env python3
"""What a capture leaves in the engine: idle generates before and after a capture, then after
each way of letting go of what it held.

    python3 benchmarks/after_capture.py --model 8b --out /tmp/out [--capture hidden-4l]
        [--idle 4] [--captures 2] [--rounds 2] [--beside-vanilla | --in-process]
        [--suite quick|full] [--releases wait,synchronize,...] [--vanilla-between each|none]

Why: on the H200 (8B, decode-c64) the benchmark's idle capture engine runs at vanilla's speed
until its first full hidden-4l generate, then about 2.5% slower in every idle generate after it
(session 23's run W; session 24's runs with the package as at HEAD, d18d3ea, 58a15b9 and e7f71b2
alike, so no change of the package's last 17 commits brought it); hidden-4l's own generates then
run at that same slower speed. Beside hidden-last (run U) idle did not slow. The 8B's step is
the GPU's (the engine's main thread is busy 3.5 of 6 ms), so whatever lingers slows the device's
work or starves it. Session 24's first run of this script did not reproduce it: there, before
each event's idle generates, the FULL decode graph was replayed 60 times in the worker and the
device synchronized (a probe the benchmark never runs), and the probe right after the capture read
the graph 2.7% slower (5,697 against 5,549 us), the idle generates after it at full speed. So the
probe no longer runs between the capture and the idle generates after it; releases
``synchronize`` and ``replays`` (the probe itself) come right after ``wait``.

One capture engine, as the benchmark runs it (engine core forked, on CPUs 4-7, this client on
0-3, one small capture of the same stream first, as the benchmark's ``touch_streams``), goes
through, per round:

- ``before``: ``--idle`` idle generates;
- ``capture``: ``--captures`` generates of ``--capture`` (the benchmark's idle slowed after its
  first two), each fetched (rows dropped at once, as the benchmark does), the stream stopped;
- ``after``: idle generates;
- then each release in turn, each followed by idle generates: ``wait`` (5 s of nothing),
  ``synchronize`` (``torch.cuda.synchronize`` in the worker), ``replays`` (the probe below: the
  FULL decode graph replayed alone as launched now, then a synchronize), ``client`` (this process's
  fetched files let go: ``gc``, ``shm.settle``), ``worker-shm`` (the worker's kept reply-file
  mappings and spare dropped and unmapped), ``device-cache`` (``torch.cuda.empty_cache`` in
  the worker), ``host-cache`` (torch's caching host allocator emptied: the pinned blocks drains
  were copied into), ``graph-copies`` (every captured graph's copies but the one replays use
  destroyed), ``other-process`` (a process of its own runs 2 s of matmuls on the GPU and exits),
  ``vanilla-generate`` (one generate of the vanilla engine, with ``--beside-vanilla``),
  ``heads-4l`` (one generate capturing another stream, ``heads-4l``, fetched and stopped: in
  session 15's run, where idle kept vanilla's speed after hidden-4l, heads-4l came between).

The probe: the FULL decode graph replayed alone in the worker, 10 times and then 50 timed
(``graph_replay``'s timing: whether the device's work for the same graph got slower, or the
engine's step starves it), a device copy and a matmul timed beside it, and the worker's device
and pinned host allocators' holdings read. It runs as the ``replays`` release and after the idle
generates of every event from then on (``before`` of the later rounds included), never between
a capture and the releases before ``replays``, nor before the first round's capture (session 24's
first run read 5,542-5,562 us a replay of the 8B's graph at rest). The first release after which
idle runs at ``before``'s speed again names what lingered; none doing so points at the device (a
GPU-side state no release reaches) or at the engine's own drift, which ``--rounds 2`` (the whole
sequence twice) and ``--beside-vanilla`` (a vanilla engine in a process of its own, on CPUs
8-11, one generate before each of the capture engine's, as in the benchmark) tell apart.

Session 25 ran this form with the quick suite's engines and with the full suite's (``--suite
full``, the benchmark's engine settings: 256 sequences, model length 2304, 1,667 graphs): idle
kept its speed after the captures in both, while the benchmark slowed the same hour; ``run.py
--release-after-capture`` and ``--probe-graphs`` take the releases and the probe into the
benchmark itself (``engine_state.py`` holds both). Read by what ran just before, the
benchmark's idle generates after a big capture ran slow after the capture engine's own generates
only: in session 22's run 20261202-001352 (a second vanilla engine beside) idle ran at 0.992 and
1.004 right after that engine's generates and 0.972-0.975 right after hidden-last's, and in every
hidden-4l run since, idle never followed another engine's generate but the first. Here a vanilla
generate ran before each of the capture engine's: ``--vanilla-between none`` leaves it out (the
vanilla engine started, idle), so that ``other-process`` (another CUDA context's work) and
``vanilla-generate`` can tell whether another engine's work is what ends the slow state.

One line per generate (label, tok/s, the engine core's main thread ms a step on a CPU, the graph
replays launched from a copy and the idle capture nodes replays ran, the graphs the registry holds
and the copies held, NVML's readings, vanilla's tok/s and readings) and a summary: median tok/s
per label and round against that round's ``before`` (and against vanilla's), in
``OUT/after_capture.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import engine_state as E  # noqa: E402
from benchmarks import report as R  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402
from benchmarks.profile_step import (  # noqa: E402
    capture_and_generate, engine_main_thread, quick_decode_engine)
from benchmarks.run import (  # noqa: E402
    TOUCH, GpuSampler, Nvml, descendants, pin, touch_capture)

RELEASES = ("wait", "synchronize", "replays", "client", "worker-shm", "device-cache",
            "host-cache", "graph-copies", "other-process", "vanilla-generate", "heads-4l")
#: What the ``other-process`` release runs: a process of its own doing 2 s of bf16 matmuls on the
#: GPU, then exiting (work of another CUDA context between the capture engine's generates).
OTHER_PROCESS = """
import time, torch
x = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
end = time.perf_counter() + 2.0
while time.perf_counter() < end:
    for _ in range(20):
        y = x @ x
    torch.cuda.synchronize()
"""


def _gpu_text(gpu: dict | None) -> str:
    """A generate's NVML readings (``report.gpu_summary``) for its line; empty without NVML."""
    if gpu is None:
        return ""
    sm, w, rx, tx = (R._f(gpu[k], "{:.0f}") for k in ("sm_mhz", "power_w", "pcie_rx_mb_s",
                                                      "pcie_tx_mb_s"))
    return f"  [{sm} MHz {w} W PCIe rx {rx} tx {tx} MB/s reasons {gpu['clock_reasons']:#x}]"


def summarize(runs: list[dict]) -> dict:
    """The capture engine's median tok/s by round and label, against its round's ``before`` and,
    where a vanilla engine ran beside it, against vanilla's median of the same label."""
    out: dict = {}
    for r in sorted({m["round"] for m in runs}):
        def median(engine: str, label: str) -> float | None:
            v = [m["tok_s"] for m in runs
                 if m["round"] == r and m["label"] == label and m["engine"] == engine]
            return statistics.median(v) if v else None

        labels = list(dict.fromkeys(m["label"] for m in runs if m["round"] == r))
        before = median("capture", "before")
        out[r] = {}
        for label in labels:
            tok_s, base = median("capture", label), median("vanilla", label)
            out[r][label] = {"tok_s": round(tok_s), "vs_before": round(tok_s / before, 4),
                             "vs_vanilla": None if base is None else round(tok_s / base, 4)}
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="8b", choices=sorted(S.MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--capture", default="hidden-4l", help="a graph scenario of the suite")
    p.add_argument("--idle", type=int, default=4, help="idle generates after each event")
    p.add_argument("--captures", type=int, default=2, help="capture generates in a row per round")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--vanilla-between", default="each", choices=("each", "none"),
                   help="with --beside-vanilla: one vanilla generate before each of the capture "
                        "engine's (each, as before), or none, the vanilla engine idle but for the "
                        "vanilla-generate release (in the benchmark, the 8B's idle ran slow after "
                        "its own generates and at full speed after another engine's)")
    p.add_argument("--suite", default="quick", choices=("quick", "full"),
                   help="whose engine settings: the full suite's (bench-8b-idle's: 256 "
                        "sequences, model length 2304) or the quick suite's (64 and 512)")
    p.add_argument("--releases",
                   help=f"which releases, in this order (default: all, {','.join(RELEASES)}; "
                        "vanilla-generate only with --beside-vanilla)")
    p.add_argument("--in-process", action="store_true")
    p.add_argument("--beside-vanilla", action="store_true",
                   help="a vanilla engine beside it, as in the benchmark, one of its generates "
                        "before each of the capture engine's: the speed the capture engine's is "
                        "read against, minute by minute")
    args = p.parse_args()
    releases = ([r for r in RELEASES if args.beside_vanilla or r != "vanilla-generate"]
                if args.releases is None else [r for r in args.releases.split(",") if r])
    if set(releases) - set(RELEASES):
        p.error(f"--releases: unknown {', '.join(sorted(set(releases) - set(RELEASES)))}")
    if args.in_process and args.beside_vanilla:
        p.error("--beside-vanilla needs each engine in a process of its own (not --in-process)")
    if "vanilla-generate" in releases and not args.beside_vanilla:
        p.error("--releases: vanilla-generate needs --beside-vanilla")
    if args.vanilla_between == "none" and not args.beside_vanilla:
        p.error("--vanilla-between: none needs --beside-vanilla (without it no vanilla "
                "generate runs between the capture engine's anyway)")
    if args.capture not in S.SCENARIOS or S.SCENARIOS[args.capture].capture is None:
        p.error(f"--capture: a capture scenario, one of "
                f"{', '.join(k for k, v in S.SCENARIOS.items() if v.capture)}")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the releases travel as functions
    from vllm_capture import api

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, shape, w, params, prompts = quick_decode_engine(args.model, "capture-graph", args.suite)
    engine_pids = [os.getpid()] if args.in_process else descendants(os.getpid())
    vanilla = (quick_decode_engine(args.model, "vanilla-graph", args.suite)[0]
               if args.beside_vanilla else None)
    cap = S.SCENARIOS[args.capture].capture
    nvml = Nvml()
    cpus = {}
    if not args.in_process and len(os.sched_getaffinity(0)) >= 12:
        cpus = {"client": [0, 1, 2, 3], "engine": [4, 5, 6, 7], "vanilla": [8, 9, 10, 11]}
        pin([os.getpid()], cpus["client"])
        pin(engine_pids, cpus["engine"])
        pin([q for q in descendants(os.getpid()) if q not in engine_pids], cpus["vanilla"])
    for engine in (llm, vanilla):
        if engine is not None:
            engine.generate(prompts.make(w), params, use_tqdm=False)
    small = params.clone()  # the benchmark's touch: its own token count
    small.max_tokens = TOUCH.new_tokens
    touch_capture(api, llm, cap, shape, prompts, small)
    api.stop_capture(llm, cap.stream)
    runs: list[dict] = []
    released: dict = {}
    device_state: dict = {}

    def read_device(round_: int, label: str) -> None:
        state = llm.collective_rpc(E.device_state, kwargs={"tokens": w.concurrency})[0]
        device_state[f"{round_}:{label}"] = state
        if state is not None:
            graph, ref = state["graph"], state["reference"]
            print(f"{round_} {label:<16} graph "
                  + ("-" if graph is None else f"{graph['gpu_us']:.1f} us on the GPU, "
                     f"{graph['host_launch_us']:.1f} us to launch")
                  + f"; copy {ref['copy_256mb']['gpu_us']:.1f} us, matmul "
                  f"{ref['matmul_4096']['gpu_us']:.1f} us; {state['memory']}", flush=True)

    def graph_nodes() -> dict:
        return api.capture_status(llm, S.HIDDEN).get("graph_nodes") or {}

    def replay_counts(nodes: dict) -> tuple[int, int]:
        return nodes.get("copy_replays") or 0, nodes.get("idle_nodes_replayed") or 0

    def generate_vanilla(round_: int, label: str) -> None:
        with GpuSampler(nvml) as gpu:
            t = time.perf_counter()
            vanilla.generate(prompts.make(w), params, use_tqdm=False)
            gen_s = time.perf_counter() - t
        runs.append({"round": round_, "label": label, "engine": "vanilla",
                     "tok_s": w.generated_tokens / gen_s, "gpu": gpu.summary})

    interleaved = vanilla is not None and args.vanilla_between == "each"

    def generate(round_: int, label: str, capture=None) -> None:
        if interleaved:
            generate_vanilla(round_, label)
        counts = replay_counts(graph_nodes())
        with GpuSampler(nvml) as gpu:
            gen_s, threads = capture_and_generate(llm, capture, shape, w, params, prompts,
                                                  engine_pids)
        nodes = graph_nodes()
        copies, idle_nodes = (b - a for a, b in zip(counts, replay_counts(nodes)))
        fetch_s = None
        if capture is not None:
            t = time.perf_counter()
            tensors, _, _ = api.fetch_captured(llm, capture.stream, clear=True)
            fetch_s = time.perf_counter() - t
            del tensors
            api.stop_capture(llm, capture.stream)
        main = engine_main_thread(threads)
        m = {"round": round_, "label": label, "engine": "capture",
             "tok_s": w.generated_tokens / gen_s, "gen_s": gen_s, "fetch_s": fetch_s,
             "main_on_cpu_ms": main[0] / w.new_tokens, "copy_replays": copies,
             "idle_nodes_replayed": idle_nodes, "graphs": nodes.get("graphs"),
             "graph_copies": nodes.get("graph_copies"), "gpu": gpu.summary}
        runs.append(m)
        print(f"{round_} {label:<16} {m['tok_s']:>9.0f} tok/s"
              f"  main {m['main_on_cpu_ms']:.3f} ms/step  copies {copies} idle nodes {idle_nodes}"
              f"  graphs {m['graphs']} held copies {m['graph_copies']}"
              + (f"  fetch {fetch_s:.3f} s" if fetch_s is not None else "") + _gpu_text(gpu.summary)
              + (f"  vanilla {runs[-2]['tok_s']:.0f}{_gpu_text(runs[-2]['gpu'])}"
                 if interleaved else ""), flush=True)

    for round_ in range(args.rounds):
        for _ in range(args.idle):
            generate(round_, "before")
        if round_ > 0:  # the first round's capture meets the engine as the benchmark's does
            read_device(round_, "before")
        for _ in range(args.captures):
            generate(round_, "capture", cap)
        for _ in range(args.idle):
            generate(round_, "after")
        # No probe before the ``replays`` release, which is the probe: its replays and its
        # synchronize may themselves end a slow state (as in session 24's first run).
        probed = False
        for name in releases:
            if name == "heads-4l":  # another stream's capture, as session 15's reps ran it
                generate(round_, "heads-4l-capture", S.SCENARIOS["heads-4l"].capture)
            elif name == "replays":
                read_device(round_, name)
                probed = True
            elif name == "vanilla-generate":
                generate_vanilla(round_, name)
            elif name == "other-process":
                released[f"{round_}:{name}"] = subprocess.run(
                    [sys.executable, "-c", OTHER_PROCESS], timeout=120).returncode
            else:
                released[f"{round_}:{name}"] = E.release(llm, name)
            for _ in range(args.idle):
                generate(round_, name)
            if probed:
                read_device(round_, name)
    summary = summarize(runs)
    print(f"{'median tok/s':<16}" + "".join(f"{'round ' + str(r):>20}" for r in summary))
    for label in dict.fromkeys(m["label"] for m in runs):
        print(f"{label:<16}" + "".join(
            f"{v[label]['tok_s']:>11} ({v[label]['vs_before']:.3f}"
            + (f"; {v[label]['vs_vanilla']:.3f}" if v[label]["vs_vanilla"] is not None else "")
            + ")" for v in summary.values()))
    (out / "after_capture.json").write_text(json.dumps(
        {"model": args.model, "capture": args.capture, "idle": args.idle, "cpus": cpus,
         "released": released, "device_state": device_state, "summary": summary, "runs": runs},
        indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
