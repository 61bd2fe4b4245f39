#!/usr/bin/env python3
"""A run's generates in the order they ran, one line each, beside what the GPU ran at.

    python3 benchmarks/sequence.py benchmarks/results/20261202-055704-full-8b [--workload W]
    python3 benchmarks/sequence.py --by-predecessor idle benchmarks/results/*-full-8b

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
"""

from __future__ import annotations

import argparse
import json
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


def _groups_text(groups: dict[str, list[float]]) -> str:
    return "; ".join(f"{k} {len(v)}x {R._median(v):.3f} ({min(v):.3f}-{max(v):.3f})"
                     for k, v in sorted(groups.items())) or "-"


def _measurements(run: str) -> list[dict]:
    path = Path(run)
    report = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    return report["measurements"]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+",
                   help="run folders (results.json inside) or results.json files")
    p.add_argument("--workload", help="default: the first workload measured")
    p.add_argument("--by-predecessor", metavar="SCENARIO",
                   help="instead of the generates in order: SCENARIO's (e.g. idle) by what ran "
                        "just before it, per run and pooled")
    args = p.parse_args()
    if args.by_predecessor and args.by_predecessor not in S.SCENARIOS:
        p.error(f"--by-predecessor: {args.by_predecessor} is not a scenario "
                f"({', '.join(S.SCENARIOS)})")
    if args.by_predecessor:
        print("\n".join(predecessor_lines({r: _measurements(r) for r in args.runs},
                                           args.by_predecessor)))
        return 0
    for run in args.runs:
        print("\n".join(sequence_lines(_measurements(run), args.workload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
