"""From measurements to figures: medians, ratios to the baseline, pass/fail lines, report files.

Pure apart from the file writers (JSON, markdown, a matplotlib PNG); no torch, no vLLM.
A measurement is one timed generate (one rep) as the engine worker reports it::

    {"engine", "workload", "scenario", "rep", "gen_s", "fetch_s", "generated_tokens",
     "prompt_tokens", "rows", "positions", "bytes", "dropped", "rows_expected", ...}
"""

from __future__ import annotations

import gzip
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.scenarios import BASELINE, IDLE

GIB = float(1 << 30)


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _max(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


FETCH_STAGES = ("finalize", "drain", "wait", "serialize", "write")


def _per_step(rep: dict, *keys: str, steps_key: str = "host_steps") -> float | None:
    steps = rep.get(steps_key)
    if not steps or any(rep.get(k) is None for k in keys):
        return None
    return sum(rep[k] for k in keys) / steps


# Two-sided 95% quantiles of Student's t, by degrees of freedom (1-30; beyond, the normal's).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_ratio(base: list[dict], reps: list[dict]) -> dict | None:
    """Tok/s of each rep (end to end: generate + fetch) over the baseline's generate of the same
    rep, which ran beside it: the geometric mean over reps and its 95% confidence interval (t on
    the log ratios). Adjacent generates share the host's slow drift, so a rep's pair cancels it
    where medians of each side do not (on the H200 host, 1B generates vary by 15% rep to rep).
    A rep of several generates (``run.py --block``) counts as their tokens over their seconds."""
    base_s = sum_by_rep(base, lambda m: (m["gen_s"], m["generated_tokens"]))
    own_s = sum_by_rep(reps, lambda m: (m["gen_s"] + m.get("fetch_s", 0.0), m["generated_tokens"]))
    return geometric_mean_interval([
        math.log(base_s[k][0] / base_s[k][1] * tokens / s)
        for k, (s, tokens) in own_s.items() if k in base_s])


def sum_by_rep(ms: list[dict], value) -> dict:
    """By rep (its ``rep``, else its place in ``ms``), the element-wise sum of ``value(m)`` (a
    tuple) over the rep's generates (several with ``run.py --block``); a generate whose value is
    None is left out."""
    return {key: sums for key, (sums, _) in _sums_by_rep(ms, value).items()}


def mean_by_rep(ms: list[dict], value) -> dict:
    """As ``sum_by_rep``, the element-wise mean over the rep's generates: a figure "a
    generate" whatever ``--block`` was."""
    return {key: tuple(x / count for x in sums)
            for key, (sums, count) in _sums_by_rep(ms, value).items()}


def _sums_by_rep(ms: list[dict], value) -> dict:
    out: dict = {}
    for i, m in enumerate(ms):
        v = value(m)
        if v is None:
            continue
        key = m.get("rep", i)
        if key in out:
            sums, count = out[key]
            out[key] = (tuple(a + b for a, b in zip(sums, v)), count + 1)
        else:
            out[key] = (tuple(v), 1)
    return out


def iteration_split(base: list[dict], reps: list[dict]) -> dict | None:
    """A generate's time split where the engine spent it (``run.py``'s ``engine_iterations_s``,
    ``benchmarks/engine_iterations.py``), rep by rep against the baseline's generates of the
    same rep: ``iterations``, the baseline's iteration seconds over these (geometric mean, 95%
    interval; below 1: slower), and ``outside_ms``, the rest of a generate (``gen_s`` less the
    iterations) in ms more than the baseline's (each rep's generates averaged; mean over reps,
    95% interval). None where fewer than one rep of each has the split."""
    def split(m: dict) -> tuple[float, float] | None:
        inside = m.get("engine_iterations_s")
        return None if inside is None else (inside, m["gen_s"] - inside)

    base_s, own_s = mean_by_rep(base, split), mean_by_rep(reps, split)
    common = [k for k in own_s if k in base_s]
    if not common:
        return None
    mean, half = mean_interval([(own_s[k][1] - base_s[k][1]) * 1e3 for k in common])
    return {"iterations": geometric_mean_interval([math.log(base_s[k][0] / own_s[k][0])
                                                   for k in common]),
            "outside_ms": {"ms": mean, "ci95": None if half is None else [mean - half, mean + half],
                           "reps": len(common)}}


#: A generate's iterations by their place in it (``run.py``'s ``engine_iteration_ms``): the
#: first (the prefill of the requests that reached the engine before it), the next
#: ``EARLY_ITERATIONS`` (the first of them prefills the rest outside CUDA graphs, session 35;
#: then the first decode steps, planned anew), the last ``TAIL_ITERATIONS`` (the requests' end)
#: and the steady ones between; ``steady_iteration`` is the steady ones' median, one iteration.
ITERATION_PARTS = ("head", "early", "steady", "tail", "steady_iteration")
EARLY_ITERATIONS, TAIL_ITERATIONS = 4, 4


def iteration_parts(ms: list[float] | None) -> tuple[float, ...] | None:
    """``ITERATION_PARTS`` of one generate's iteration ms (None for too few iterations)."""
    if not ms or len(ms) < 2 + EARLY_ITERATIONS + TAIL_ITERATIONS:
        return None
    steady = ms[1 + EARLY_ITERATIONS:-TAIL_ITERATIONS]
    return (ms[0], sum(ms[1:1 + EARLY_ITERATIONS]), sum(steady), sum(ms[-TAIL_ITERATIONS:]),
            statistics.median(steady))


def parts_summary(reps: list[dict]) -> dict | None:
    """Medians over generates of ``iteration_parts``, and the steady iterations' count."""
    kept = [(len(r["engine_iteration_ms"]), parts) for r in reps
            if (parts := iteration_parts(r.get("engine_iteration_ms")))]
    if not kept:
        return None
    return {"generates": len(kept),
            **{name: statistics.median(p[i] for _, p in kept)
               for i, name in enumerate(ITERATION_PARTS)},
            "steady_count": statistics.median(
                n - 1 - EARLY_ITERATIONS - TAIL_ITERATIONS for n, _ in kept)}


def parts_against(base: list[dict], reps: list[dict]) -> dict | None:
    """Rep by rep against the baseline's generates of the same rep: the ms more a generate in
    each of ``ITERATION_PARTS`` (each rep's generates averaged, then the mean over reps and its
    95% interval). None where no rep of each has them."""
    base_p = mean_by_rep(base, lambda m: iteration_parts(m.get("engine_iteration_ms")))
    own_p = mean_by_rep(reps, lambda m: iteration_parts(m.get("engine_iteration_ms")))
    common = [k for k in own_p if k in base_p]
    if not common:
        return None
    out = {"reps": len(common)}
    for i, name in enumerate(ITERATION_PARTS):
        mean, half = mean_interval([own_p[k][i] - base_p[k][i] for k in common])
        out[name] = {"ms": mean, "ci95": None if half is None else [mean - half, mean + half]}
    return out


def ms_text(d: dict, fmt: str = "{:+.1f}") -> str:
    """A mean difference in ms with its 95% interval (``{"ms", "ci95"}``), e.g. "+1.4 (+0.7 to
    +2.1)"."""
    ci = d["ci95"]
    return fmt.format(d["ms"]) + (f" ({fmt.format(ci[0])} to {fmt.format(ci[1])})" if ci else "")


def parts_text(delta: dict) -> str:
    """A ``parts_against`` as text."""
    return (f"head {ms_text(delta['head'])}, iterations 1-{EARLY_ITERATIONS} "
            f"{ms_text(delta['early'])}, steady {ms_text(delta['steady'])}, last "
            f"{TAIL_ITERATIONS} {ms_text(delta['tail'])} ms a generate; a steady iteration "
            f"{ms_text(delta['steady_iteration'], '{:+.3f}')} ms ({delta['reps']} reps)")


def mean_interval(values: list[float]) -> tuple[float, float | None]:
    """The mean of ``values`` and the half width of its 95% interval (t; None for one value)."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    sd = math.sqrt(sum((x - mean) ** 2 for x in values) / (len(values) - 1))
    return mean, t95(len(values) - 1) * sd / math.sqrt(len(values))


def t95(df: int) -> float:
    """Student's t quantile for a two-sided 95% interval with ``df`` degrees of freedom: the
    table to 30, then Hill's expansion around the normal quantile (within 1e-5 there)."""
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.959963984540054
    return (z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
            + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3)
            + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * df**4))


