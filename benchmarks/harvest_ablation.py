#!/usr/bin/env python3
"""Where a row stream's step time goes: the step path, or the harvest thread's store beside it.

    python3 benchmarks/harvest_ablation.py --model 1b --out /tmp/out [--reps 8] [--in-process]
        [--switch-interval 0.0005]

One capture engine with CUDA graphs runs the quick suite's decode workload rep after rep, each
rep going through these cases in turn (every other rep in reverse order):

- ``idle``: no stream;
- ``hidden-last``: last-token hidden states of all layers (no rows drained while it runs);
- ``hidden-4l``: all positions of 4 layers, as shipped;
- ``hidden-4l-nostore``: the same, but the harvest thread only waits for each drain's copy and
  drops its rows: no grouping, no store append, no fetch. What it gains on ``hidden-4l`` is what
  the harvest thread's store costs the step (the GIL and the host's cores it shares); what
  remains against ``idle`` is the step path and the device's copies.

By default the engine runs as in the benchmark: its engine core in a process of its own, forked
from this one (so the patch below is in it too), pinned to CPUs 4-7 with this client on 0-3 when
the host has 8 or more. ``--in-process`` runs it in this process instead
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as ``profile_step.py``): no engine-core threads and no
client process beside it, which on the H200 (session 17) hid most of what hidden-4l costs.

Each case's stream starts before its generate, as ``run.py`` starts it, outside the timed
generate and its first iterations (the start's RPC apart, as ``start_ms``). Each case's
generates are timed and paired with ``idle``'s of the same rep (geometric mean of
the ratios, 95% interval), with the capture's host timers per step, the engine core's main
thread's milliseconds a step on a CPU and blocked (``main_on_cpu_ms``, ``main_blocked_ms``: the
1B's step is that thread's, and vLLM's wait for a step's output sleeps), and their median tok/s by
the case that ran just before (``tok_s_after``: in the benchmark's 1B runs, idle read 6% lower
against vanilla in the reps where it followed a capture), and the engine's step by phase
(``PHASES``: the scheduler, the executor's and the runner's calls, the output wait, graph replay,
capture's step path), ms a step and the same rep's difference from idle, so that a cost outside
capture's own timers shows where in vLLM's step it lands. The summary goes to
``OUT/harvest_ablation.json``; one line per case is printed. A diagnostic: a dropped row is
never what the product does, so the patches live here, each switched on by a file that only its
case creates, read in the engine when the case's stream starts, and each checked to have reached
the engine process, so that a patch that did not fails the run instead of passing for the product.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report as R  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402
from benchmarks.profile_step import (  # noqa: E402
    capture_and_generate, engine_main_thread, quick_decode_engine)
from benchmarks.run import descendants, pin  # noqa: E402

CASES = ("idle", "hidden-last", "hidden-4l", "hidden-4l-nostore")
#: A generate's first engine iterations, each timed apart by phase: in sessions 33-35's
#: benchmarks a last-token capture's second iteration (session 35: the part of the prefill that
#: runs outside CUDA graphs) took about 7 ms more than idle's, with the first level.
FIRST_ITERATIONS = 4
#: A case's suffix and the patch switches it turns on.
SUFFIX_SWITCHES = {"-nostore": ("drop",), "-nohost": ("skip",), "-nogpu": ("nogpu",),
                   "-nonodes": ("nonodes",), "-bare": ("skip", "nonodes")}
KNOWN_CASES = (*CASES, "hidden-last-nohost", "hidden-4l-nohost", "hidden-last-nogpu",
               "hidden-last-nonodes", "hidden-last-bare")


class Switches:
    """The patches' switches: files in one folder, which this client creates and removes, read
    in the engine's process when a stream starts (``read``, from the patched ``enable_stream``),
    so that a step reads a bool, not a file (a stat a step cost the step path about 0.026 ms on
    the H200 host, in every case, before session 23)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.on: frozenset[str] = frozenset()

    def read(self) -> None:
        self.on = frozenset(p.name for p in self.folder.iterdir())


