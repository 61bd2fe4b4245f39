"""Where a process's main thread spends its CPU time, by Python function: a sampling profiler.

On the 1B, a last-token capture's generates keep the engine's main thread on a CPU about as much
longer as they take (sessions 17-30: 10-90 ms a generate, the same in CPU time as in wall
time), while capture's own timers cover 7-10 ms of it, and cProfile slowed every function too
much to tell where the rest goes. This counts, every ``interval_s`` of the process's CPU time
(``ITIMER_PROF``, all threads), the Python function the main thread is in: its innermost frame
("self": time in a C call goes to the Python function that made the call) and every function on
its stack below ``root`` ("inclusive"), under the label the caller set (a generate). Whether the
extra time sits in a few functions (work capture adds somewhere) or spreads over all of vLLM's in
proportion (the same work run slower) is then read per function, generate against generate.

A sample costs the handler about 13 us on a 30-frame stack (the CPU VM), in every generate alike.
Linux checks CPU-time timers on the scheduler's tick, so samples come at most once a tick
whatever the interval asked: 252 a second of CPU at 1 ms on the CPU VM (a 250 Hz tick), 264 on
the H200 (session 31), so 0.3% of handler. So each label's record keeps the process's CPU time
under it (``cpu_s``, since session 31), and ``compare`` counts a sample as that over its samples
(``ms_per_sample``); records without it count ``interval_s`` a sample, which at 1 ms reads
about a quarter of the CPU time. Expirations during one long C call collapse into one
sample (the handler runs between bytecodes): 61 a second in 10 ms numpy calls. The handler is installed with ``SA_RESTART``, so system calls it interrupts
restart. Each label's counts are written out as one JSON line when the label changes
(``set_label``): a forked process whose end is not seen (vLLM's engine core) leaves them behind.
"""

from __future__ import annotations

import gzip
import json
import signal
import statistics
import time
from collections import Counter
from pathlib import Path

from benchmarks import report as R


#: Packages whose files are named from their package directory on (others by file name).
PACKAGES = ("vllm", "vllm_capture", "benchmarks", "torch", "triton", "numpy", "zmq", "msgspec")


def code_key(code) -> str:
    """``path:qualified name`` of a code object, the path from its package directory down."""
    parts = code.co_filename.replace("\\", "/").split("/")
    starts = [i for i, part in enumerate(parts[:-1]) if part in PACKAGES]
    path = "/".join(parts[starts[0]:]) if starts else parts[-1]
    return f"{path}:{getattr(code, 'co_qualname', code.co_name)}"


class Sampler:
    """SIGPROF samples of the main thread's stack, counted by label (None: not counted)."""

    def __init__(self, path: str | Path, interval_s: float = 0.001, root=None):
        self.path = Path(path)
        self.interval_s = interval_s
        self.root = root  # a code object: the stack above it is not counted as inclusive
        self.label = None
        self._self: Counter = Counter()
        self._inclusive: Counter = Counter()
        self._samples = 0
        self._label_cpu_s = 0.0  # the process's CPU time when the current label was set
        self.running = False

    def start(self) -> None:
        """In the process and main thread to sample (signal handlers run on the main thread)."""
        signal.signal(signal.SIGPROF, self._on_sample)
        signal.siginterrupt(signal.SIGPROF, False)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
        self.running = True

    def stop(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0.0, 0.0)
        signal.signal(signal.SIGPROF, signal.SIG_IGN)
        self.running = False
        self.set_label(None)

    def set_label(self, label) -> None:
        """Count the following samples under ``label``; the previous label's go to the file."""
        if label == self.label:
            return
        # The handler can run between any two lines here: with no label it counts nothing, and
        # then it counts into fresh counters, never into the ones being written.
        previous, self.label = self.label, None
        now = time.process_time()
        samples, own, inclusive = self._samples, self._self, self._inclusive
        cpu_s, self._label_cpu_s = now - self._label_cpu_s, now
        self._self, self._inclusive, self._samples = Counter(), Counter(), 0
        self.label = label
        if previous is not None and samples:
            # The process's CPU time under the label (what ITIMER_PROF counts): a sample's worth,
            # which the scheduler's tick sets rather than interval_s.
            record = {"label": previous, "samples": samples, "interval_s": self.interval_s,
                      "cpu_s": cpu_s, "self": _by_key(own), "inclusive": _by_key(inclusive)}
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _on_sample(self, signum, frame) -> None:
        if self.label is None or frame is None:
            return
        self._samples += 1
        # Counted by code object, named at the flush: naming every frame here cost more.
        self._self[frame.f_code] += 1
        seen = set()
        while frame is not None and frame.f_code is not self.root:
            seen.add(frame.f_code)
            frame = frame.f_back
        if frame is not None:  # below the root: the step's functions
            self._inclusive.update(seen)


