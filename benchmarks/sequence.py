#!/usr/bin/env python3
"""A run's generates in the order they ran, one line each, beside what the GPU ran at.

    python3 benchmarks/sequence.py benchmarks/results/20261202-055704-full-8b [--workload W]
    python3 benchmarks/sequence.py --by-predecessor idle benchmarks/results/*-full-8b
    python3 benchmarks/sequence.py --own-and-after hidden-last benchmarks/results/*-quick-1b

Why: medians hide a state an engine enters mid-run. On the H200 the 8B's idle engine ran at
vanilla's speed until its first full hidden-4l, then about 2.5% slower for the rest of the run
(sessions 23-24); only the generates in order showed it. Each line: the generate's place,
scenario, rep, the CPUs its engine ran on, tok/s and its ratio to the median of the baseline's
generates in the run, the graph launches from a copy and the idle capture nodes run (capture
engines), the engine's decode graph replayed alone after it (GPU us a replay, with
``run.py --probe-graphs``), and the NVML readings of the generate where the run has them (SM MHz,
W, PCIe rx/tx MB/s, clock event reasons).

``--by-predecessor SCENARIO`` groups a scenario's generates by what ran just before each: nothing
measured (``first``), its own engine's generate (``own``) or another engine's (``other``),
``+rows`` once its engine had run a capture of every position. Over every 8B run kept
(2026-11-30 to 2026-12-02, read in session 25), idle ran at 0.976 of vanilla as ``own+rows`` (62
generates, none above 0.985) and at 0.996-1.001 (medians) in every other group.

``--own-and-after SCENARIO`` fits, run by run, what SCENARIO costs its own generates against
idle's and what it costs the generate after each of its, each generate's rep taken as its own
level. Over the 1B's runs of sessions 17-29 (read in session 29): a last-token capture +4.0% to
its own generates, +0.3% to the next.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report as R  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402


def _of_workload(measurements: list[dict], workload: str | None):
    """``workload`` (the first measured when None), its generates in run order, and the median
    tok/s of its baseline's."""
    workload = workload or measurements[0]["workload"]
    ms = [m for m in measurements if m["workload"] == workload]
    return workload, ms, R._median([m["generated_tokens"] / m["gen_s"] for m in ms
                                    if m["scenario"] == S.BASELINE])


def sequence_lines(measurements: list[dict], workload: str | None = None) -> list[str]:
    """One line per generate of ``workload`` (the first workload measured when None), in run
    order."""
    if not measurements:
        return []
    workload, ms, base = _of_workload(measurements, workload)
    lines = [f"{workload}: generates in run order; ratio to {S.BASELINE}'s median "
             f"({R._f(base, '{:.0f}')} tok/s)",
             f"{'#':>3} {'scenario':<16} {'rep':>3} {'cpus':<7} {'tok/s':>7} {'ratio':>6} "
             f"{'copies':>6} {'idle n':>6} {'graph us':>8} {'SM MHz':>6} {'W':>4} "
             f"{'rx MB/s':>7} {'tx MB/s':>7} reasons"]
    for i, m in enumerate(ms):
        tok_s = m["generated_tokens"] / m["gen_s"]
        gpu = m.get("gpu") or {}
        cpus = m.get("cpus")
        # run.py --probe-graphs: the engine's decode graph replayed alone after this generate.
        graph = ((m.get("graph_probe") or {}).get("graph") or {}).get("gpu_us")
        lines.append(
            f"{i:>3} {m['scenario']:<16} {m.get('rep', 0):>3} "
            f"{(f'{min(cpus)}-{max(cpus)}' if cpus else '-'):<7} {tok_s:>7.0f} "
            f"{R._f(tok_s / base if base else None):>6} "
            f"{R._f(m.get('copy_replays'), '{:.0f}'):>6} "
            f"{R._f(m.get('idle_nodes_replayed'), '{:.0f}'):>6} "
            f"{R._f(graph, '{:.1f}'):>8} "
            f"{R._f(gpu.get('sm_mhz'), '{:.0f}'):>6} {R._f(gpu.get('power_w'), '{:.0f}'):>4} "
            f"{R._f(gpu.get('pcie_rx_mb_s'), '{:.0f}'):>7} "
            f"{R._f(gpu.get('pcie_tx_mb_s'), '{:.0f}'):>7} "
            + (f"{gpu['clock_reasons']:#x}" if gpu else "-"))
    return lines


def by_predecessor(measurements: list[dict], scenario: str = "idle",
                   workload: str | None = None) -> dict[str, list[float]]:
    """``scenario``'s generates of ``workload`` (the first measured when None), each as its ratio
    to the run's baseline median, grouped by what ran just before it: ``first`` (nothing
    measured), ``own`` (a generate of its own engine) or ``other`` (another engine's), with
    ``+rows`` once its engine had run a capture of every position (a rows capture, reduce
    ``all``) before it. Sessions 20-25: the 8B's idle ran slow as ``own+rows`` only."""
    if not measurements:
        return {}
    _, ms, base = _of_workload(measurements, workload)
    groups: dict[str, list[float]] = {}
    ran_rows: set[str] = set()  # engines that have run a rows capture
    for i, m in enumerate(ms):
        if m["scenario"] == scenario and base:
            key = ("first" if i == 0 else "own" if ms[i - 1]["engine"] == m["engine"] else "other")
            if i and m["engine"] in ran_rows:
                key += "+rows"
            groups.setdefault(key, []).append(m["generated_tokens"] / m["gen_s"] / base)
        cap = S.SCENARIOS[m["scenario"]].capture if m["scenario"] in S.SCENARIOS else None
        if cap is not None and cap.reduce == "all":
            ran_rows.add(m["engine"])
    return groups