def read_switches_at_stream_start(switches: Switches) -> None:
    from vllm_capture.session import session as session_module

    enable_stream = session_module.CaptureSession.enable_stream

    def enable_stream_switched(self, stream, **config_kwargs):
        switches.read()
        return enable_stream(self, stream, **config_kwargs)

    session_module.CaptureSession.enable_stream = enable_stream_switched


def drop_stores(switches: Switches, name: str) -> None:
    """Patch the harvest thread's store: while switch ``name`` is on, wait for each drain's copy
    and drop its rows (finish markers and reductions are stored as usual). Patched before the
    engine starts, so that its forked engine core has it too."""
    from vllm_capture.session import session as session_module

    store_batch = session_module.CaptureSession._store_batch

    def store_or_drop(self, batch):
        if name not in switches.on:
            return store_batch(self, batch)
        kept = []
        for item in batch:
            if isinstance(item, session_module._Drained):
                self._wait_copy(item.rows)
            else:
                kept.append(item)
        return store_batch(self, kept)

    session_module.CaptureSession._store_batch = store_or_drop


def skip_step_path(switches: Switches, name: str) -> None:
    """Patch the session's step path: while switch ``name`` is on, a step with as many requests
    and (padded) tokens as the step before it skips ``begin_step``, so the device's plan stays the
    last planned step's."""
    from vllm_capture.session import session as session_module

    begin_step = session_module.CaptureSession.begin_step
    last_shape = [None]

    def begin_or_skip(self, step):
        shape = (len(step.req_ids), step.num_rows_padded)
        repeated, last_shape[0] = shape == last_shape[0], shape
        if not (repeated and name in switches.on):
            begin_step(self, step)

    session_module.CaptureSession.begin_step = begin_or_skip


def idle_on_device(switches: Switches, name: str) -> None:
    """Patch the switching of sites: while switch ``name`` is on, sites switched on stay on for
    the host (plans, graph copies keeping their nodes) while their device flags stay off."""
    from vllm_capture.capture_graph import state as state_module
    from vllm_capture.kernels import layout as L

    set_enabled = state_module.CaptureGraphState.set_enabled

    def set_enabled_host_only(self, component, layers):
        set_enabled(self, component, layers)
        if name in switches.on:
            for site in self.sites_of(component):
                site.counter[L.SITE_ENABLED] = 0

    state_module.CaptureGraphState.set_enabled = set_enabled_host_only


def leave_nodes_out(switches: Switches, name: str) -> None:
    """Patch the switching of sites: while switch ``name`` is on, sites switched on stay on for
    the host (plans, drains, reductions) while the graphs launched leave their capture nodes out,
    as they do for idle sites: the GPU runs what it runs idle, and the step path runs as shipped.
    (Patched after ``idle_on_device``, so that this runs last.)"""
    from vllm_capture.capture_graph import state as state_module

    set_enabled = state_module.CaptureGraphState.set_enabled

    def set_enabled_without_nodes(self, component, layers):
        set_enabled(self, component, layers)
        if name in switches.on and self.nodes is not None:
            self.nodes.set_sites({site.counter.data_ptr(): False
                                  for site in self.sites_of(component)})

    state_module.CaptureGraphState.set_enabled = set_enabled_without_nodes


def nodes_check(on: tuple[str, ...], idle: dict | None, capturing: dict | None) -> str | None:
    """Whether ``nonodes`` acted as switched (``on``), read from the engine's graph registry
    (``capture_status``'s ``graph_nodes``) with every site idle (``idle``) and while the stream
    ran (``capturing``): without its nodes the graphs launched leave out as many capture nodes
    as idle ones do (all but the pinned site's), with them fewer. Not the rows: a reduction's
    positions are the step path's to keep, whatever the graphs ran (session 30's run stopped on
    that). What went wrong, or None (nothing to read: no registry, off CUDA)."""
    if not idle or not capturing:
        return None
    no_nodes = "nonodes" in on
    if no_nodes == (capturing["nodes_left_out"] == idle["nodes_left_out"]):
        return None
    return (f"{capturing['nodes_left_out']} capture nodes left out while capturing, "
            f"{idle['nodes_left_out']} with every site idle; the graph patch "
            f"{'did not reach' if no_nodes else 'reached'} the engine")


