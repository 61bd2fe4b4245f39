#!/usr/bin/env python3
"""A run's generates in the order they ran, one line each, beside what the GPU ran at.

    python3 benchmarks/sequence.py benchmarks/results/20261202-055704-full-8b [--workload W]

Why: medians hide a state an engine enters mid-run. On the H200 the 8B's idle engine ran at
vanilla's speed until its first full hidden-4l, then about 2.5% slower for the rest of the run
(sessions 23-24); only the generates in order showed it. Each line: the generate's place,
scenario, rep, the CPUs its engine ran on, tok/s and its ratio to the median of the baseline's
generates in the run, the graph launches from a copy and the idle capture nodes run (capture
engines), the engine's decode graph replayed alone after it (GPU us a replay, with
``run.py --probe-graphs``), and the NVML readings of the generate where the run has them (SM MHz,
W, PCIe rx/tx MB/s, clock event reasons).
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
from benchmarks.scenarios import BASELINE  # noqa: E402


def sequence_lines(measurements: list[dict], workload: str | None = None) -> list[str]:
    """One line per generate of ``workload`` (the first workload measured when None), in run
    order."""
    if not measurements:
        return []
    workload = workload or measurements[0]["workload"]
    ms = [m for m in measurements if m["workload"] == workload]
    base = R._median([m["generated_tokens"] / m["gen_s"] for m in ms if m["scenario"] == BASELINE])
    lines = [f"{workload}: generates in run order; ratio to {BASELINE}'s median "
             f"({R._f(base, '{:.0f}')} tok/s)",
             f"{'#':>3} {'scenario':<16} {'rep':>3} {'cpus':<7} {'tok/s':>7} {'ratio':>6} "
             f"{'copies':>6} {'idle n':>6} {'graph us':>8} {'SM MHz':>6} {'W':>4} {'rx MB/s':>7} {'tx MB/s':>7} "
             "reasons"]
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


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run", help="a run folder (results.json inside) or its results.json")
    p.add_argument("--workload", help="default: the first workload measured")
    args = p.parse_args()
    path = Path(args.run)
    report = json.loads((path / "results.json" if path.is_dir() else path).read_text())
    print("\n".join(sequence_lines(report["measurements"], args.workload)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