def geometric_mean_interval(logs: list[float]) -> dict | None:
    """The geometric mean of ratios given as logs, with its 95% interval (t on the logs)."""
    if not logs:
        return None
    mean, half = mean_interval(logs)
    if half is None:
        return {"value": math.exp(mean), "ci95": None, "pairs": 1}
    return {"value": math.exp(mean), "ci95": [math.exp(mean - half), math.exp(mean + half)],
            "pairs": len(logs)}


def median_tok_s_by(reps: list[dict], key) -> dict:
    """Median generate tok/s of ``reps`` grouped by ``key(rep)``, in first-seen order (reps
    whose key is None are left out)."""
    groups: dict = {}
    for r in reps:
        k = key(r)
        if k is not None:
            groups.setdefault(k, []).append(r["generated_tokens"] / r["gen_s"])
    return {k: _median(v) for k, v in groups.items()}


#: ``engine_iterations.ALLOCATOR_COUNTERS`` as the head table and lines name them.
ALLOCATOR_NAMES = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree",
                   "num_alloc_retries": "retries", "num_sync_all_streams": "stream syncs"}


def _mean_counts(records: list[dict]) -> dict:
    """Each allocator counter's mean over ``records`` (None where no record has it)."""
    return {name: _mean([r.get(name) for r in records]) for name in ALLOCATOR_NAMES}


def head_summary(reps: list[dict]) -> dict | None:
    """Each generate's first engine iteration (``run.py``'s ``engine_head``): median ms,
    engine-thread CPU ms and engine-process CPU ms, the means of the garbage collection ms, the
    thread's minor page faults and involuntary switches and the allocator counters' increase in
    it; the engine's collections over the whole generate (``engine_gc``: mean ms, mean full
    collections); the same by the scenario that ran just before (``by_after``); and the engine's allocator calls from its previous
    generate's head to this one's, by that generate's scenario (``since_by_previous``: what a
    generate's rest, drains and fetch asked of the allocator). None where no rep has a head."""
    heads = [r for r in reps if r.get("engine_head")]
    if not heads:
        return None

    def summary(group: list[dict]) -> dict:
        def values(key, scale=1.0):
            return [r["engine_head"][key] * scale for r in group]

        return {"generates": len(group),
                "ms": _median(values("seconds", 1e3)),
                "cpu_ms": _median(values("cpu_seconds", 1e3)),
                "process_cpu_ms": _median(values("process_cpu_seconds", 1e3)),
                "gc_ms": _mean(values("gc_seconds", 1e3)),
                "minor_faults": _mean(values("minor_faults")),
                "involuntary_switches": _mean(values("involuntary_switches")),
                "allocator": _mean_counts([r["engine_head"]["allocator"] for r in group])}

    collected = [r["engine_gc"] for r in heads if r.get("engine_gc")]

    by_after: dict = {}
    for r in heads:
        if r.get("after") is not None:
            by_after.setdefault(r["after"], []).append(r)
    since: dict = {}
    for r in heads:
        if r.get("engine_allocator_since"):
            since.setdefault(r["engine_allocator_since"]["scenario"], []).append(
                r["engine_allocator_since"])
    return {**summary(heads), "by_after": {k: summary(v) for k, v in by_after.items()},
            # The engine's garbage collections over the whole generate (means).
            "generate_gc_ms": _mean([c["seconds"] * 1e3 for c in collected]),
            "generate_gc_full": _mean([c["full"] for c in collected]),
            "since_by_previous": {k: {"generates": len(v), **_mean_counts(v)}
                                  for k, v in since.items()}}


