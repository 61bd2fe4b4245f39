"""The engine's iterations during each timed generate: their seconds and count, by generate.

The benchmark times a generate in its client (``llm.generate``). That time holds the engine
core's iterations (``EngineCoreProc._process_engine_step``: schedule, step path, launch, the
previous step's output) and what lies outside them: the outputs' way to the client, the
engine's loop between iterations, the client's own work. Session 31 read, on one machine, a
last-token capture at 1.055 of idle's speed summed over the engine's iterations
(``step_alternation.py``) and at 0.960 of idle in the benchmark's client. This splits the
benchmark's own generates the same way.

A patch of ``_process_engine_step``, installed in the process that builds the engines before
the first is built, is inherited by each engine core vLLM forks from it; each iteration adds
its duration to the generate that was current when it began, in anonymous shared pages made
before the fork, which the client reads. An iteration that began in a generate and ends after
the client's ``generate`` returned (the last step's output left before its iteration ended)
still counts for it: before reading a generate's sums the client waits, a second at most, for
an iteration of it still running (``settle``). An engine core that vLLM spawns instead
inherits nothing: its generates read None.

Each generate's first iteration (its "head": the prefill's schedule and launch) is also kept
apart, with what the engine did in it (``HEAD_USAGE``: CPU time of its thread and of the whole
process, the thread's page faults and context switches) and torch's caching-allocator counters
around it (``ALLOCATOR_COUNTERS``). In session 32's ``step_alternation.py`` run, an idle generate's first
iteration took 22 ms where a capture generate's took 13 (24.8 against 14.1 in session 31's),
and the extra sat inside the prefill's torch ops: a cudaMalloc retry (the allocator freeing its
cached blocks, which waits for the device) would look like that after a capture's drains took
memory from the cache; so would a collection of Python's garbage collector, triggered by the
objects a capture's harvest and fetch made. So the engine's collections are timed too (a
``gc.callbacks`` entry, inherited with the patch), by the generate current while its engine ran
it, with those inside the head apart. The process's CPU time beside the thread's tells whether
other threads (harvest, reaper, spare) ran during the head, its involuntary switches whether
they took the main thread's CPU, and its page faults whether it touched fresh memory.

Each iteration's own seconds are kept too, in the order the engine ran them (the first
``TRACE_ITERATIONS`` of each of the first ``TRACE_GENERATES`` generates): session 33's
benchmark read a last-token capture's iterations at 0.958 of idle's speed, about 57 ms more a
generate, with the heads level; where in the generate those ms lie (prefill, the first decode
steps, the steady steps, the end of the requests) tells what capture does in them. (The engine
thread's CPU time in each, kept beside them for one run, equalled the seconds to within 3% in
every place: CUDA's wait for the GPU spins, so it could not tell a wait from work.)
"""

from __future__ import annotations

import gc
import math
import mmap
import os
import resource
import time

import numpy as np

#: Cumulative counters of torch's caching allocator (``torch.cuda.memory_stats``): device
#: allocations and frees (cudaMalloc, cudaFree), allocations that failed and retried after the
#: cache was freed, and the waits for every stream's events that freeing the cache takes.
ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries",
                      "num_sync_all_streams")
#: What the engine did during a generate's first iteration: CPU seconds of its main thread and
#: of its whole process, and the main thread's page faults (minor, major) and context switches
#: (voluntary, involuntary).
HEAD_USAGE = ("cpu_seconds", "process_cpu_seconds", "minor_faults", "major_faults",
              "voluntary_switches", "involuntary_switches")
#: A generate's values, in this order: seconds and count of its iterations; its first
#: iteration's seconds, HEAD_USAGE and the seconds of garbage collection in it; the allocator
#: counters before and after that iteration; the engine's garbage collections while the
#: generate was current (seconds, count, full ones: the oldest generation's).
_FIELDS = {"sums": 2, "head": 2 + len(HEAD_USAGE), "before": len(ALLOCATOR_COUNTERS),
           "after": len(ALLOCATOR_COUNTERS), "gc": 3}
