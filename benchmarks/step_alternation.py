#!/usr/bin/env python3
"""What a last-token capture costs one decode step, measured step against neighbouring step.

    python3 benchmarks/step_alternation.py --model 1b --out /tmp/out [--generates 60]

The 1B's generates move by 15% from one to the next with the host's state, so a cost of 1-3% read
from whole generates needs hundreds of them. Adjacent steps of one generate share that state. Here
one capture engine (as the benchmark runs it: engine core forked from this process, on CPUs 4-7,
this client on 0-3) runs the quick suite's decode workload, generates alternating between idle and
``hidden-last`` (last token, every layer). In a ``hidden-last`` generate, two switches turn on
and off from one engine iteration to the next:

- host: the session's step path (``begin_step``, ``end_step``) runs as shipped, or, on a steady
  decode step, is skipped (the decode repeat moves its positions on, a numpy add; the device
  keeps the repeated plan, which is what a repeat leaves there anyway);
- nodes: the forward's graph is launched from the stream's copy, with its 16 capture nodes, or
  from idle's copy, without them (no capture kernel runs).

Iteration ``k`` of the engine (``EngineCoreProc._process_engine_step``: with async scheduling,
one step's schedule, step path and launch, and the previous step's output) has host on when
``k // 2`` is even and nodes on when ``k // 4`` is even (``switches_of``), so each generate's
steady iterations (their step repeated the last one, whether or not the step path ran) fit, by
least squares, a cost of each switch in its own iteration and in the next (a step's capture
kernels run on the GPU while the host is in the next iteration; capture's host work could slow
what follows it). Printed: each cost's mean over generates with its 95% interval, their sums,
the capture generates' iteration with every switch off and on against the idle generates beside
them, and whole capture generates against those idle generates. Every iteration is timed and
logged with what it did, in a shared mapping the forked engine writes (``step_alternation.npy``;
``--analyse`` reads one again).

``--switch`` says what alternates, a comma list that the capture generates take in turn, each
kind read apart against the idle generates beside its own: ``both`` (the default), ``host`` or
``nodes`` (one switch, the other on throughout), ``none`` (capture generates as shipped, every
switch on in every step, still timed by iteration). Session 29, one run each: ``both`` 1.022
of idle's speed, ``none`` 0.957; ``--switch both,none`` puts the two in one run. ``--period N``
keeps the step path's switch N iterations on, then N off (the nodes' 2N): a cost that needs
consecutive capturing steps shows in longer periods. Session 30, on one machine: ``both`` 0.997
of idle's speed and ``none`` 1.009; ``host``, ``nodes`` and ``none`` at ``--period 16`` 1.021,
0.979 and 1.004: nothing that needs consecutive steps.

The client times each generate too (``llm.generate``, ``generate_walls.npy``), as the benchmark
does: ``wall_vs_idle`` beside ``generate_vs_idle`` (the iterations' sum), and
``outside_vs_idle``, the time outside the engine's iterations (the outputs' way to the client,
the engine between iterations) against the idle generates beside ("wall" lines). Session 31, on
one machine: the iterations read capture 1.055 of idle's speed here while the benchmark on the
same machine read hidden-last at 0.960 of idle, paired; the benchmark times the client.

``--sample-ms M`` samples the engine's main thread every M ms of the engine process's CPU time
(``benchmarks/cpu_samples.py``): each capture generate's CPU by Python function against the idle
generates beside it, its first ``FIRST_STEADY`` iterations (prefill, first planned decode) and
its steady ones apart (the summary's ``cpu_samples``, from ``cpu_samples.jsonl``), to tell work
that capture adds in some function from all of vLLM's work running slower.

A diagnostic: the rows of these generates are not checked (on skipped steps and without nodes
they are not what the product captures), and the patches live here.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from benchmarks import cpu_samples as C  # noqa: E402
from benchmarks import report as R  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402
from benchmarks.profile_step import capture_and_generate, quick_decode_engine  # noqa: E402
from benchmarks.run import descendants, pin  # noqa: E402

# What an iteration's step path did (the log's "step" column).
NO_STEP, PLANNED, REPEATED, SKIPPED = 0, 1, 2, 3
# Log columns: duration (s), host on, nodes launched, step path kind, generate index, and what
# the generate switched (an index into SWITCHES; logs of session 29 lack it).
COLUMNS = 6
HEAD = 3  # rows written, the current generate's index (-1: not logging), what it switches
#: The engine's CPU samples (``--sample-ms``), beside the iteration log.
SAMPLES = "cpu_samples.jsonl"
#: Each generate's wall time in the client (``llm.generate``), by generate index, beside the
#: iteration log: what the engine's iterations do not hold (the output's way to the client, the
#: engine between iterations) is the difference.
WALLS = "generate_walls.npy"
#: A generate's iterations before this one hold its prefill and first planned decode steps;
#: from it on, steady decode.
FIRST_STEADY = 4


class IterationLog:
    """One row per engine iteration, in anonymous shared pages made before the engine forks."""

    def __init__(self, capacity: int = 1 << 20):
        self.capacity = capacity
        self._map = mmap.mmap(-1, 8 * (COLUMNS * capacity + HEAD))
        values = np.frombuffer(self._map, dtype=np.float64)
        self._head = values[:HEAD]
        self.rows = values[HEAD:].reshape(capacity, COLUMNS)
        self._head[1] = -1

    @property
    def count(self) -> int:
        return int(self._head[0])

    def start_generate(self, index: int, switch: str = "both") -> None:
        self._head[2] = SWITCH_NAMES.index(switch)
        self._head[1] = index

    def stop(self) -> None:
        self._head[1] = -1

    @property
    def generate(self) -> int:
        return int(self._head[1])

    @property
    def switch(self) -> str:
        return SWITCH_NAMES[int(self._head[2])]

    def append(self, duration: float, host: bool, nodes: bool, step: int, generate: int,
               switch: str = "both") -> None:
        i = int(self._head[0])
        if i < self.capacity:
            self.rows[i] = (duration, host, nodes, step, generate, SWITCH_NAMES.index(switch))
            self._head[0] = i + 1


#: The parts of a generate its CPU samples are counted in: its first iterations, the rest.
PARTS = ("head", "steady")


def part_label(generate: int, part: str) -> str:
    return f"{generate}:{part}"


def sample_label(generate: int, iteration: int) -> str | None:
    """The CPU samples' label of a generate's ``iteration``-th iteration (None: no generate is
    logging)."""
    if generate < 0:
        return None
    return part_label(generate, PARTS[0] if iteration < FIRST_STEADY else PARTS[1])


def switches_of(iteration: int, period: int = 2) -> tuple[bool, bool]:
    """Whether engine iteration ``iteration`` runs the step path and launches the capture nodes.
    Each is on half the time, and whatever this iteration does, the one before ran the step path
    as often as not, and launched the nodes as often as not where this one runs the step path or
    not; only the nodes follow the nodes (three times in four): each switch's cost in its own
    iteration and in the next can be told apart (the regression's columns are independent)."""
    return (iteration // period) % 2 == 0, (iteration // (2 * period)) % 2 == 0


#: What ``--switch`` alternates: (the step path, the capture nodes).
SWITCHES = {"both": (True, True), "host": (True, False), "nodes": (False, True),
            "none": (False, False)}
SWITCH_NAMES = tuple(SWITCHES)


class Alternation:
    """The patches, and the engine-side state they share (one engine process, one thread)."""

    def __init__(self, log: IterationLog, period: int = 2, sampler: C.Sampler | None = None):
        self.log, self.period, self.sampler = log, period, sampler
        self.switch = "both"  # what the current iteration's generate switches
        self.iteration = 0
        self.step_kind = NO_STEP
        self.nodes_launched = True
        self.last_shape = None
        self.sampled_generate, self.generate_iteration = -1, 0

    @property
    def host_on(self) -> bool:
        return not SWITCHES[self.switch][0] or switches_of(self.iteration, self.period)[0]

    @property
    def nodes_on(self) -> bool:
        return not SWITCHES[self.switch][1] or switches_of(self.iteration, self.period)[1]

    def install(self) -> None:
        from vllm.v1.engine.core import EngineCoreProc

        from vllm_capture.capture_graph import graph_nodes
        from vllm_capture.session.session import CaptureSession

        alt = self
        engine_step = EngineCoreProc._process_engine_step
        if alt.sampler is not None:
            alt.sampler.root = engine_step.__code__

        def timed_engine_step(core):
            # The generate it started in: the client may stop the log while it runs.
            generate, alt.switch = alt.log.generate, alt.log.switch
            if alt.sampler is not None:
                if not alt.sampler.running:  # in the engine's process: its timer is its own
                    alt.sampler.start()
                if generate != alt.sampled_generate:
                    alt.sampled_generate, alt.generate_iteration = generate, 0
                alt.sampler.set_label(sample_label(generate, alt.generate_iteration))
                alt.generate_iteration += 1
            alt.step_kind, alt.nodes_launched = NO_STEP, True
            t0 = time.perf_counter()
            try:
                return engine_step(core)
            finally:
                if generate >= 0:
                    alt.log.append(time.perf_counter() - t0, alt.step_kind != SKIPPED,
                                   alt.nodes_launched, alt.step_kind, generate, alt.switch)
                    alt.iteration += 1
                if alt.sampler is not None and not core.has_work():
                    # The engine now serves RPCs without stepping until the next generate:
                    # this generate's samples are written before the client reads them.
                    alt.sampler.set_label(None)

        EngineCoreProc._process_engine_step = timed_engine_step

        begin_step = CaptureSession.begin_step

        def alternating_begin_step(session, step):
            shape = (len(step.req_ids), step.num_rows_padded)
            repeated_shape, alt.last_shape = shape == alt.last_shape, shape
            streams = session._active_streams
            if (alt.log.generate >= 0 and not alt.host_on and repeated_shape and streams
                    and all(st.repeat is not None and st.config.reduce != "all" for st in streams)):
                for st in streams:
                    st.repeat.move_on()
                alt.step_kind = SKIPPED
                return
            repeats = session._repeat_steps
            begin_step(session, step)
            alt.step_kind = REPEATED if session._repeat_steps > repeats else PLANNED

        CaptureSession.begin_step = alternating_begin_step

        replay = graph_nodes._KeptGraphMixin.replay
        # Each graph's sites but the pinned one, the key of idle's copy: fixed once the graph is
        # adopted, so made once, not on every launch without nodes (it would cost that launch).
        idle_keys: dict[int, frozenset] = {}

        def alternating_replay(graph):
            registry = graph_nodes._active
            if alt.log.generate >= 0 and not alt.nodes_on and registry is not None:
                entry = registry._graphs.get(id(graph))
                if entry is not None and entry.draws_random is False:
                    idle = idle_keys.get(id(entry))
                    if idle is None:
                        idle = idle_keys[id(entry)] = frozenset(
                            k for k in entry.by_site if k not in registry.pinned)
                    graph_exec = entry.variants.get(idle)
                    if graph_exec is not None:
                        registry.driver.launch(graph_exec, graph_nodes._current_stream())
                        alt.nodes_launched = False
                        return
            replay(graph)

        graph_nodes._KeptGraphMixin.replay = alternating_replay


def paired(values: list[float]) -> dict | None:
    """Mean and 95% t interval of per-generate estimates (microseconds)."""
    if len(values) < 2:
        return None
    mean, half = R.mean_interval(values)
    return {"us": round(mean, 2), "ci95": [round(mean - half, 2), round(mean + half, 2)],
            "generates": len(values)}


#: The regression's terms: what each iteration did, and what the one before it did.
TERMS = ("host", "host_before", "nodes", "nodes_before")


def fit_generate(mine: np.ndarray) -> dict[str, float] | None:
    """Least squares over one capture generate's steady iterations (outliers above the 99th
    percentile left out): duration = base + each term's cost, in microseconds, for the switches
    that alternated (a switch on throughout is part of the base); None where too few iterations
    are steady or no switch alternated."""
    # The step path ran in a planned iteration too (one before a steady one, say).
    host = np.isin(mine[:, 3], (PLANNED, REPEATED)).astype(float)
    nodes = mine[:, 2]
    steady = np.isin(mine[:, 3], (REPEATED, SKIPPED))
    steady[0] = False  # no iteration before it
    us = mine[:, 0] * 1e6
    keep = steady & (us <= np.percentile(us[steady], 99)) if steady.any() else steady
    if keep.sum() < 32:
        return None
    columns = {"host": host, "host_before": np.roll(host, 1),
               "nodes": nodes, "nodes_before": np.roll(nodes, 1)}
    terms = [t for t in TERMS if np.ptp(columns[t.removesuffix("_before")][keep]) > 0]
    if not terms:
        return None
    x = np.column_stack([np.ones(len(mine))] + [columns[t] for t in terms])[keep]
    if np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(x, us[keep], rcond=None)
    return {"base": float(coef[0]), **{t: float(c) for t, c in zip(terms, coef[1:])}}


def is_capture(generate):
    """Generates alternate, idle first: the odd ones capture (an int, or an array of them)."""
    return generate % 2 == 1


def analyse(rows: np.ndarray, switch: str = "both", samples: dict | None = None,
            walls: np.ndarray | None = None) -> dict:
    """By what the capture generates switched (the log's column, or ``switch`` for a log
    without it): each switch's cost in its own iteration and in the next (regression per
    capture generate, interval over generates); the capture generates' iteration with every
    switch off (the fitted base) and on, and their median steady iteration, against the idle
    generates' median steady iteration just before and after; whole generates against those
    beside them; and, given the engine's CPU ``samples`` (``cpu_samples.read_samples``), their
    main thread's CPU by function against those beside them; given the client's ``walls`` (a
    generate's seconds by its index, NaN where not timed), whole generates as the client timed
    them against those beside them, and the time outside the engine's iterations (wall less
    iterations) against theirs. The idle generates' median steady iteration, and how many there
    are."""
    fits, medians, totals, kinds = {}, {}, {}, {}
    for g in np.unique(rows[:, 4]).astype(int):
        mine = rows[rows[:, 4] == g]
        totals[g] = float(mine[:, 0].sum())
        # Past the prefill and first decode steps: the steady iterations.
        medians[g] = float(np.median(mine[FIRST_STEADY:-1, 0])) * 1e6
        if is_capture(g):
            kinds[g] = SWITCH_NAMES[int(mine[0, 5])] if rows.shape[1] > 5 else switch
            fit = fit_generate(mine)
            if fit is not None:
                fits[g] = fit
    idle = {g: medians[g] for g in totals if not is_capture(g)}

    def against_idle(generates, value, among=idle) -> list[float]:
        """``value(g, near)``: ``near``, the idle generates just before and after ``g`` (of
        those ``among``)."""
        return [value(g, near) for g in generates
                if (near := [h for h in (g - 1, g + 1) if h in among])]

    def idle_us(near) -> float:
        return statistics.fmean(idle[h] for h in near)

    by_switch = {}
    for kind in dict.fromkeys(kinds.values()):
        captures = [g for g, k in kinds.items() if k == kind]
        fitted = {g: fits[g] for g in captures if g in fits}
        out: dict = {name: paired([f[name] for f in fitted.values() if name in f])
                     for name in TERMS}
        for name in ("host", "nodes"):
            out[f"{name}_total"] = paired([f[name] + f[f"{name}_before"]
                                           for f in fitted.values() if name in f])
        out["base_us"] = paired([f["base"] for f in fitted.values()])
        out["base_vs_idle"] = paired(against_idle(
            fitted, lambda g, near: fits[g]["base"] - idle_us(near)))
        out["all_on_vs_idle"] = paired(against_idle(
            fitted, lambda g, near: fits[g]["base"] + sum(fits[g].get(t, 0.0) for t in TERMS)
            - idle_us(near)))
        # Every capture generate, fitted or not (nothing to fit where nothing switched), as it
        # ran: its median steady iteration, and the whole generate as idle's speed over its
        # (below 1: slower).
        out["iteration_vs_idle"] = paired(against_idle(
            captures, lambda g, near: medians[g] - idle_us(near)))
        out["generate_vs_idle"] = R.geometric_mean_interval(against_idle(
            captures, lambda g, near: float(np.log(statistics.fmean(totals[h] for h in near)
                                                   / totals[g]))))
        if walls is not None:
            wall = {g: float(walls[g]) for g in totals if g < len(walls) and walls[g] > 0}
            outside = {g: (wall[g] - totals[g]) * 1e6 for g in wall}
            timed, idle_timed = [g for g in captures if g in wall], {h for h in idle if h in wall}
            out["wall_vs_idle"] = R.geometric_mean_interval(against_idle(
                timed, lambda g, near: float(np.log(statistics.fmean(wall[h] for h in near)
                                                    / wall[g])), idle_timed))
            out["outside_vs_idle"] = paired(against_idle(
                timed, lambda g, near: outside[g] - statistics.fmean(outside[h] for h in near),
                idle_timed))
        if samples:
            out["cpu_samples"] = {part: C.compare(samples, [
                (part_label(g, part), [part_label(g - 1, part), part_label(g + 1, part)])
                for g in captures]) for part in reversed(PARTS)}
        capture = rows[np.isin(rows[:, 4], captures)]
        out["iterations"] = {"capture": len(capture),
                             "skipped": int(np.sum(capture[:, 3] == SKIPPED)),
                             "without_nodes": int(np.sum(capture[:, 2] == 0)),
                             "planned": int(np.sum(capture[:, 3] == PLANNED))}
        out["capture_generates"], out["fitted_generates"] = len(captures), len(fitted)
        by_switch[kind] = out
    return {"switches": by_switch,
            "idle_us": round(statistics.median(idle.values()), 1) if idle else None,
            "idle_generates": len(idle)}


def parse_switches(text: str) -> list[str]:
    """``--switch``: a comma list of SWITCHES, which the capture generates take in turn."""
    kinds = [k for k in text.split(",") if k]
    unknown = [k for k in kinds if k not in SWITCHES]
    if not kinds or unknown:
        raise ValueError(f"--switch: {', '.join(unknown) or repr(text)} not among "
                         f"{', '.join(SWITCHES)}")
    return kinds


def check_switches(rows: np.ndarray) -> str | None:
    """Whether each capture generate's iterations did what it asked (its log column): what
    went wrong, or None."""
    for kind in SWITCH_NAMES:
        mine = rows[(rows[:, 5] == SWITCH_NAMES.index(kind)) & is_capture(rows[:, 4].astype(int))]
        if not len(mine):
            continue
        acted = (bool(np.any(mine[:, 3] == SKIPPED)), bool(np.any(mine[:, 2] == 0)))
        if acted != SWITCHES[kind]:
            return (f"the patches did not act as --switch {kind} asks: {len(mine)} iterations "
                    f"logged, {int(np.sum(mine[:, 3] == SKIPPED))} skipped the step path, "
                    f"{int(np.sum(mine[:, 2] == 0))} launched without nodes")
    return None


def log_exists(path: Path | str) -> bool:
    return Path(path).exists() or Path(f"{path}.gz").exists()


def load_log(path: Path | str) -> np.ndarray:
    """A saved ``.npy`` log; where it is missing, its gzipped twin (``.npy.gz``: the committed
    logs are kept so, as every H200 call carries the tree)."""
    path = Path(path)
    if path.suffix != ".gz" and (path.exists() or not Path(f"{path}.gz").exists()):
        return np.load(path)
    with gzip.open(path if path.suffix == ".gz" else f"{path}.gz", "rb") as f:
        return np.load(io.BytesIO(f.read()))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1b", choices=sorted(S.MODELS))
    p.add_argument("--out", required=True)
    p.add_argument("--analyse", metavar="NPY", help="analyse a saved iteration log "
                   "(step_alternation.npy, or its .npy.gz where that is what is there) into "
                   "--out instead of running an engine")
    p.add_argument("--switch", default="both",
                   help="what alternates in a capture generate, a comma list that the capture "
                   "generates take in turn: both (default), host (the step path only), nodes "
                   "(the capture nodes only), none (capture generates as shipped, timed by "
                   "iteration beside the idle ones); for --analyse of a log without the "
                   "column, what its capture generates switched")
    p.add_argument("--period", type=int, default=2,
                   help="iterations the step path's switch stays on, then off (the nodes': "
                   "twice that); default 2")
    p.add_argument("--generates", type=int, default=60,
                   help="idle generates, and as many capture generates")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no pair of generates after this many seconds of them")
    p.add_argument("--sample-ms", type=float, default=0.0,
                   help="sample the engine's main thread every this many ms of its process's "
                   "CPU time (cpu_samples.jsonl; 0, the default: not sampled)")
    args = p.parse_args()
    if args.period < 1:
        p.error(f"--period: {args.period} is not a number of iterations (1 or more)")
    if args.sample_ms < 0:
        p.error(f"--sample-ms: {args.sample_ms} is not an interval (0: off)")
    try:
        kinds = parse_switches(args.switch)
    except ValueError as exc:
        p.error(str(exc))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.analyse:
        beside = Path(args.analyse).with_name(SAMPLES)
        if not beside.exists():
            beside = beside.with_name(SAMPLES + ".gz")  # as gpu_session.sh brings it back
        walls = Path(args.analyse).with_name(WALLS)  # runs since session 31
        return write_summary(load_log(args.analyse), out, kinds[0], beside,
                             load_log(walls) if log_exists(walls) else None)
    # Asked of NVML: CUDA initialised here would fail the engine core forked from this process.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    if not torch.cuda.is_available():
        # Off CUDA there are no graphs to launch without nodes, and vLLM's CPU engine runs its
        # model in a worker process of its own, which the session's patch does not reach.
        raise SystemExit("step_alternation.py runs on a GPU (--analyse reads a saved log anywhere)")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm_capture import api

    log = IterationLog()
    sampler = None
    if args.sample_ms:
        (out / SAMPLES).unlink(missing_ok=True)
        sampler = C.Sampler(out / SAMPLES, args.sample_ms / 1e3)
    Alternation(log, args.period, sampler).install()
    llm, shape, w, params, prompts = quick_decode_engine(args.model, "capture-graph")
    if len(os.sched_getaffinity(0)) >= 8:
        pin([os.getpid()], [0, 1, 2, 3])
        pin(descendants(os.getpid()), [4, 5, 6, 7])
    cap = S.SCENARIOS["hidden-last"].capture
    # Warm-up: idle, then a capture (its graph copies made), then idle again.
    for c in (None, cap, None):
        capture_and_generate(llm, c, shape, w, params, prompts)
        if c is not None:
            api.fetch_captured(llm, c.stream, clear=True)
            api.stop_capture(llm, c.stream)
    walls = np.full(2 * args.generates, np.nan)
    started = time.perf_counter()
    for i in range(2 * args.generates):
        if args.budget_s is not None and i % 2 == 0 and time.perf_counter() - started > args.budget_s:
            print(f"budget: {i} generates", flush=True)
            break
        c = cap if is_capture(i) else None
        if c is not None:
            api.start_capture(llm, c.stream, layers=c.layer_ids(shape), reduce=c.reduce)
        batch = prompts.make(w)
        log.start_generate(i, "none" if c is None else kinds[(i // 2) % len(kinds)])
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        walls[i] = time.perf_counter() - t0
        log.stop()
        if c is not None:
            api.fetch_captured(llm, c.stream, clear=True)
            api.stop_capture(llm, c.stream)
    rows = log.rows[:log.count].copy()
    wrong = "no iteration was logged" if not len(rows) else check_switches(rows)
    if wrong:
        raise SystemExit(wrong)
    np.save(out / "step_alternation.npy", rows)
    np.save(out / WALLS, walls)
    if sampler is not None and not (out / SAMPLES).exists():
        raise SystemExit(f"--sample-ms: the engine wrote no {SAMPLES}")
    return write_summary(rows, out, samples_path=out / SAMPLES, walls=walls)


def wall_lines(result: dict) -> list[str]:
    """One kind's whole generates as the engine's iterations and as the client timed them
    (idle's speed over theirs), and the time outside the iterations against idle's."""
    if result.get("wall_vs_idle") is None:
        return []
    lines = [f"iterations {R.ratio_text(result['generate_vs_idle'])}, "
             f"client {R.ratio_text(result['wall_vs_idle'])}"
             f" of idle's speed ({result['wall_vs_idle']['pairs']} pairs)"]
    outside = result.get("outside_vs_idle")
    if outside:
        lines.append(f"outside the iterations {outside['us'] / 1e3:+.2f} ms a generate "
                     f"({outside['ci95'][0] / 1e3:+.2f} to {outside['ci95'][1] / 1e3:+.2f})")
    return lines


def write_summary(rows: np.ndarray, out: Path, switch: str = "both",
                  samples_path: Path | None = None, walls: np.ndarray | None = None) -> int:
    samples = (C.read_samples(samples_path) if samples_path is not None and samples_path.exists()
               else None)
    summary = analyse(rows, switch, samples, walls)
    (out / "step_alternation.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary), flush=True)
    for kind, result in summary["switches"].items():
        for line in wall_lines(result):
            print(f"wall {kind}: {line}", flush=True)
        for part, compared in (result.get("cpu_samples") or {}).items():
            for line in C.table(compared):
                print(f"cpu {kind} {part}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
