#!/usr/bin/env python3
"""Where a capture step's time goes, on the GPU host: one in-process engine, torch.profiler.

    python3 benchmarks/profile_step.py --model 1b --out /tmp/out [--scenarios idle,heavy]
    python3 benchmarks/profile_step.py --model 1b --out /tmp/out --engine vanilla

Runs the quick suite's decode workload (64 prompts x 32 tokens, 256 new tokens) on one capture
engine (CUDA graphs), or with ``--engine vanilla`` on a plain ``vllm.LLM`` (scenario ``vanilla``:
what the idle engine's step is compared with), in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the profiler sees the scheduler, the worker and our
hooks together. For each scenario (by default capture idle,
last-token hidden states of all layers, all positions of 4 layers; any graph scenario of the suite
by name) it times plain generates and their fetches, then profiles one and writes the CPU-side
operator table (host syncs, pinned allocations, copies, kernel launches) to
``OUT/profile_<scenario>.txt``, then ``--cprofile-reps`` more under cProfile
(``OUT/cprofile_<scenario>.txt``: the Python of the step, by function; capture's functions by
cumulative time; the raw stats in ``OUT/cprofile_<scenario>.pstats``); the summary
(``OUT/profile_summary_<engine>.json``) compares the scenarios by call counts, host time per
decode step, capture's functions per step under cProfile, and the GPU's busy time per step
against the profiled generate's step time. The profiled generate's first engine iterations are
read one by one too (``first_iterations``: ``OUT/iterations_<scenario>.json``, and in the
summary without their longest calls and every op), and every op of the profiled generate, its
calls and self CPU and device ms, goes to ``OUT/ops_<scenario>.json``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import scenarios as S  # noqa: E402
from benchmarks.run import Prompts, prepare_model, thread_time_spent, thread_times  # noqa: E402

#: The profiled generate's first engine iterations, each read apart: session 33's benchmark saw
#: a last-token capture's second iteration take 5.6-7.4 ms more than idle's, its thread on the
#: CPU throughout (a CUDA wait spins); session 35 found it to be the part of the prefill that
#: runs outside CUDA graphs. Per iteration: its ms, the GPU time of the work it launched, the CPU
#: calls that took its time by name and the longest single ones (``first_iterations``).
FIRST_ITERATIONS, TOP_CALLS = 4, 8
ITERATION_LABEL = "engine iteration "
WATCH = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaHostAlloc",
         "cudaMemcpyAsync", "cudaLaunchKernel", "cuLaunchKernel", "cudaGraphLaunch", "aten::copy_",
         "aten::pin_memory", "aten::item", "aten::_local_scalar_dense")


def quick_decode_engine(model: str, engine: str, suite: str = "quick"):
    """One engine of ``suite`` (``capture-graph`` or ``vanilla-graph``) for ``model``, with what
    runs the suite's first workload (a decode): ``(llm, shape, workload, sampling params,
    prompts)``."""
    from vllm import LLM, SamplingParams

    import vllm_capture as vc

    shape = S.MODELS[model]
    suite = S.make_suite(suite, model)
    w = suite.workloads[0]
    model_dir = prepare_model(shape, Path(tempfile.mkdtemp(prefix="vllm-capture-step-")))
    make = vc.LLM if S.ENGINES[engine].capture else LLM
    llm = make(str(model_dir), **S.engine_kwargs(suite, shape, engine))
    params = SamplingParams(max_tokens=w.new_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    return llm, shape, w, params, Prompts(shape.vocab)


def engine_main_thread(threads: dict) -> tuple[float, float]:
    """Of ``capture_and_generate``'s thread times, the busiest process's first thread (the engine
    core's, where the steps run): ms on a CPU and waiting for one."""
    return max((v for k, v in threads.items() if k.endswith("(main)")), key=lambda v: v[0])


def label_iterations(core) -> list[int]:
    """Run each step of the in-process engine core ``core`` inside a profiler range named
    ``ITERATION_LABEL`` + its index; the returned one-item list holds the next index (set it
    to 0 before a generate)."""
    from torch.profiler import record_function

    step, counter = core.step_fn, [0]

    def labelled_step():
        k, counter[0] = counter[0], counter[0] + 1
        with record_function(f"{ITERATION_LABEL}{k}"):
            return step()

    core.step_fn = labelled_step
    return counter


def first_iterations(events, count: int = FIRST_ITERATIONS, top: int = TOP_CALLS) -> list[dict]:
    """Of a profile's ``events`` (``prof.events()``), iterations ``0..count-1`` as
    ``label_iterations`` named them: ``ms`` (the range, on the host), ``device_ms`` (kernels and
    copies launched in it), ``self_ms`` (the self CPU ms of the calls in it, by name, the
    ``top`` largest), ``ops`` (every name's self CPU ms and call count, so that two engines'
    iterations can be told apart op by op) and ``longest`` (its ``top`` longest single calls,
    self CPU ms)."""
    from torch.autograd import DeviceType

    # On a GPU each range also appears as a device-side annotation of the same name, spanning
    # only the kernels in it; the host range is the one that holds the iteration.
    ranges = {e.name: e for e in events
              if e.name.startswith(ITERATION_LABEL) and e.device_type == DeviceType.CPU}
    out = []
    for k in range(count):
        r = ranges.get(f"{ITERATION_LABEL}{k}")
        if r is None:
            break
        start, end = r.time_range.start, r.time_range.end
        inside = [e for e in events if e is not r and e.thread == r.thread
                  and start <= e.time_range.start and e.time_range.end <= end]
        by_name: dict[str, list] = {}  # name -> [self CPU us, calls]
        for e in inside:
            entry = by_name.setdefault(e.name, [0.0, 0])
            entry[0] += e.self_cpu_time_total
            entry[1] += 1
        longest = sorted(inside, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        largest = sorted(by_name.items(), key=lambda kv: kv[1][0], reverse=True)
        out.append({"iteration": k, "ms": round((end - start) / 1e3, 3),
                    "device_ms": round(r.device_time_total / 1e3, 3),
                    "self_ms": {name: round(us / 1e3, 3) for name, (us, _) in largest[:top]},
                    "ops": {name: [round(us / 1e3, 3), calls] for name, (us, calls) in largest},
                    "longest": [[e.name, round(e.self_cpu_time_total / 1e3, 3)] for e in longest]})
    return out


def capture_and_generate(llm, cap, shape, w, params, prompts, pids=()) -> tuple[float, dict]:
    """Start ``cap``'s stream (``None``: capture nothing), then generate ``w``'s batch once:
    the generate's seconds, and the CPU time of the threads of ``pids`` over the generate alone
    (``run.thread_time_spent``: ms on a CPU and waiting for one, by thread name)."""
    from vllm_capture import api

    if cap is not None:
        api.start_capture(llm, cap.stream, layers=cap.layer_ids(shape), reduce=cap.reduce)
    before = thread_times(list(pids))
    t = time.perf_counter()
    llm.generate(prompts.make(w), params, use_tqdm=False)
    gen_s = time.perf_counter() - t
    return gen_s, thread_time_spent(before, thread_times(list(pids)))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b", choices=sorted(S.MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--engine", default="capture", choices=("capture", "vanilla"))
    p.add_argument("--cprofile-reps", type=int, default=1,
                   help="generates profiled by cProfile, into one profile (default 1)")
    p.add_argument("--scenarios", help="comma list: idle, or scenarios of the suite on the "
                   "capture-graph engine (default idle,hidden-last,hidden-4l; a vanilla engine "
                   "runs vanilla only)")
    args = p.parse_args()
    if args.cprofile_reps < 1:
        p.error(f"--cprofile-reps: at least 1, not {args.cprofile_reps}")
    capture = args.engine == "capture"
    if capture:
        names = (args.scenarios or "idle,hidden-last,hidden-4l").split(",")
        bad = [n for n in names if n != S.IDLE and (
            n not in S.SCENARIOS or S.SCENARIOS[n].capture is None
            or S.SCENARIOS[n].engine != "capture-graph")]
        if bad:
            p.error(f"--scenarios: not a capture-graph scenario: {', '.join(bad)}")
    elif args.scenarios:
        p.error("--scenarios: a vanilla engine runs the vanilla scenario only")
    else:
        names = [S.BASELINE]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from vllm_capture import api

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, shape, w, params, prompts = quick_decode_engine(
        args.model, "capture-graph" if capture else "vanilla-graph")
    llm.generate(prompts.make(w), params, use_tqdm=False)
    iteration = label_iterations(llm.llm_engine.engine_core.engine_core)
    scenarios = {n: S.SCENARIOS[n].capture for n in names}

    def host_timers() -> dict:
        return api.capture_status(llm, S.HIDDEN)["host_timers"] if capture else {}

    summary = {}
    for name, cap in scenarios.items():
        def generate():
            before = host_timers()
            gen_s, _ = capture_and_generate(llm, cap, shape, w, params, prompts)
            after = host_timers()
            t = time.perf_counter()
            if cap is not None:
                api.fetch_captured(llm, cap.stream, clear=True)
                api.stop_capture(llm, cap.stream)
            timers = {k: round(after[k] - before[k], 3) for k in after}
            return gen_s, {"host_timers_this_generate": timers, "fetch_s": time.perf_counter() - t}

        times = [generate()[0] for _ in range(args.reps)]
        iteration[0] = 0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prof_s, status = generate()
        first = first_iterations(prof.events())
        (out / f"iterations_{name}.json").write_text(json.dumps(first, indent=1))
        averages = prof.key_averages()  # aggregated anew on every call: once for all below
        table = averages.table(sort_by="self_cpu_time_total", row_limit=45)
        (out / f"profile_{name}.txt").write_text(table)
        # Every op of the generate, not the table's first rows: session 66's idle and vanilla
        # tables could not be compared op by op (a name past the cut read as absent).
        (out / f"ops_{name}.json").write_text(json.dumps(
            {e.key: {"calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
                     "self_device_ms": round(e.self_device_time_total / 1e3, 3)}
             for e in averages}, indent=0))
        watched = {}
        for e in averages:
            if e.key in WATCH or e.key.startswith("vllm_capture"):
                watched[e.key] = {"calls": e.count, "cpu_ms": round(e.self_cpu_time_total / 1e3, 2)}
        # The GPU's busy time against the step's: whether the host or the GPU sets the pace
        # (kernels and copies, graph replays' kernels included; overlapping streams add up).
        device_ms = sum(e.self_device_time_total for e in averages
                        if e.device_type == DeviceType.CUDA) / 1e3
        # Then generates under cProfile (this thread: the scheduler's and the worker's): where
        # the Python of a step goes, capture's functions by name. The raw stats are kept too, so
        # that two scenarios can be compared function by function (`pstats` on the .pstats files).
        python_profile = cProfile.Profile()
        for _ in range(args.cprofile_reps):
            python_profile.enable()
            generate()
            python_profile.disable()
        python_profile.dump_stats(out / f"cprofile_{name}.pstats")
        text = io.StringIO()
        stats = pstats.Stats(python_profile, stream=text)
        stats.sort_stats("tottime").print_stats(40)
        stats.sort_stats("cumulative").print_stats("vllm_capture", 40)
        (out / f"cprofile_{name}.txt").write_text(text.getvalue())
        ours = sorted(((ct, f"{Path(file).name}:{func}") for (file, _, func), (_, _, _, ct, _)
                       in stats.stats.items() if "vllm_capture" in file), reverse=True)[:25]
        summary[name] = {"device_ms_per_step": round(device_ms / w.new_tokens, 4),
                         "profiled_ms_per_step": round(prof_s * 1e3 / w.new_tokens, 4),
                         "gen_s": times, "tok_s": [w.generated_tokens / t for t in times],
                         "profiled_gen_s": prof_s, "watched": watched,
                         "first_iterations": [{k: v for k, v in it.items()
                                               if k not in ("longest", "ops")} for it in first],
                         "cprofile_capture_ms_per_step": {
                             where: round(ct * 1e3 / (w.new_tokens * args.cprofile_reps), 4)
                             for ct, where in ours},
                         **status}
        print(name, json.dumps(summary[name])[:1500], flush=True)
    (out / f"profile_summary_{args.engine}.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