#: The engine's step, by phase: (module, class, method, phase name). Each is timed inclusive of
#: what it calls (``iteration`` holds ``step``, which holds ``schedule``...), on whatever thread
#: calls it (the engine core's main thread, for all of these); methods of one name add up in one
#: row (the engine steps through one of them). Those the engine does not have
#: (the V1 runner's names on the V2 runner, and the other way round) are left out.
PHASES = (
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_input_queue", "input"),
    ("vllm.v1.engine.core", "EngineCoreProc", "_process_engine_step", "iteration"),
    ("vllm.v1.engine.core", "EngineCore", "step_with_batch_queue", "step"),
    ("vllm.v1.engine.core", "EngineCore", "step", "step"),  # without async scheduling
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output", "update_from_output"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", "execute_model", "execute_model"),
    ("vllm.v1.executor.uniproc_executor", "UniProcExecutor", "sample_tokens", "sample_tokens"),
    ("vllm.v1.executor.uniproc_executor", "AsyncOutputFuture", "result", "output_wait"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_inputs", "prepare_inputs"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "prepare_attn", "prepare_attn"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "postprocess_sampled", "postprocess"),
    ("vllm.v1.worker.gpu.async_utils", "AsyncOutput", "get_output", "get_output"),
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_model_forward", "model_forward"),
    ("vllm_capture.capture_graph.graph_nodes", "_KeptGraphMixin", "replay", "graph_replay"),
    ("vllm_capture.session.session", "CaptureSession", "begin_step", "capture_begin_step"),
    ("vllm_capture.session.session", "CaptureSession", "end_step", "capture_end_step"),
)


class ThreadCounters:
    """User-mode instructions and cycles of the calling thread, from the kernel's hardware
    counters (``perf_event_open``; one group, read in one ``read``), or ``None`` per read where
    the host exposes none (most VMs). Instructions do not move with the host's speed state, which
    moved the 1B's generates by 15% rep to rep: a capture's extra work shows in them alone."""

    _SYSCALL = 298  # perf_event_open, x86-64
    _HARDWARE, _INSTRUCTIONS, _CYCLES = 0, 1, 0
    _FORMAT_GROUP = 1 << 3
    _EXCLUDE_KERNEL_HV = (1 << 5) | (1 << 6)

    def __init__(self):
        import ctypes
        import threading

        class Attr(ctypes.Structure):  # struct perf_event_attr, the fields used here
            _fields_ = [("type", ctypes.c_uint32), ("size", ctypes.c_uint32),
                        ("config", ctypes.c_uint64), ("sample_period", ctypes.c_uint64),
                        ("sample_type", ctypes.c_uint64), ("read_format", ctypes.c_uint64),
                        ("flags", ctypes.c_uint64), ("rest", ctypes.c_uint8 * 80)]

        self._ctypes, self._attr = ctypes, Attr
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fds: dict[tuple[int, int], int | None] = {}  # (pid, native thread id) -> leader fd
        self._thread_id = threading.get_native_id

    def _open(self, config: int, group: int) -> int:
        attr = self._attr(type=self._HARDWARE, size=self._ctypes.sizeof(self._attr), config=config,
                          read_format=self._FORMAT_GROUP, flags=self._EXCLUDE_KERNEL_HV)
        return self._libc.syscall(self._SYSCALL, self._ctypes.byref(attr), 0, -1, group, 0)

    def read(self) -> tuple[int, int] | None:
        """(instructions, cycles) this thread has run in user mode since its first read."""
        key = (os.getpid(), self._thread_id())
        if key not in self._fds:
            leader = self._open(self._INSTRUCTIONS, -1)
            if leader >= 0 and self._open(self._CYCLES, leader) < 0:
                os.close(leader)
                leader = -1
            self._fds[key] = leader if leader >= 0 else None
        fd = self._fds[key]
        if fd is None:
            return None
        import struct

        _, instructions, cycles = struct.unpack("qqq", os.read(fd, 24))
        return instructions, cycles