ROW = sum(_FIELDS.values())
#: The generates one clock can hold (8 * ROW bytes each).
CAPACITY = 1 << 16
#: The generates whose iterations are kept one by one, and how many of each (4 bytes each; a
#: quick-suite decode generate runs about 260).
TRACE_GENERATES, TRACE_ITERATIONS = 4096, 512
_clock: "IterationClock | None" = None
# The process that installed the patch (the client, whose collections are not the engine's)
# and, in an engine core, the generate of its latest iteration and whether that is a head.
_installer_pid: int | None = None
_engine_generate = -1
_in_head = False
_collection_began = 0.0


class IterationClock:
    """Per generate index: seconds of engine iterations begun while it was current, and their
    count; its first iteration apart (``head``); and the generate of the iteration running now.
    Index -1: none (iterations begun while no generate is current are not counted)."""

    def __init__(self, capacity: int = CAPACITY, trace_generates: int = TRACE_GENERATES):
        self.capacity = capacity
        self._map = mmap.mmap(-1, 8 * (ROW * capacity + 2))
        values = np.frombuffer(self._map, dtype=np.float64)
        self._trace_map = mmap.mmap(-1, 4 * TRACE_ITERATIONS * min(capacity, trace_generates))
        self._trace = np.frombuffer(self._trace_map, dtype=np.float32).reshape(
            -1, TRACE_ITERATIONS)
        self._current, self._running = values[:1], values[1:2]
        self.rows = values[2:].reshape(capacity, ROW)
        start, views = 0, {}
        for name, width in _FIELDS.items():
            views[name], start = self.rows[:, start:start + width], start + width
        self.sums, self._head, self._gc = views["sums"], views["head"], views["gc"]
        self._before, self._after = views["before"], views["after"]
        self._current[0] = self._running[0] = -1

    def start(self, generate: int) -> None:
        if not 0 <= generate < self.capacity:
            raise ValueError(f"generate: {generate} is outside the clock's 0..{self.capacity - 1}")
        self.rows[generate] = 0.0
        self._current[0] = generate

    def stop(self) -> None:
        self._current[0] = -1

    @property
    def current(self) -> int:
        return int(self._current[0])

    def begin(self) -> int:
        """The engine, as an iteration begins: the generate it counts for."""
        generate = self.current
        self._running[0] = generate
        return generate

    def is_head(self, generate: int) -> bool:
        """Whether an iteration of ``generate`` beginning now is its first."""
        return 0 <= generate < self.capacity and self.sums[generate, 1] == 0

    def open_head(self, generate: int, counters: list[float]) -> None:
        """The engine, as ``generate``'s first iteration begins: the allocator counters."""
        self._before[generate] = counters

    def close_head(self, generate: int, seconds: float, usage: list[float],
                   counters: list[float]) -> None:
        """The engine, as ``generate``'s first iteration ends (before ``add``): ``usage``, the
        HEAD_USAGE it took."""
        self._head[generate, :-1] = (seconds, *usage)
        self._after[generate] = counters

    def add_collection(self, generate: int, seconds: float, generation: int,
                       in_head: bool) -> None:
        """The engine, as a garbage collection of ``generation`` ends while ``generate`` is
        current and its engine's."""
        if 0 <= generate < self.capacity:
            self._gc[generate] += (seconds, 1.0, float(generation == 2))
            if in_head:
                self._head[generate, -1] += seconds

    def collections(self, generate: int) -> dict:
        """The engine's garbage collections during ``generate``: ``seconds``, ``count``,
        ``full`` (of the oldest generation)."""
        seconds, count, full = self._gc[generate].tolist()
        return {"seconds": seconds, "count": int(count), "full": int(full)}

    def add(self, generate: int, seconds: float) -> None:
        """The engine, as an iteration of ``generate`` ends."""
        if 0 <= generate < self.capacity:
            done = int(self.sums[generate, 1])
            if generate < len(self._trace) and done < TRACE_ITERATIONS:
                self._trace[generate, done] = seconds
            self.sums[generate] += (seconds, 1.0)
        self._running[0] = -1

    def settle(self, generate: int, timeout_s: float = 1.0) -> None:
        """Wait until no iteration of ``generate`` is running (at most ``timeout_s``)."""
        deadline = time.perf_counter() + timeout_s
        while int(self._running[0]) == generate and time.perf_counter() < deadline:
            time.sleep(0.0002)

    def read(self, generate: int) -> tuple[float, int] | None:
        """``(seconds, iterations)`` of ``generate``; None where no iteration was counted."""
        seconds, count = self.sums[generate]
        return (float(seconds), int(count)) if count else None

    def iterations(self, generate: int) -> list[float] | None:
        """The seconds of ``generate``'s iterations, one by one in the order they ended (the
        first ``TRACE_ITERATIONS``); None where the clock keeps none for it."""
        count = int(self.sums[generate, 1])
        if generate >= len(self._trace) or not count:
            return None
        return self._trace[generate, :min(count, TRACE_ITERATIONS)].tolist()

    def head(self, generate: int) -> dict | None:
        """``generate``'s first iteration: its ``seconds``, HEAD_USAGE and the engine's garbage
        collections' ``gc_seconds`` in it, the ``allocator`` counters' increase over it and
        their values as it began (``allocator_at``; None each where the engine has no CUDA).
        None where no iteration was counted."""
        if not self.sums[generate, 1]:
            return None
        seconds, *usage, gc_seconds = self._head[generate].tolist()

        def counters(values) -> dict:
            return {name: None if math.isnan(v) else int(v)
                    for name, v in zip(ALLOCATOR_COUNTERS, values.tolist())}

        return {"seconds": seconds,
                **{name: v if name.endswith("seconds") else int(v)
                   for name, v in zip(HEAD_USAGE, usage)},
                "gc_seconds": gc_seconds,
                "allocator": counters(self._after[generate] - self._before[generate]),
                "allocator_at": counters(self._before[generate])}