def head_text(head: dict) -> str:
    """A ``head_summary`` as text: ms, CPU, process CPU and GC ms, faults, involuntary switches
    and allocator calls, the generate's GC, then the same in short by the scenario before."""
    counts = ", ".join(f"{label} {_f(head['allocator'][name], '{:.1f}')}"
                       for name, label in ALLOCATOR_NAMES.items())
    text = (f"{_f(head['ms'], '{:.1f}')} ms (CPU {_f(head['cpu_ms'], '{:.1f}')}, process "
            f"{_f(head['process_cpu_ms'], '{:.1f}')}, GC {_f(head['gc_ms'], '{:.1f}')}; faults "
            f"{_f(head['minor_faults'], '{:.0f}')}, preempted {_f(head['involuntary_switches'], '{:.1f}')}), "
            f"{counts} a generate ({head['generates']})")
    if head.get("generate_gc_ms") is not None:
        text += (f"; GC in the generate {head['generate_gc_ms']:.1f} ms, "
                 f"{head['generate_gc_full']:.2f} full")
    for after, group in head["by_after"].items():
        text += (f"; after {after} {_f(group['ms'], '{:.1f}')} ms, process CPU "
                 f"{_f(group['process_cpu_ms'], '{:.1f}')}, GC {_f(group['gc_ms'], '{:.1f}')}, "
                 f"faults {_f(group['minor_faults'], '{:.0f}')}, retries "
                 f"{_f(group['allocator']['num_alloc_retries'], '{:.1f}')}")
    return text


def _pooled_means(groups: list[dict]) -> dict:
    """Means of ``_mean_counts`` groups (each with its ``generates``) pooled into one."""
    out = {"generates": sum(g["generates"] for g in groups)}
    for name in ALLOCATOR_NAMES:
        known = [(g[name], g["generates"]) for g in groups if g[name] is not None]
        out[name] = sum(v * n for v, n in known) / sum(n for _, n in known) if known else None
    return out


def threads_ms_per_step(reps: list[dict]) -> dict[str, list[float]]:
    """Median over reps of each thread's milliseconds per step on a CPU and waiting for one
    during the generate (``run.py``'s ``engine_threads_ms`` and ``client_threads_ms``, keyed
    ``engine <name>`` and ``client <name>``; a thread absent from a rep counts as zero there)."""
    per_rep = []
    for r in reps:
        if not r.get("steps"):
            continue
        spent = {}
        for side in ("engine", "client"):
            for name, (cpu, wait) in (r.get(f"{side}_threads_ms") or {}).items():
                spent[f"{side} {name}"] = (cpu / r["steps"], wait / r["steps"])
        per_rep.append(spent)
    names = dict.fromkeys(n for spent in per_rep for n in spent)
    return {n: [_median([spent.get(n, (0.0, 0.0))[k] for spent in per_rep]) for k in (0, 1)]
            for n in names}


#: What ``run.Nvml.sample`` reads (medians over readings; the clock event reasons OR-ed).
GPU_FIELDS = ("sm_mhz", "mem_mhz", "power_w", "temp_c", "util_gpu", "util_mem", "pcie_rx_mb_s",
              "pcie_tx_mb_s")


def gpu_summary(readings: list[dict]) -> dict | None:
    """NVML readings in one record: each field's median (None where none read it), the clock
    event reasons seen in any (a bit mask), and how many readings there were. Over a generate's
    readings (``run.GpuSampler``), then over the reps' records (``aggregate``)."""
    if not readings:
        return None
    out = {k: _median([x[k] for x in readings]) for k in GPU_FIELDS}
    reasons = 0
    for x in readings:
        reasons |= int(x["clock_reasons"] or 0)
    return {**out, "clock_reasons": reasons, "samples": len(readings)}


def _by_cpus(reps: list[dict]) -> dict[str, float]:
    """Median generate tok/s per CPU group the reps ran on (``{}`` when not pinned)."""
    by = median_tok_s_by(reps, lambda r: tuple(sorted(r["cpus"])) if r.get("cpus") else None)
    return {_cpus(list(k)): v for k, v in sorted(by.items())}