class PhaseTimers:
    """Seconds and calls by phase, in an anonymous shared mapping made before the engine starts:
    the engine core forked from this process adds to the same pages this one reads. The phases in
    ``counted`` also add the user-mode instructions and cycles their thread ran (``ThreadCounters``;
    -1 where the host has no hardware counters); a read is a system call, so only the step's
    outermost phase is counted by default. A call's seconds count from the last ``new_generate``
    on: the engine core's wait for a generate's first request, and the RPCs it serves meanwhile,
    are not the generate's."""

    def __init__(self, phases=PHASES, counted=("iteration",), first: int = FIRST_ITERATIONS):
        import importlib
        import mmap

        import numpy as np

        self.names = list(dict.fromkeys(name for *_, name in phases))
        self.first = first
        n = len(self.names)
        self._map = mmap.mmap(-1, 32 * n + 8 * (2 + 2 * first * n))
        self._totals = np.frombuffer(self._map, dtype=np.float64, count=4 * n).reshape(n, 4)
        # The generate's iteration the engine is in (set to 0 by ``new_generate``, advanced as
        # each iteration ends) and when the generate began (``time.perf_counter``, one clock for
        # every process of the host), then seconds by phase of its first ``first`` iterations.
        self._at = np.frombuffer(self._map, dtype=np.float64, count=2, offset=32 * n)
        self._first = np.frombuffer(self._map, dtype=np.float64, count=first * n,
                                    offset=32 * n + 16).reshape(first, n)
        # The same on the calling thread's CPU clock (``time.thread_time``): where a phase's
        # seconds exceed its CPU seconds, its thread waited (the GIL, a lock, the device) or was
        # preempted. Read in the first iterations only: the clock is a system call.
        self._first_cpu = np.frombuffer(self._map, dtype=np.float64, count=first * n,
                                        offset=32 * n + 16 + 8 * first * n).reshape(first, n)
        # An iteration ends where the outermost of these ends: "iteration" holds "step", and an
        # engine in this process (--in-process) has no EngineCoreProc, so "step" alone.
        self._iteration_phases = {self.names.index(n) for n in ("iteration", "step")
                                  if n in self.names}
        self._depth = 0  # of those, in the engine's process
        counters = ThreadCounters()
        for module, cls, method, name in phases:
            try:
                owner = getattr(importlib.import_module(module), cls, None)
            except ImportError:  # the GPU runner's modules, on a CPU build
                owner = None
            fn = None if owner is None else owner.__dict__.get(method)
            if fn is not None:
                setattr(owner, method, self._timed(fn, self.names.index(name),
                                                   counters if name in counted else None))

    def _timed(self, fn, index, counters):
        clock, cpu_clock = time.perf_counter, time.thread_time
        total, at, first, first_cpu = self._totals[index], self._at, self._first, self._first_cpu
        is_iteration = index in self._iteration_phases

        def timed(*args, **kwargs):
            c0 = cpu_clock() if at[0] < len(first) else None
            t0 = clock()
            if is_iteration:
                self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                end = clock()
                # Only the part after the generate began: the engine core waits for work in one
                # call of its input loop, serving the RPCs that come first (a stream's start,
                # the last generate's fetch) until the generate's first request arrives.
                spent = min(end - t0, max(0.0, end - at[1]))
                total[0] += spent
                total[1] += 1
                k = int(at[0])
                if k < len(first):
                    first[k, index] += spent
                    if c0 is not None and spent > 0:
                        first_cpu[k, index] += cpu_clock() - c0
                if is_iteration:
                    self._depth -= 1
                    if self._depth == 0:
                        at[0] = k + 1

        if counters is None:
            return timed

        def timed_and_counted(*args, **kwargs):
            c0 = counters.read()
            try:
                return timed(*args, **kwargs)
            finally:
                c1 = counters.read()
                if c0 is None or c1 is None:
                    total[2] = total[3] = -1.0
                else:
                    total[2] += c1[0] - c0[0]
                    total[3] += c1[1] - c0[1]

        return timed_and_counted

    def new_generate(self) -> None:
        """Start reading the first iterations anew: the engine's next iteration is number 0."""
        self._first[:] = 0.0
        self._first_cpu[:] = 0.0
        self._at[:] = (0.0, time.perf_counter())

    def first_iterations(self) -> list[dict[str, float]]:
        """ms by phase of each of the first iterations since ``new_generate`` (those the engine
        ran), phases it did not run left out; ``NAME_cpu``: the ms its thread ran on a CPU (0
        for a call begun before the generate, such as the engine core's wait for its input)."""
        ran = min(int(self._at[0]), self.first)
        out = []
        for k in range(ran):
            ms = {}
            for name, wall, cpu in zip(self.names, self._first[k] * 1e3, self._first_cpu[k] * 1e3):
                if wall > 0:
                    ms[name] = float(wall)
                    ms[f"{name}_cpu"] = float(cpu)
            out.append(ms)
        return out

    def read(self) -> dict[str, tuple[float, int, float, float]]:
        return {name: (float(s), int(n), float(i), float(c))
                for name, (s, n, i, c) in zip(self.names, self._totals)}

    @staticmethod
    def spent(before: dict, after: dict) -> dict[str, dict]:
        """ms and calls of each phase the engine ran between two reads, and the instructions and
        cycles of the counted ones (None where not counted or not countable)."""
        def counted(b, a):
            return None if a <= 0 or b < 0 else a - b

        return {name: {"ms": (after[name][0] - s) * 1e3, "calls": after[name][1] - n,
                       "instructions": counted(i, after[name][2]),
                       "cycles": counted(c, after[name][3])}
                for name, (s, n, i, c) in before.items() if after[name][1] > n}


