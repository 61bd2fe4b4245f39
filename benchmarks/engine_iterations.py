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
"""

from __future__ import annotations

import mmap
import time

import numpy as np

#: The generates one clock can hold (16 bytes each).
CAPACITY = 1 << 16
_clock: "IterationClock | None" = None


class IterationClock:
    """Per generate index: seconds of engine iterations begun while it was current, and their
    count; and the generate of the iteration running now. Index -1: none (iterations begun
    while no generate is current are not counted)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._map = mmap.mmap(-1, 8 * (2 * capacity + 2))
        values = np.frombuffer(self._map, dtype=np.float64)
        self._current, self._running = values[:1], values[1:2]
        self.sums = values[2:].reshape(capacity, 2)
        self._current[0] = self._running[0] = -1

    def start(self, generate: int) -> None:
        if not 0 <= generate < self.capacity:
            raise ValueError(f"generate: {generate} is outside the clock's 0..{self.capacity - 1}")
        self.sums[generate] = 0.0
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

    def add(self, generate: int, seconds: float) -> None:
        """The engine, as an iteration of ``generate`` ends."""
        if 0 <= generate < self.capacity:
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


def install(clock: IterationClock) -> None:
    """Every engine core forked from this process from now on adds to ``clock`` (one clock
    serves all of a process's engines: one generates at a time, and each iteration counts for
    the generate current when it began)."""
    global _clock
    from vllm.v1.engine.core import EngineCoreProc

    if _clock is None:
        engine_step = EngineCoreProc._process_engine_step

        def timed_engine_step(core):
            clock = _clock  # as it was when this engine core forked
            generate = clock.begin()
            t0 = time.perf_counter()
            try:
                return engine_step(core)
            finally:
                clock.add(generate, time.perf_counter() - t0)

        EngineCoreProc._process_engine_step = timed_engine_step
    _clock = clock