def aggregate(reps: list[dict]) -> dict:
    """Medians over the reps of one (engine, workload, scenario)."""
    def per_rep(fn):
        return [fn(r) for r in reps]

    e2e = [r["gen_s"] + r.get("fetch_s", 0.0) for r in reps]
    out = {
        "reps": len(reps),
        "gen_s": _median(per_rep(lambda r: r["gen_s"])),
        "fetch_s": _median(per_rep(lambda r: r.get("fetch_s", 0.0))),
        "tok_s": _median(per_rep(lambda r: r["generated_tokens"] / r["gen_s"])),
        "tok_s_e2e": _median([r["generated_tokens"] / t for r, t in zip(reps, e2e)]),
        "tok_s_all": _median(per_rep(lambda r: (r["generated_tokens"] + r.get("prompt_tokens", 0))
                                     / r["gen_s"])),
        "tok_s_reps": [round(r["generated_tokens"] / r["gen_s"], 1) for r in reps],
        # Per rep, in run order: a fetch's cost can depend on what ran before it (reps of all
        # scenarios interleave), which a median hides.
        "fetch_s_reps": [round(r.get("fetch_s", 0.0), 4) for r in reps],
        "fetch_stages_ms_reps": [[r.get(f"host_fetch_{stage}_ms") for stage in FETCH_STAGES]
                                 for r in reps],
        # Single generates fall into a slow or a fast mode on the H200 host (engine_order.py):
        # best against best compares like with like once each side has one fast rep.
        "tok_s_best": max((r["generated_tokens"] / r["gen_s"] for r in reps), default=None),
        # Pinned side by side, the engines move between CPU groups (every two reps): a group's
        # own speed shows as the same column slower for every engine.
        "tok_s_by_cpus": _by_cpus(reps),
        # By the scenario whose generate ran just before (``{}`` when the measurements do not say).
        "tok_s_by_after": median_tok_s_by(reps, lambda r: r.get("after")),
        "threads_ms_per_step": threads_ms_per_step(reps),
        # The engine's iterations during the generate, and the rest of it (iteration_split).
        "iterations_s": _median(per_rep(lambda r: r.get("engine_iterations_s"))),
        "outside_iterations_ms": _median(per_rep(
            lambda r: None if r.get("engine_iterations_s") is None
            else (r["gen_s"] - r["engine_iterations_s"]) * 1e3)),
        "head": head_summary(reps),
        "iteration_parts": parts_summary(reps),
        # What the GPU ran at during the generates (NVML, sampled on the client's thread); its
        # ``samples``: the reps that read it.
        "gpu": gpu_summary([r["gpu"] for r in reps if r.get("gpu")]),
        "rows": _median(per_rep(lambda r: r.get("rows", 0))),
        "positions": _median(per_rep(lambda r: r.get("positions", 0))),
        "bytes": _median(per_rep(lambda r: r.get("bytes", 0))),
        "rows_s": _median([r.get("rows", 0) / t for r, t in zip(reps, e2e)]),
        "gbps": _median([r.get("bytes", 0) / t / 1e9 for r, t in zip(reps, e2e)]),
        "bytes_per_token": _median(per_rep(lambda r: r.get("bytes", 0) / r["generated_tokens"])),
        "dropped": _max(per_rep(lambda r: r.get("dropped", 0))) or 0,
        "rows_expected": reps[0].get("rows_expected") if reps else None,
        "client_peak_rss": _max(per_rep(lambda r: r.get("client_peak_rss"))),
        "engine_peak_rss": _max(per_rep(lambda r: r.get("engine_peak_rss"))),
        "nvml_used": _max(per_rep(lambda r: r.get("nvml_used"))),
        "graph_replays": _median(per_rep(lambda r: r.get("graph_replays"))),
        "eager_forwards": _median(per_rep(lambda r: r.get("eager_forwards"))),
        # Graph launches from a copy without idle sites' capture nodes (one per piece of a
        # piecewise forward); and the idle sites' nodes that launches by torch ran.
        "copy_replays": _median(per_rep(lambda r: r.get("copy_replays"))),
        "idle_nodes_replayed": _median(per_rep(lambda r: r.get("idle_nodes_replayed"))),
        # Capture's host time per step on the step path, and on the harvest thread (rank 0).
        "host_ms_per_step": _median(per_rep(lambda r: _per_step(
            r, "host_begin_step_ms", "host_end_step_ms", "host_finish_requests_ms"))),
        # begin_step of the steps that planned nothing (steady decode), each.
        "repeat_ms_per_step": _median(per_rep(lambda r: _per_step(
            r, "host_begin_repeat_ms", steps_key="host_repeat_steps"))),
        "harvest_ms_per_step": _median(per_rep(lambda r: _per_step(r, "host_harvest_ms"))),
        # Of the harvest thread's time, what it spent waiting for device-to-host copies.
        "harvest_sync_ms_per_step": _median(per_rep(lambda r: _per_step(r, "host_harvest_sync_ms"))),
        # Where a fetch's time goes in the worker (rank 0), in ms: the rest of fetch_s is the RPC
        # and the client's decode.
        **{f"fetch_{stage}_ms": _median(per_rep(lambda r, k=f"host_fetch_{stage}_ms": r.get(k)))
           for stage in FETCH_STAGES},
    }
    expected = out["rows_expected"]
    out["complete"] = (out["dropped"] == 0 and (expected is None
                                                or all(r.get("rows", 0) == expected for r in reps)))
    return out