def counted_per_step(reps: list[dict], idle: list[dict], steps: int) -> dict:
    """The counted phases' user-mode instructions and cycles a step (medians over reps), and the
    same rep's difference from idle; empty where the host has no hardware counters."""
    out = {}
    for name in reps[0]["phases"]:
        for what in ("instructions", "cycles"):
            pairs = [(r["phases"][name][what], i["phases"][name][what]) for r, i in zip(reps, idle)
                     if r["phases"].get(name, {}).get(what) is not None
                     and i["phases"].get(name, {}).get(what) is not None]
            if pairs:
                out[f"{name}_{what}"] = round(statistics.median(a for a, _ in pairs) / steps)
                out[f"{name}_{what}_vs_idle"] = round(statistics.median(a - b for a, b in pairs) / steps)
    return out


def first_iterations_by_phase(reps: list[dict], idle: list[dict]) -> list[dict]:
    """Of each of the generates' first iterations: ms by phase (median over the reps that ran
    it) and the same rep's difference from idle (median; a phase one of the two did not run
    counts 0 there)."""
    out = []
    for k in range(max((len(r["first_iterations"]) for r in reps), default=0)):
        pairs = [(r["first_iterations"][k], i["first_iterations"][k]) for r, i in zip(reps, idle)
                 if len(r["first_iterations"]) > k and len(i["first_iterations"]) > k]
        if not pairs:
            break
        names = list(dict.fromkeys(n for a, b in pairs for n in (*a, *b)))
        out.append({"iteration": k, "reps": len(pairs),
                    "ms": {n: round(statistics.median(a.get(n, 0.0) for a, _ in pairs), 4)
                           for n in names},
                    "ms_vs_idle": {n: round(statistics.median(a.get(n, 0.0) - b.get(n, 0.0)
                                                              for a, b in pairs), 4)
                                   for n in names}})
    return out