def predecessor_lines(runs: dict[str, list[dict]], scenario: str = "idle") -> list[str]:
    """``by_predecessor`` of each run (name -> measurements), one line each (generates, median,
    range by group), then every run's generates pooled."""
    pooled: dict[str, list[float]] = {}
    lines = [f"{scenario}'s ratio to the baseline's median, by what ran just before it"]
    for name, measurements in runs.items():
        groups = by_predecessor(measurements, scenario)
        for key, ratios in groups.items():
            pooled.setdefault(key, []).extend(ratios)
        lines.append(f"{name}: " + _groups_text(groups))
    lines.append("pooled: " + _groups_text(pooled))
    return lines


def own_and_after(measurements: list[dict], scenario: str, against: str = "idle",
                  workload: str | None = None) -> dict[str, dict] | None:
    """What ``scenario`` costs its own generates against ``against``'s, and the generate after
    each of its: least squares of every generate's log seconds (of ``workload``, the first
    measured when None) on its rep (each rep its own level: the host's drift), its scenario
    (each its own level, ``against``'s the reference) and whether the generate before it was
    ``scenario``'s. Each cost as a fraction of a generate's time, with its 95% interval
    (normal); None where they cannot be told apart (a rep's generates all after the same kind,
    say) or either scenario is missing."""
    import numpy as np

    if not measurements:
        return None
    workload = workload or measurements[0]["workload"]
    ms = [m for m in measurements if m["workload"] == workload]
    names = {m["scenario"] for m in ms}
    if scenario not in names or against not in names:
        return None
    reps = sorted({m["rep"] for m in ms})
    others = sorted(names - {against, scenario})
    rows, seconds = [], []
    for i, m in enumerate(ms[1:], 1):
        rows.append([float(m["rep"] == r) for r in reps]
                    + [float(m["scenario"] == o) for o in others]
                    + [float(m["scenario"] == scenario), float(ms[i - 1]["scenario"] == scenario)])
        seconds.append(np.log(m["gen_s"]))
    x, y = np.array(rows), np.array(seconds)
    if len(y) <= x.shape[1] or np.linalg.matrix_rank(x) < x.shape[1]:
        return None
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    cov = resid @ resid / (len(y) - x.shape[1]) * np.linalg.inv(x.T @ x)
    out = {}
    for name, k in (("own", -2), ("after", -1)):
        half = 1.96 * float(np.sqrt(cov[k, k]))
        out[name] = {"cost": float(np.expm1(coef[k])),
                     "ci95": [float(np.expm1(coef[k] - half)), float(np.expm1(coef[k] + half))]}
    out["generates"] = len(y)
    return out


def own_and_after_lines(runs: dict[str, list[dict]], scenario: str) -> list[str]:
    """``own_and_after`` of each run, one line each, then the mean of the runs' estimates."""
    lines = [f"{scenario}: its own generates' cost against idle's, and the next generate's, "
             f"a run at a time"]
    found = []
    for name, measurements in runs.items():
        fit = own_and_after(measurements, scenario)
        if fit is None:
            lines.append(f"{name}: -")
            continue
        found.append(fit)
        lines.append(f"{name}: " + "; ".join(
            f"{k} {fit[k]['cost']:+.1%} ({fit[k]['ci95'][0]:+.1%} to {fit[k]['ci95'][1]:+.1%})"
            for k in ("own", "after")) + f"; {fit['generates']} generates")
    if found:
        lines.append(f"mean of {len(found)} runs: " + "; ".join(
            f"{k} {sum(f[k]['cost'] for f in found) / len(found):+.1%}" for k in ("own", "after")))
    return lines


def _groups_text(groups: dict[str, list[float]]) -> str:
    return "; ".join(f"{k} {len(v)}x {R._median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                     for k, v in sorted(groups.items())) or "-"


def _measurements(run: str) -> list[dict]:
    return R.load(run)["measurements"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+",
                   help="run folders (results.json[.gz] inside) or such files")
    p.add_argument("--workload", help="default: the first workload measured")
    p.add_argument("--by-predecessor", metavar="SCENARIO",
                   help="instead of the generates in order: SCENARIO's (e.g. idle) by what ran "
                        "just before it, per run and pooled")
    p.add_argument("--own-and-after", metavar="SCENARIO",
                   help="instead: SCENARIO's cost to its own generates (against idle's) and "
                        "to the generate after each (a regression on rep, scenario and the "
                        "scenario before), per run")
    args = p.parse_args()
    for flag in ("by_predecessor", "own_and_after"):
        value = getattr(args, flag)
        if value and value not in S.SCENARIOS:
            p.error(f"--{flag.replace('_', '-')}: {value} is not a scenario "
                    f"({', '.join(S.SCENARIOS)})")
    if args.own_and_after:
        print("\n".join(own_and_after_lines({r: _measurements(r) for r in args.runs},
                                             args.own_and_after)))
        return 0
    if args.by_predecessor:
        print("\n".join(predecessor_lines({r: _measurements(r) for r in args.runs},
                                           args.by_predecessor)))
        return 0
    for run in args.runs:
        print("\n".join(sequence_lines(_measurements(run), args.workload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