def summarize(measurements: list[dict]) -> dict[str, dict[str, dict]]:
    """``{workload: {scenario: aggregate + ratios}}``; ratios are to the baseline's generate-only
    tok/s of the same workload (``ratio``: generate only, ``ratio_e2e``: generate + fetch)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    engines: dict[tuple[str, str], str] = {}
    for m in measurements:
        key = (m["workload"], m["scenario"])
        groups.setdefault(key, []).append(m)
        engines[key] = m["engine"]
    table: dict[str, dict[str, dict]] = {}
    for (workload, scenario), reps in groups.items():
        agg = aggregate(sorted(reps, key=lambda r: r.get("rep", 0)))
        agg["engine"] = engines[(workload, scenario)]
        base_reps = groups.get((workload, BASELINE))
        agg["ratio_paired_e2e"] = paired_ratio(base_reps, reps) if base_reps else None
        idle_reps = groups.get((workload, IDLE))
        agg["split_vs"] = {
            against: split for against, others in ((BASELINE, base_reps), (IDLE, idle_reps))
            if others and against != scenario and (split := iteration_split(others, reps))}
        agg["parts_vs"] = {
            against: parts for against, others in ((BASELINE, base_reps), (IDLE, idle_reps))
            if others and against != scenario and (parts := parts_against(others, reps))}
        table.setdefault(workload, {})[scenario] = agg
    for rows in table.values():
        base = rows.get(BASELINE, {}).get("tok_s")
        best = rows.get(BASELINE, {}).get("tok_s_best")
        idle = rows.get(IDLE, {})
        for agg in rows.values():
            agg["ratio"] = agg["tok_s"] / base if base else None
            agg["ratio_e2e"] = agg["tok_s_e2e"] / base if base else None
            agg["ratio_best"] = agg["tok_s_best"] / best if best and agg["tok_s_best"] else None
            # The same engine with capture installed and off: what capturing itself costs,
            # free of any difference between two engines.
            same = idle.get("tok_s") and agg["engine"] == idle.get("engine")
            agg["ratio_idle"] = agg["tok_s"] / idle["tok_s"] if same else None
            agg["ratio_idle_e2e"] = agg["tok_s_e2e"] / idle["tok_s"] if same else None
    return table


# ---- pass/fail -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Check:
    name: str
    scenario: str
    threshold: float
    against: str | None = None  # None: ratio to vanilla; else tok/s ratio scenario / against


CHECKS = (
    Check("idle >= 0.99 x vanilla", "idle", 0.99),
    Check("last-token all-layer hidden >= 0.97 x vanilla", "hidden-last", 0.97),
    Check("4 layers all positions >= 0.90 x vanilla", "hidden-4l", 0.90),
    Check("router logits all layers >= 0.95 x vanilla", "router-all", 0.95),
    Check("graph capture >= 3x eager capture (stated for the 1B model)", "hidden-last", 3.0,
          against="eager-hidden-last"),
)
HEAVY_RATIO, HEAVY_LINK_FRACTION = 0.5, 0.7


def _line(name, workload, value, threshold, passed, detail=""):
    return {"check": name, "workload": workload, "value": value, "threshold": threshold,
            "passed": bool(passed), "detail": detail}


def _incomplete(agg: dict) -> str:
    if agg.get("complete", True):
        return ""
    return f"incomplete: {agg['dropped']} dropped, rows {agg['rows']} of {agg['rows_expected']}"


def heavy_check(workload: str, agg: dict, base_tok_s: float | None, link_gbps: float | None) -> dict:
    """Heavy capture passes at >= 0.5 x vanilla end to end, or, where keeping half of vanilla's pace
    would need more than the measured pinned D2H bandwidth, at >= 70% of that bandwidth."""
    ratio = agg.get("ratio_e2e")
    demand = (agg["bytes_per_token"] * base_tok_s * HEAVY_RATIO / 1e9) if base_tok_s else None
    link_bound = bool(link_gbps and demand and demand > link_gbps)
    passed = ratio is not None and ratio >= HEAVY_RATIO
    detail = f"needs {demand:.3g} GB/s at half vanilla pace" if demand else ""
    if link_bound:
        passed = passed or agg["gbps"] >= HEAVY_LINK_FRACTION * link_gbps
        detail += (f"; link-bound: {agg['gbps']:.1f} GB/s vs {HEAVY_LINK_FRACTION:.0%} of "
                   f"{link_gbps:.1f} GB/s pinned")
    bad = _incomplete(agg)
    return _line("heavy (all layers, all positions, fetched) >= 0.5 x vanilla or >= 70% of pinned D2H",
                 workload, ratio, HEAVY_RATIO, passed and not bad, "; ".join(x for x in (detail, bad) if x))


def evaluate(table: dict[str, dict[str, dict]], link_gbps: float | None) -> list[dict]:
    """Every check on every workload that has its scenarios (end-to-end tok/s: rows in hand)."""
    lines = []
    for workload, rows in table.items():
        for c in CHECKS:
            agg = rows.get(c.scenario)
            if agg is None:
                continue
            if c.against is None:
                value = agg.get("ratio_e2e")
            else:
                other = rows.get(c.against)
                if other is None or not other.get("tok_s_e2e"):
                    continue
                value = agg["tok_s_e2e"] / other["tok_s_e2e"]
            if value is None:
                continue
            bad = _incomplete(agg)
            detail = f"generate-only {agg['ratio']:.3f}" if c.against is None and agg.get("ratio") else ""
            paired = agg.get("ratio_paired_e2e") if c.against is None else None
            if paired and paired["ci95"]:
                lo, hi = paired["ci95"]
                detail += (f"; paired e2e {paired['value']:.3f}, 95% CI {lo:.3f}-{hi:.3f} over "
                           f"{paired['pairs']} reps")
            lines.append(_line(c.name, workload, value, c.threshold, value >= c.threshold and not bad,
                               "; ".join(x for x in (detail, bad) if x)))
        if "heavy" in rows:
            base = rows.get(BASELINE, {}).get("tok_s")
            lines.append(heavy_check(workload, rows["heavy"], base, link_gbps))
    return lines


def check_text(line: dict) -> str:
    value = "n/a" if line["value"] is None else f"{line['value']:.3f}"
    extra = f"  ({line['detail']})" if line["detail"] else ""
    return (f"{'PASS' if line['passed'] else 'FAIL'}  {line['workload']:<12} {line['check']}: "
            f"{value} (threshold {line['threshold']}){extra}")


# ---- files -----------------------------------------------------------------------------------

def _f(value, fmt="{:.3f}", scale=1.0):
    return "-" if value is None else fmt.format(value / scale)


def ratio_text(ratio: dict | None) -> str:
    """A ratio with its 95% interval (``geometric_mean_interval``), for a table cell."""
    if not ratio:
        return "-"
    ci = ratio["ci95"]
    return f"{ratio['value']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")


def paired_text(agg: dict) -> str:
    """The paired e2e ratio and its 95% interval, for a table cell."""
    return ratio_text(agg.get("ratio_paired_e2e"))


def _cpus(cpus: list[int] | None) -> str:
    """CPU ids as ranges: [0, 1, 2, 8] -> "0-2,8"; "-" when not pinned."""
    if not cpus:
        return "-"
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][-1] + 1:
            runs[-1].append(c)
        else:
            runs.append([c])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


# How an engine got its compiled model (run.engine_log_facts), in the engine table's words.
COMPILED_MODEL = {"compiled": "compiled in its process", "loaded": "loaded from the cache"}


def engine_rows(engines: dict[str, dict]) -> list[dict]:
    """Per engine: start-up, KV cache, capture buffers, GPU memory, and deltas to the baseline."""
    base = engines.get("vanilla-graph", {})
    out = []
    for name, e in engines.items():
        row = {"engine": name, **e}
        for key in ("kv_cache_tokens", "nvml_engine"):
            if e.get(key) is not None and base.get(key) is not None:
                row[f"{key}_vs_vanilla"] = e[key] - base[key]
        out.append(row)
    return out


def _speed_table(rows: dict[str, dict], field: str, prefix: str, title: str) -> list[str]:
    """Markdown lines of each scenario's ``field`` (a dict of median tok/s by a key), one column
    per key, or none when no scenario has it."""
    by = {name: a[field] for name, a in rows.items() if a.get(field)}
    if not by:
        return []
    order = list(rows)  # keys that are scenarios go in the table's order; others as first seen
    cols = sorted(dict.fromkeys(c for v in by.values() for c in v),
                  key=lambda c: order.index(c) if c in order else len(order))
    return ["", title, "", f"| scenario | {prefix}" + f" | {prefix}".join(cols) + " |",
            "|---|" + "---|" * len(cols),
            *(f"| {name} | " + " | ".join(_f(v.get(c), "{:.0f}") for c in cols) + " |"
              for name, v in by.items())]


# Threads in the table of CPU time by thread: the busiest, the rest summed.
THREAD_COLUMNS = 6


def _threads_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: each scenario's milliseconds per step on a CPU (and waiting for one) by
    thread, the busiest THREAD_COLUMNS threads over all scenarios, the others summed."""
    by = {name: a["threads_ms_per_step"] for name, a in rows.items() if a.get("threads_ms_per_step")}
    if not by:
        return []
    busiest = sorted({n for v in by.values() for n in v},
                     key=lambda n: -max(v.get(n, (0.0, 0.0))[0] for v in by.values()))
    cols, rest = busiest[:THREAD_COLUMNS], busiest[THREAD_COLUMNS:]

    def cell(spent) -> str:
        return f"{spent[0]:.3f} ({spent[1]:.3f})"

    lines = ["", "CPU ms per step by thread during the generate, on a CPU (waiting for one):", "",
             "| scenario | " + " | ".join(cols) + (" | other threads |" if rest else " |"),
             "|---|" + "---|" * (len(cols) + bool(rest))]
    for name, v in by.items():
        cells = [cell(v.get(c, (0.0, 0.0))) for c in cols]
        if rest:
            cells.append(cell([sum(v.get(n, (0.0, 0.0))[k] for n in rest) for k in (0, 1)]))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def split_texts(split: dict) -> list[str]:
    """An ``iteration_split`` as text: the iterations' ratio, the ms more outside them."""
    return [ratio_text(split["iterations"]), ms_text(split["outside_ms"])]