def head_usage() -> list[float]:
    """HEAD_USAGE as counted so far, for the calling thread and its process."""
    thread = resource.getrusage(resource.RUSAGE_THREAD)
    return [time.thread_time(), time.process_time(), thread.ru_minflt, thread.ru_majflt,
            thread.ru_nvcsw, thread.ru_nivcsw]


def allocator_counters() -> list[float]:
    """``ALLOCATOR_COUNTERS`` of this process's current CUDA device (NaN without CUDA)."""
    import torch

    stats = torch.cuda.memory_stats_as_nested_dict()  # {} where CUDA is not initialised
    return [float(stats.get(name, math.nan)) for name in ALLOCATOR_COUNTERS]


def time_collection(phase: str, info: dict) -> None:
    """A ``gc.callbacks`` entry: in an engine core, each collection's seconds go to the
    generate current while this engine runs it (the other engines' idle collections, and the
    client's own, go nowhere)."""
    global _collection_began
    if os.getpid() == _installer_pid:
        return
    if phase == "start":
        _collection_began = time.perf_counter()
        return
    clock, generate = _clock, _engine_generate
    if clock is not None and generate >= 0 and clock.current == generate:
        clock.add_collection(generate, time.perf_counter() - _collection_began,
                             info["generation"], _in_head)


def install(clock: IterationClock) -> None:
    """Every engine core forked from this process from now on adds to ``clock`` (one clock
    serves all of a process's engines: one generates at a time, and each iteration counts for
    the generate current when it began)."""
    global _clock, _installer_pid
    from vllm.v1.engine.core import EngineCoreProc

    if _clock is None:
        engine_step = EngineCoreProc._process_engine_step

        def timed_engine_step(core):
            global _engine_generate, _in_head
            clock = _clock  # as it was when this engine core forked
            generate = clock.begin()
            head = clock.is_head(generate)
            _engine_generate, _in_head = generate, head
            if head:  # the counters' reads stay outside the iteration's time
                clock.open_head(generate, allocator_counters())
                usage = head_usage()
            t0 = time.perf_counter()
            try:
                return engine_step(core)
            finally:
                seconds = time.perf_counter() - t0
                _in_head = False
                if head:
                    clock.close_head(generate, seconds,
                                     [b - a for a, b in zip(usage, head_usage())],
                                     allocator_counters())
                clock.add(generate, seconds)

        EngineCoreProc._process_engine_step = timed_engine_step
        gc.callbacks.append(time_collection)
    _clock, _installer_pid = clock, os.getpid()