def _by_key(counts: Counter) -> dict[str, int]:
    """Counts by code object, by ``code_key`` (functions of one name added up)."""
    out: Counter = Counter()
    for code, n in counts.items():
        out[code_key(code)] += n
    return dict(out)


def read_samples(path: str | Path) -> dict:
    """``{label: record}`` of a sampler's file, or of its gzip (``.gz``: how the H200's runs
    bring it back, under the device's 16 MiB a file); a label written twice: its counts added."""
    path = Path(path)
    text = (gzip.decompress(path.read_bytes()) if path.suffix == ".gz"
            else path.read_bytes()).decode()
    out: dict = {}
    for line in text.splitlines():
        record = json.loads(line)
        mine = out.setdefault(record["label"], {"samples": 0, "interval_s": record["interval_s"],
                                                "cpu_s": 0.0, "self": Counter(),
                                                "inclusive": Counter()})
        mine["samples"] += record["samples"]
        # Files before session 31 lack it: their samples count interval_s each.
        mine["cpu_s"] = (None if mine["cpu_s"] is None or "cpu_s" not in record
                         else mine["cpu_s"] + record["cpu_s"])
        mine["self"].update(record["self"])
        mine["inclusive"].update(record["inclusive"])
    return out


def ms_per_sample(record: dict) -> float:
    """What one of a label's samples stands for: its process CPU time over its samples, or the
    interval asked where the record lacks the CPU time."""
    if record.get("cpu_s") and record["samples"]:
        return 1e3 * record["cpu_s"] / record["samples"]
    return 1e3 * record["interval_s"]


def compare(samples: dict, pairs: list[tuple], top: int = 12) -> dict | None:
    """Each labelled run against those beside it: ``pairs`` holds ``(label, [labels beside])``.
    Milliseconds of CPU a label more than the mean of those beside it, for all samples and per
    function (self and inclusive), as a mean over ``pairs`` with its 95% interval; the functions
    with the largest mean difference either way first (``top`` of each), and each function's
    share of the samples beside and what it would add if every function ran longer in that
    proportion (a slower CPU), to read a difference against its size."""
    # Only the labels sampled: a run's first or last idle neighbour may not exist.
    pairs = [(label, [n for n in near if n in samples]) for label, near in pairs
             if label in samples]
    pairs = [(label, near) for label, near in pairs if near]
    if not pairs:
        return None

    def ms(label, value) -> float:
        return value(samples[label]) * ms_per_sample(samples[label])

    def differences(value) -> list[float]:
        return [ms(label, value) - statistics.fmean(ms(n, value) for n in near)
                for label, near in pairs]

    def interval(values: list[float]) -> dict:
        mean, half = R.mean_interval(values)
        return {"ms": round(mean, 3),
                "ci95": None if half is None else [round(mean - half, 3), round(mean + half, 3)]}

    beside = {n for _, near in pairs for n in near}
    everything = interval(differences(lambda s: s["samples"]))
    total = sum(samples[n]["samples"] for n in beside)
    out = {"pairs": len(pairs), "all": everything,
           "beside_ms": round(statistics.fmean(ms(n, lambda s: s["samples"]) for n in beside), 1)}
    for kind in ("self", "inclusive"):
        keys = set().union(*(samples[label][kind] for label, _ in pairs),
                           *(samples[n][kind] for n in beside))
        rows = []
        for key in keys:
            diff = interval(differences(lambda s, k=key: s[kind].get(k, 0)))
            share = sum(samples[n][kind].get(key, 0) for n in beside) / total if total else 0.0
            rows.append({"function": key, **diff, "share_beside": round(share, 4),
                         "if_proportional_ms": round(share * everything["ms"], 3)})
        rows.sort(key=lambda r: -abs(r["ms"]))
        out[kind] = rows[:top]
    return out


def table(compared: dict | None, rows: int = 8) -> list[str]:
    """``compare``'s result as lines of text: all samples, then the functions (self)."""
    if not compared:
        return []

    def ms(d: dict) -> str:
        ci = "" if d["ci95"] is None else f" ({d['ci95'][0]:+.1f} to {d['ci95'][1]:+.1f})"
        return f"{d['ms']:+.1f} ms{ci}"

    lines = [f"all {ms(compared['all'])} a generate, of {compared['beside_ms']:.0f} ms beside "
             f"({compared['pairs']} pairs)"]
    for row in compared["self"][:rows]:
        lines.append(f"{row['function']}: {ms(row)}, {100 * row['share_beside']:.1f}% of "
                     f"the samples beside (in proportion {row['if_proportional_ms']:+.1f} ms)")
    return lines