def _split_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: each scenario's engine iterations during the generate and the rest of it
    (medians), and against vanilla and idle rep by rep (``iteration_split``)."""
    if not any(a.get("iterations_s") is not None for a in rows.values()):
        return []
    againsts = [b for b in (BASELINE, IDLE) if any(b in a.get("split_vs", {}) for a in rows.values())]
    lines = ["", "The engine's iterations during the generate (`_process_engine_step`) and the rest "
             "of the generate (the outputs' way to the client, the engine between iterations), "
             "medians; against another scenario rep by rep: its iteration seconds over these "
             "(below 1: slower), and ms more outside:", "",
             "| scenario | iterations s | outside ms | "
             + " | ".join(f"iterations vs {b} | outside vs {b} ms" for b in againsts) + " |",
             "|---|---|---|" + "---|---|" * len(againsts)]
    for name, a in rows.items():
        cells = [_f(a.get("iterations_s"), "{:.4f}"), _f(a.get("outside_iterations_ms"), "{:.1f}")]
        for b in againsts:
            split = a.get("split_vs", {}).get(b)
            cells += split_texts(split) if split else ["-", "-"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _parts_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: each scenario's iterations by their place in the generate (medians),
    then the ms more than vanilla and idle in each place, rep by rep (``parts_against``)."""
    own = {name: a["iteration_parts"] for name, a in rows.items() if a.get("iteration_parts")}
    if not own:
        return []
    early, tail = f"iterations 1-{EARLY_ITERATIONS}", f"last {TAIL_ITERATIONS}"
    lines = ["", "The engine's iterations by their place in the generate (ms: the first, the next "
             f"{EARLY_ITERATIONS}, the steady ones between, the last {TAIL_ITERATIONS}, and the "
             "steady ones' median iteration; medians over generates):", "",
             f"| scenario | generates | first | {early} | steady (count) | {tail} | steady iteration |",
             "|---|---|---|---|---|---|---|"]
    for name, p in own.items():
        lines.append(f"| {name} | {p['generates']} | {p['head']:.2f} | {p['early']:.2f} | "
                     f"{p['steady']:.1f} ({p['steady_count']:.0f}) | {p['tail']:.2f} | "
                     f"{p['steady_iteration']:.3f} |")
    deltas = [(name, against, d) for name, a in rows.items()
              for against, d in (a.get("parts_vs") or {}).items()]
    if deltas:
        lines += ["", "The same, ms more than another scenario rep by rep (mean, 95% interval):", "",
                  f"| scenario | against | reps | first | {early} | steady | {tail} | steady iteration |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, against, d in deltas:
            cells = [ms_text(d[part], "{:+.3f}" if part == "steady_iteration" else "{:+.2f}")
                     for part in ITERATION_PARTS]
            lines.append(f"| {name} | {against} | {d['reps']} | " + " | ".join(cells) + " |")
    return lines


def _head_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: each generate's first engine iteration (the prefill's schedule and
    launch) by scenario and by the scenario before it, with the garbage collection and the
    caching allocator's calls in it; the engine's collections over whole generates; then its
    allocator calls from one head to the next, by the first's scenario."""
    heads = {name: a["head"] for name, a in rows.items() if a.get("head")}
    if not heads:
        return []
    labels = list(ALLOCATOR_NAMES.values())
    lines = ["", "Each generate's first engine iteration (ms, the engine thread's and the engine "
             "process's CPU ms: medians; garbage collection ms, the thread's minor page faults "
             "and involuntary context switches, and torch's caching allocator's calls in it: "
             "means):", "",
             "| scenario | after | generates | ms | CPU ms | process CPU ms | GC ms | faults "
             "| preempted | " + " | ".join(labels) + " |",
             "|---|---|---|---|---|---|---|---|---|" + "---|" * len(labels)]
    for name, head in heads.items():
        for after, group in [("all", head), *head["by_after"].items()]:
            lines.append(f"| {name} | {after} | {group['generates']} | {_f(group['ms'], '{:.1f}')} "
                         f"| {_f(group['cpu_ms'], '{:.1f}')} "
                         f"| {_f(group['process_cpu_ms'], '{:.1f}')} "
                         f"| {_f(group['gc_ms'], '{:.1f}')} "
                         f"| {_f(group['minor_faults'], '{:.0f}')} "
                         f"| {_f(group['involuntary_switches'], '{:.1f}')} | "
                         + " | ".join(_f(group["allocator"][n], "{:.1f}") for n in ALLOCATOR_NAMES)
                         + " |")
    collected = [(name, head) for name, head in heads.items()
                 if head.get("generate_gc_ms") is not None]
    if collected:
        lines += ["", "The engine's garbage collections over the whole generate (means): "
                  + "; ".join(f"{name} {head['generate_gc_ms']:.1f} ms, "
                              f"{head['generate_gc_full']:.2f} full" for name, head in collected)
                  + "."]
    since: dict = {}  # the engine's previous scenario -> its groups, from every scenario's rows
    for head in heads.values():
        for prev, counts in head["since_by_previous"].items():
            since.setdefault(prev, []).append(counts)
    if since:
        lines += ["", "The engine's allocator calls from a generate's first iteration to the next "
                  "generate's on that engine (the rest of the generate, its drains, fetch and "
                  "stream switches), by the first generate's scenario (mean):", "",
                  "| generate | pairs | " + " | ".join(labels) + " |",
                  "|---|---|" + "---|" * len(labels)]
        for prev, groups in since.items():
            pooled = _pooled_means(groups)
            lines.append(f"| {prev} | {pooled['generates']} | "
                         + " | ".join(_f(pooled[n], "{:.1f}") for n in ALLOCATOR_NAMES) + " |")
    return lines