def print_first_iterations(summary: dict, cases: tuple[str, ...]) -> None:
    """Each first iteration by phase: idle's ms, then each case's difference from it."""
    for k, it in enumerate(summary[S.IDLE]["first_iterations"]):
        print(f"{f'iteration {k} (ms)':<20}{'idle':>9}" + "".join(f"{c[:18]:>20}" for c in cases[1:]))
        names = list(dict.fromkeys(n for c in cases if len(summary[c]["first_iterations"]) > k
                                   for n in summary[c]["first_iterations"][k]["ms"]))
        for name in names:
            row = f"{name:<20}{it['ms'].get(name, 0.0):>9.3f}"
            for case in cases[1:]:
                its = summary[case]["first_iterations"]
                diff = its[k]["ms_vs_idle"].get(name, float("nan")) if len(its) > k else float("nan")
                row += f"{diff:>+20.3f}"
            print(row, flush=True)


def print_phase_table(summary: dict, cases: tuple[str, ...]) -> None:
    """ms a step by phase: idle's, then each case's difference from it (same rep, median)."""
    names = list(summary[S.IDLE]["phase_ms_per_step"])
    print(f"{'phase (ms/step)':<20}{'idle':>9}" + "".join(f"{c[:18]:>20}" for c in cases[1:]))
    for name in names:
        row = f"{name:<20}{summary[S.IDLE]['phase_ms_per_step'][name]:>9.4f}"
        for case in cases[1:]:
            row += f"{summary[case]['phase_ms_per_step_vs_idle'].get(name, float('nan')):>+20.4f}"
        print(row, flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="1b", choices=sorted(S.MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--in-process", action="store_true")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no rep that would end after this many seconds of reps (the "
                        "slowest rep so far taken as the next one's length)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"a comma list, idle first, of: {', '.join(KNOWN_CASES)}")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval for this process before the engine starts, so for "
                        "the engine core forked from it too (Python's default: 0.005 s). A "
                        "thread that gives up the GIL in a torch call may wait this long to get "
                        "it back while another thread runs: a shorter interval shows whether "
                        "capture's begin_step waits so for the engine core's input thread")
    args = p.parse_args()
    if args.switch_interval is not None:
        if args.switch_interval <= 0:
            p.error(f"--switch-interval: must be > 0 seconds, got {args.switch_interval}")
        sys.setswitchinterval(args.switch_interval)
    cases = tuple(args.cases.split(","))
    if cases[0] != S.IDLE or not set(cases) <= set(KNOWN_CASES):
        p.error(f"--cases: idle first, then any of {', '.join(KNOWN_CASES)}; got {args.cases!r}")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm_capture import api

    flags = Path(tempfile.mkdtemp(prefix="vllm-capture-ablation-flag-"))
    switches = Switches(flags)
    read_switches_at_stream_start(switches)
    drop_stores(switches, "drop")
    skip_step_path(switches, "skip")
    idle_on_device(switches, "nogpu")
    leave_nodes_out(switches, "nonodes")
    phases = PhaseTimers()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    llm, shape, w, params, prompts = quick_decode_engine(args.model, "capture-graph")
    cpus = {}
    if not args.in_process and len(os.sched_getaffinity(0)) >= 8:
        cpus = {"client": [0, 1, 2, 3], "engine": [4, 5, 6, 7]}
        pin([os.getpid()], cpus["client"])
        pin(descendants(os.getpid()), cpus["engine"])
    llm.generate(prompts.make(w), params, use_tqdm=False)
    if not phases.read()["step"][1]:
        raise SystemExit("the phase timers did not reach the engine core (was it spawned, not "
                         "forked?): try --in-process")
    # The engine core's process (forked), or this one with --in-process.
    engine_pids = [os.getpid()] if args.in_process else descendants(os.getpid())
    if not engine_pids:
        raise SystemExit("no engine process among this one's children: try --in-process")

    def status() -> dict:
        return api.capture_status(llm, S.HIDDEN)

    def generate(case: str) -> dict:
        suffix = next((x for x in SUFFIX_SWITCHES if case.endswith(x)), "")
        cap = None if case == S.IDLE else S.SCENARIOS[case.removesuffix(suffix)].capture
        on = SUFFIX_SWITCHES.get(suffix, ())
        drop, no_rows = "drop" in on, "nogpu" in on
        for switch in on:
            (flags / switch).touch()
        idle_status = status()
        before = idle_status["host_timers"]
        # The stream starts before the generate begins, as run.py starts it outside the timed
        # generate. The engine core serves that RPC while it waits for work, in a call of its
        # input loop that ends with the generate's first request; the phase timers count such
        # a call from new_generate on (session 37: with the start and the last generate's fetch
        # in it, iteration 0's input read +3.7 ms, and every step's average +0.015 ms).
        start_ms = None
        if cap is not None:
            t = time.perf_counter()
            api.start_capture(llm, cap.stream, layers=cap.layer_ids(shape), reduce=cap.reduce)
            start_ms = (time.perf_counter() - t) * 1e3
        phases_before = phases.read()
        phases.new_generate()
        gen_s, threads = capture_and_generate(llm, None, shape, w, params, prompts, engine_pids)
        first = phases.first_iterations()
        fetch_s = None
        if cap is not None:
            capturing = api.capture_status(llm, cap.stream)
            wrong = nodes_check(on, idle_status["graph_nodes"], capturing["graph_nodes"])
            if wrong:
                raise SystemExit(f"{case}: {wrong}")
            stored = capturing["tokens_stored"]
            # A row stream stores what it drained during the generate (reductions wait for
            # the fetch).
            if cap.reduce == "all" and drop != (stored == 0):
                raise SystemExit(f"{case}: {stored} rows stored; the store patch "
                                 f"{'did not reach' if drop else 'dropped rows of'} the engine")
            if not drop:
                t = time.perf_counter()
                tensors, _, _ = api.fetch_captured(llm, cap.stream, clear=True)
                fetch_s = time.perf_counter() - t
                rows = sum(len(t) for t in tensors.values())
                if no_rows != (rows == 0):
                    raise SystemExit(f"{case}: {rows} rows fetched; the device patch "
                                     f"{'did not reach' if no_rows else 'reached'} the engine")
            api.stop_capture(llm, cap.stream)  # dropped rows: nothing is fetched
        after, phases_after = status()["host_timers"], phases.read()
        for switch in on:
            (flags / switch).unlink()
        planned = after["steps"] - before["steps"]
        if "skip" in on and planned > 8:
            raise SystemExit(f"{case}: {planned} steps went through begin_step; the step-path "
                             f"patch did not reach the engine")
        main = engine_main_thread(threads)
        return {"gen_s": gen_s, "generated_tokens": w.generated_tokens, "fetch_s": fetch_s,
                "start_ms": start_ms,
                "timers": {k: after[k] - before[k] for k in after},
                "phases": PhaseTimers.spent(phases_before, phases_after),
                "first_iterations": first,
                # On a CPU, and neither on one nor waiting for one (blocked: on the GPU's
                # blocking events, on I/O).
                "main_ms": {"on_cpu": main[0], "blocked": gen_s * 1e3 - main[0] - main[1]}}

    runs: dict[str, list[dict]] = {c: [] for c in cases}
    previous = S.IDLE  # the warm-up generate
    started, slowest = time.perf_counter(), 0.0
    for rep in range(args.reps):
        if args.budget_s is not None and time.perf_counter() - started + slowest > args.budget_s:
            print(f"budget: {rep} of {args.reps} reps", flush=True)
            break
        rep_start = time.perf_counter()
        for case in (cases if rep % 2 == 0 else cases[::-1]):
            runs[case].append({**generate(case), "after": previous})
            previous = case
        slowest = max(slowest, time.perf_counter() - rep_start)
    summary = {}
    for case, reps in runs.items():
        # Per step of the generate (as run.py counts them), whether or not the session saw the
        # step: with -nohost, begin_step sees a few.
        per_step = {k: round(statistics.median(r["timers"][k] for r in reps) / w.new_tokens, 4)
                    for k in ("begin_step_ms", "end_step_ms", "harvest_ms", "harvest_sync_ms",
                              "harvest_cpu_ms")}
        per_step.update({f"main_{k}_ms": round(
            statistics.median(r["main_ms"][k] for r in reps) / w.new_tokens, 4)
            for k in ("on_cpu", "blocked")})
        repeats = statistics.median(r["timers"].get("repeat_steps", 0) for r in reps)
        # begin_step of a step that planned nothing (steady decode), per such step.
        per_step["begin_repeat_ms"] = (
            round(statistics.median(r["timers"]["begin_repeat_ms"] for r in reps) / repeats, 4)
            if repeats else None)
        logs = [math.log(runs[S.IDLE][i]["gen_s"] / r["gen_s"]) for i, r in enumerate(reps)]
        fetches = [r["fetch_s"] for r in reps if r["fetch_s"] is not None]
        starts = [r["start_ms"] for r in reps if r["start_ms"] is not None]
        # ms a step by phase, and the same rep's difference from idle (medians over reps).
        phase_ms = {name: [r["phases"].get(name, {"ms": 0.0})["ms"] / w.new_tokens for r in reps]
                    for name in phases.names if any(name in r["phases"] for r in reps)}
        idle_ms = {name: [r["phases"].get(name, {"ms": 0.0})["ms"] / w.new_tokens
                          for r in runs[S.IDLE]] for name in phase_ms}
        summary[case] = {
            "tok_s": round(w.generated_tokens / statistics.median(r["gen_s"] for r in reps)),
            # Whether a generate runs slower right after a capture than after idle.
            "tok_s_after": {after: round(v) for after, v in
                            R.median_tok_s_by(reps, lambda r: r["after"]).items()},
            "vs_idle": R.geometric_mean_interval(logs),
            "fetch_s": round(statistics.median(fetches), 4) if fetches else None,
            # start_capture's RPC, outside the generate (as run.py times it)
            "start_ms": round(statistics.median(starts), 3) if starts else None,
            "host_ms_per_step": per_step,
            "phase_ms_per_step": {name: round(statistics.median(v), 4) for name, v in phase_ms.items()},
            "phase_ms_per_step_vs_idle": {
                name: round(statistics.median(a - b for a, b in zip(v, idle_ms[name])), 4)
                for name, v in phase_ms.items()},
            "phase_calls_per_step": {name: round(statistics.median(
                r["phases"].get(name, {"calls": 0})["calls"] for r in reps) / w.new_tokens, 3)
                for name in phase_ms},
            "counted_per_step": counted_per_step(reps, runs[S.IDLE], w.new_tokens),
            "first_iterations": first_iterations_by_phase(reps, runs[S.IDLE]),
            "gen_s": [round(r["gen_s"], 4) for r in reps]}
        print(case, json.dumps(summary[case]), flush=True)
    summary["cpus"] = cpus
    summary["reps"] = len(runs[S.IDLE])
    summary["switch_interval_s"] = sys.getswitchinterval()
    print_phase_table(summary, cases)
    print_first_iterations(summary, cases)
    for case in cases:
        print(f"counted {case}: {json.dumps(summary[case]['counted_per_step'])}", flush=True)
    (out / "harvest_ablation.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