def _gpu_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: what the GPU ran at during each scenario's generates (NVML)."""
    shown = {name: a["gpu"] for name, a in rows.items() if a.get("gpu")}
    if not shown:
        return []
    lines = ["", "The GPU during the generate (NVML, read every 0.1 s; medians over the readings "
             "and the reps; clock event reasons: the bits seen in any reading):", "",
             "| scenario | SM MHz | memory MHz | W | C | GPU util % | memory util % "
             "| PCIe rx MB/s | PCIe tx MB/s | clock event reasons |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, g in shown.items():
        cells = [_f(g.get(k), "{:.0f}") for k in GPU_FIELDS]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {g['clock_reasons']:#x} |")
    return lines


def _replays_table(rows: dict[str, dict]) -> list[str]:
    """Markdown lines: each capture scenario's graph replays and eager capture forwards a
    generate, the graph launches from a copy without idle sites' capture nodes, and the idle
    sites' nodes that launches by torch ran."""
    shown = {name: a for name, a in rows.items() if a.get("graph_replays") is not None}
    if not shown:
        return []
    lines = ["", "A generate on the capture engine (rank 0): graph replays (forwards under a "
             "graph), graph launches from a copy without idle sites' capture nodes (a piecewise "
             "forward launches one graph per piece, so these can outnumber the forwards), the "
             "idle sites' nodes that launches by torch ran (GPU work for nothing), and eager "
             "capture forwards:", "",
             "| scenario | graph replays | launches from a copy | idle nodes run | eager forwards |",
             "|---|---|---|---|---|"]
    for name, a in shown.items():
        cells = [_f(a.get(k), "{:.0f}") for k in
                 ("graph_replays", "copy_replays", "idle_nodes_replayed", "eager_forwards")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _startup_parts(parts: dict | None) -> str:
    """``run.py``'s ``capture_startup_ms`` of an engine, part by part ("-" for none: vanilla, or
    a run from before session 67)."""
    if not parts:
        return "-"
    return ", ".join(f"{name} {_f(ms, '{:.0f}')}" for name, ms in parts.items())


def markdown(report: dict) -> str:
    env, lines = report.get("env", {}), []
    lines.append(f"# vllm-capture benchmark: suite `{report['suite']}`, model {report['model_label']}")
    lines.append("")
    lines.append(f"- date: {report['date']}; command: `{env.get('command', '')}`")
    lines.append(f"- GPU: {env.get('gpu') or 'none'}; driver {env.get('driver') or '-'}; "
                 f"versions: {env.get('versions', {})}")
    d2h = report.get("d2h") or {}
    lines.append(f"- pinned D2H bandwidth (this machine, this run): {_f(d2h.get('pinned_gbps'), '{:.1f}')} GB/s "
                 f"(by size MiB: {d2h.get('by_size_gbps', {})}); pageable {_f(d2h.get('pageable_gbps'), '{:.1f}')} GB/s")
    block = report.get("block", 1)
    reps = (f"the generates of {report.get('reps')} reps, each scenario {block} in a row"
            if block > 1 else f"{report.get('reps')} reps")
    lines.append(f"- medians of {reps}; ratios are to `vanilla` (CUDA graphs) of the "
                 "same workload; e2e = generate + fetch_captured (rows in the client's hands); "
                 "vs idle = to `idle` on the same capture engine (capture's own cost); best ratio = "
                 "fastest rep to vanilla's fastest (single generates are bimodal on the H200 host); "
                 "paired e2e = geometric mean over reps of each rep's e2e tok/s to vanilla's "
                 "generate of the same rep, with its 95% confidence interval")
    if report.get("dry_run"):
        lines.append("- **dry run on CPU: every engine runs eagerly; thresholds are not meaningful**")
    if report.get("baseline_first"):
        lines.append("- **started with the baseline first** (`--baseline-first`): side by side, "
                     "vanilla started before the capture engine, the control (if any) last; the "
                     "engine table lists the engines in start order")
    if report.get("warm_cache"):
        warmed = "; ".join(f"{e} (init {_f(w.get('init_s'), '{:.0f}')} s, {w.get('compiled_model') or '-'}"
                           f"{', ' + w['error'][:80] if w.get('error') else ''})"
                           for e, w in report["warm_cache"].items())
        lines.append(f"- **compile cache warmed first** (`--warm-cache`): {warmed} started and "
                     "stopped before the engines below, so that each of them could load its "
                     "compiled model (the engine table says whether it did)")
    for workload, rows in report["table"].items():
        lines.append("")
        lines.append(f"## {workload}")
        lines.append("")
        lines.append("| scenario | engine | tok/s | ratio | best ratio | tok/s e2e | ratio e2e "
                     "| paired e2e (95% CI) | vs idle (e2e) | fetch s "
                     "| fetch in worker ms (finalize/drain/wait/serialize/write) "
                     "| rows/s | GB/s | B/token | rows (expected) | dropped "
                     "| host ms/step (a repeated step's begin; harvest; its copy waits) "
                     "| client peak RSS GiB | engine peak RSS GiB |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for name, a in rows.items():
            expected = a.get("rows_expected")
            rows_txt = f"{a['rows']:.0f}" + (f" ({expected})" if expected is not None else "")
            if not a.get("complete", True):
                rows_txt += " INCOMPLETE"
            lines.append(
                f"| {name} | {a['engine']} | {_f(a['tok_s'], '{:.0f}')} | {_f(a['ratio'])} "
                f"| {_f(a.get('ratio_best'))} "
                f"| {_f(a['tok_s_e2e'], '{:.0f}')} | {_f(a['ratio_e2e'])} | {paired_text(a)} "
                f"| {_f(a.get('ratio_idle'))} ({_f(a.get('ratio_idle_e2e'))}) | {_f(a['fetch_s'])} "
                f"| {'/'.join(_f(a.get(f'fetch_{k}_ms'), '{:.0f}') for k in FETCH_STAGES)} "
                f"| {_f(a['rows_s'], '{:.3g}')} | {_f(a['gbps'], '{:.2f}')} | {_f(a['bytes_per_token'], '{:.0f}')} "
                f"| {rows_txt} | {a['dropped']} "
                f"| {_f(a.get('host_ms_per_step'), '{:.3f}')} ({_f(a.get('repeat_ms_per_step'), '{:.3f}')}"
                f"; {_f(a.get('harvest_ms_per_step'), '{:.3f}')}"
                f"; {_f(a.get('harvest_sync_ms_per_step'), '{:.3f}')}) "
                f"| {_f(a['client_peak_rss'], '{:.2f}', GIB)} "
                f"| {_f(a['engine_peak_rss'], '{:.2f}', GIB)} |")
        lines += _speed_table(
            rows, "tok_s_by_cpus", "",
            "Median generate tok/s by the CPUs the engine ran on (engines move one group every two reps):")
        lines += _speed_table(
            rows, "tok_s_by_after", "after ",
            "Median generate tok/s by the scenario that ran just before (a capture's fetch can "
            "slow the next generate, on any engine):")
        lines += _threads_table(rows)
        lines += _split_table(rows)
        lines += _parts_table(rows)
        lines += _head_table(rows)
        lines += _gpu_table(rows)
        lines += _replays_table(rows)
    lines.append("")
    lines.append("## Engines")
    lines.append("")
    lines.append("| engine | init s | capture's parts of it, ms | KV cache tokens (vs vanilla) "
                 "| capture buffers GiB (status) "
                 "| GPU GiB the engine took (NVML, vs vanilla) | side by side with "
                 "| CPUs, rotating among engines (client's) | compiled model "
                 "| error |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for e in engine_rows(report.get("engines", {})):
        def delta(key, scale=1.0, fmt="{:+.2f}"):
            d = e.get(f"{key}_vs_vanilla")
            return "" if d is None or e["engine"] == "vanilla-graph" else f" ({fmt.format(d / scale)})"
        lines.append(
            f"| {e['engine']} | {_f(e.get('init_s'), '{:.0f}')} "
            f"| {_startup_parts(e.get('capture_startup_ms'))} "
            f"| {_f(e.get('kv_cache_tokens'), '{:,.0f}')}{delta('kv_cache_tokens', 1.0, '{:+,.0f}')} "
            f"| {_f(e.get('capture_allocation_bytes'), '{:.3f}', GIB)} "
            f"| {_f(e.get('nvml_engine'), '{:.2f}', GIB)}{delta('nvml_engine', GIB)} "
            f"| {', '.join(e.get('side_by_side_with') or []) or '-'} "
            f"| {_cpus(e.get('cpus'))} ({_cpus(e.get('client_cpus'))}) "
            f"| {COMPILED_MODEL.get(e.get('compiled_model'), '-')} "
            f"| {(e.get('error') or '')[:120]} |")
    lines.append("")
    lines.append("## Checks")
    lines.append("")
    checks = report.get("checks") or []
    lines.extend(f"- {check_text(c)}" for c in checks)
    if not checks:
        lines.append("- none evaluated")
    if report.get("skipped"):
        lines.append("")
        lines.append("## Skipped")
        lines.append("")
        lines.extend(f"- {s['engine']} / {s['workload']} / {s['scenario']}: {s['reason']}"
                     for s in report["skipped"])
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Bar chart of end-to-end tok/s ratio to vanilla per scenario, one bar per workload."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    table = report["table"]
    workloads = list(table)
    scenarios = []
    for rows in table.values():
        scenarios += [s for s in rows if s not in scenarios]
    if not scenarios:
        return False
    width = 0.8 / max(1, len(workloads))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(scenarios) + 2), 4.5))
    for i, w in enumerate(workloads):
        xs = [j + (i - (len(workloads) - 1) / 2) * width for j in range(len(scenarios))]
        ys = [(table[w].get(s) or {}).get("ratio_e2e") or 0.0 for s in scenarios]
        ax.bar(xs, ys, width=width, label=w)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(scenarios)))
    ax.set_xticklabels(scenarios, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("tok/s ratio to vanilla (generate + fetch)")
    ax.set_title(f"vllm-capture {report['suite']}: {report['model_label']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


REPORT_FILES = ("results.json", "results.md", "tok_s_ratio.png", "engines.log")


def load(run: Path | str) -> dict:
    """A run's report: ``run`` is its folder or its JSON file. Committed folders hold the JSON
    gzipped (``results.json.gz``: a run's per-rep records are most of a folder's bytes, and every
    H200 call carries the tree); a fresh run's folder holds it plain."""
    path = Path(run)
    if path.is_dir():
        plain = path / "results.json"
        path = plain if plain.exists() else path / "results.json.gz"
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def write(report: dict, out_dir: Path) -> list[Path]:
    """Write the JSON, the markdown and the plot into ``out_dir``; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "results.md"]
    paths[0].write_text(json.dumps(report, indent=1, default=str))
    paths[1].write_text(markdown(report))
    png = out_dir / "tok_s_ratio.png"
    if plot(report, png):
        paths.append(png)
    return paths
