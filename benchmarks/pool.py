#!/usr/bin/env python3
"""Runs of one suite pooled: each scenario's paired e2e ratio over the reps of every run, and
over the runs.

    python3 benchmarks/pool.py benchmarks/results/20261201-152532-quick-1b \\
        benchmarks/results/20261201-153605-quick-1b benchmarks/results/20261201-154321-quick-1b

A rep pairs only with the baseline's rep of the same run (``report.paired_ratio``). Pooled over
reps, the interval counts generates. Over runs, it is the geometric mean of the runs' paired
ratios with a t interval over runs: it counts engine starts, which is what a run-to-run shift
(engine placement, start order, the host) needs. Both are printed, with each run's figure; the
1B's idle engine moved from 0.916 to 1.024 between runs whose rep intervals were half as wide.
Each scenario is given against ``vanilla`` and, for a capture engine's scenario, against ``idle``
on the same engine. The next two columns pool the reps that ran the scenarios in the order given
(even reps) and reversed (odd reps) apart, over the runs started in the default engine order
(``--baseline-first`` moves the baseline to the front of the order given, so its reps say
something else): a generate can run faster or slower for what ran just before it, which the
alternation evens out in the pooled figure but these columns show (the 1B's idle against vanilla,
over nine runs: 1.006 forward, 0.948 reversed).

A row "host / cpu" names each run's CPUs and GPU where its ``results.json`` records them
(``env.cpu``, since session 30; ``env.gpu``): the 1B's capture cost moved by several percent from
machine to machine. Runs on different GPUs are not pooled (the H100's and the H200's CPUs can
read alike).

Where runs split each generate into the engine's iterations and the rest (``run.py``'s
``engine_iterations_s``, since session 31), a second table pools that split over their reps
(``report.iteration_split``): whether a scenario's cost against another lies in the engine's
iterations or outside them. Where runs kept every iteration (``engine_iteration_ms``, since
session 33), a third pools the iterations' time by place (``report.parts_against``: the first,
1-4, the steady ones, the last 4): one run's steady part spans 0 within its interval, where a
cost of 0.1 ms an iteration is 1% of the 1B's generate.

Where the runs were started in both engine orders (``run.py --baseline-first`` for some), three
more columns pool each order's reps apart and weigh the two orders equally: the engine started
later read faster in either order (session 21: idle 0.983 of vanilla started last, 1.028 of
vanilla started first), so a figure over runs mostly of one order carries that order's edge.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report as R  # noqa: E402
from benchmarks.scenarios import BASELINE, IDLE  # noqa: E402


def pool(reports: list[dict], workload: str, scenario: str, against: str) -> dict | None:
    """``{"runs": [paired ratio of each run, or None], "over_reps": ..., "over_runs": ...}``
    (``report.geometric_mean_interval`` dicts for the last two); None when no run has both."""
    per_run, base_all, own_all = [], [], []
    by_order: dict[bool, tuple[list[dict], list[dict]]] = {}
    for i, rep in enumerate(reports):
        ms = [m for m in rep["measurements"] if m.get("workload") == workload]
        # Reps pair within their run only: the rep key names the run too.
        base = [{**m, "rep": (i, m["rep"])} for m in ms if m["scenario"] == against]
        own = [{**m, "rep": (i, m["rep"])} for m in ms if m["scenario"] == scenario]
        paired = R.paired_ratio(base, own) if base and own else None
        per_run.append(paired["value"] if paired else None)
        if paired:
            base_all += base
            own_all += own
            order = by_order.setdefault(bool(rep.get("baseline_first")), ([], []))
            order[0].extend(base)
            order[1].extend(own)
    values = [v for v in per_run if v is not None]
    if not values:
        return None

    default_order = by_order.get(False, ([], []))

    def in_order(ms: list[dict], parity: int) -> list[dict]:
        return [m for m in ms if m["rep"][1] % 2 == parity]

    orders = {first: R.paired_ratio(*pair) for first, pair in by_order.items()}
    return {"runs": per_run, "over_reps": R.paired_ratio(base_all, own_all),
            "over_runs": R.geometric_mean_interval([math.log(v) for v in values]),
            # Over reps, each start order apart, and the two weighed equally (None unless both).
            "default_order": orders.get(False), "baseline_first": orders.get(True),
            "both_orders": equal_weight(orders[False], orders[True]) if len(orders) == 2 else None,
            # run.py lists a rep's scenarios as given in even reps and reversed in odd ones (the
            # default engine order's runs only).
            "forward": R.paired_ratio(*(in_order(ms, 0) for ms in default_order)),
            "reversed": R.paired_ratio(*(in_order(ms, 1) for ms in default_order)),
            # Over the reps whose runs split each generate (``report.iteration_split``), and
            # whose runs kept every iteration (``report.parts_against``, in ms).
            "split": R.iteration_split(base_all, own_all),
            "parts": R.parts_against(base_all, own_all)}


def equal_weight(a: dict, b: dict) -> dict:
    """The geometric mean of two independent estimates (``report.paired_ratio`` dicts), with a
    95% interval whose half-width on the log scale is half the root sum of squares of theirs."""
    value = math.sqrt(a["value"] * b["value"])
    if not (a["ci95"] and b["ci95"]):
        return {"value": value, "ci95": None, "pairs": a["pairs"] + b["pairs"]}
    half = math.hypot(*(math.log(x["ci95"][1] / x["ci95"][0]) / 2 for x in (a, b))) / 2
    return {"value": value, "ci95": [value * math.exp(-half), value * math.exp(half)],
            "pairs": a["pairs"] + b["pairs"]}


def _interval_text(x: dict | None) -> str:
    return "-" if x is None else f"{R.ratio_text(x)}, {x['pairs']}"


ORDER_COLUMNS = ("default_order", "baseline_first", "both_orders")


def host_text(report: dict) -> str:
    """A run's CPUs and GPU in a table cell (``env.cpu``, ``host_cpu.describe``; ``env.gpu``),
    or "-"."""
    env = report.get("env") or {}
    cpu = env.get("cpu") or {}
    parts = []
    if cpu.get("model"):
        ident = "/".join(cpu[k] for k in ("family", "model_number", "stepping") if cpu.get(k))
        mhz = (cpu.get("mhz") or {}).get("mean")
        parts.append(cpu["model"] + (f" {ident}" if ident else "") + (f", {mhz} MHz" if mhz else ""))
    if env.get("gpu"):
        parts.append(env["gpu"])
    return "; ".join(parts) or "-"


def markdown(reports: list[dict], names: list[str]) -> str:
    both = len({bool(r.get("baseline_first")) for r in reports}) == 2
    extra = (" | capture started first (over reps) | baseline started first (over reps) "
             "| both orders, equal weight" if both else "")
    lines = ["| workload | scenario | against | " + " | ".join(names)
             + " | over reps (95% CI), reps | over runs (95% CI), runs | forward reps | reversed reps"
             + extra + " |",
             "|---|---|---|" + "---|" * len(names) + "---|---|---|---|" + "---|" * (3 * both)]
    splits: list[str] = []
    places: list[str] = []
    if any(host_text(r) != "-" for r in reports):
        lines.append("| host | cpu, gpu | - | " + " | ".join(host_text(r) for r in reports)
                     + " | - | - | - | -" + " | -" * (3 * both) + " |")
    for workload in dict.fromkeys(m["workload"] for r in reports for m in r["measurements"]):
        scenarios = dict.fromkeys(m["scenario"] for r in reports for m in r["measurements"]
                                  if m["workload"] == workload)
        idle_engine = next((m["engine"] for r in reports for m in r["measurements"]
                            if m["workload"] == workload and m["scenario"] == IDLE), None)
        for scenario in scenarios:
            engine = next(m["engine"] for r in reports for m in r["measurements"]
                          if m["workload"] == workload and m["scenario"] == scenario)
            for against in (BASELINE, IDLE):
                if scenario == against or (against == IDLE and engine != idle_engine):
                    continue
                p = pool(reports, workload, scenario, against)
                if p is None:
                    continue
                runs = " | ".join("-" if v is None else f"{v:.3f}" for v in p["runs"])
                orders = "".join(f" | {_interval_text(p[k])}" for k in ORDER_COLUMNS) if both else ""
                lines.append(f"| {workload} | {scenario} | {against} | {runs} "
                             f"| {_interval_text(p['over_reps'])} | {_interval_text(p['over_runs'])} "
                             f"| {_interval_text(p['forward'])} | {_interval_text(p['reversed'])}"
                             f"{orders} |")
                if p["split"]:
                    splits.append(f"| {workload} | {scenario} | {against} | "
                                  + " | ".join(R.split_texts(p["split"]))
                                  + f" | {p['split']['outside_ms']['reps']} |")
                if p["parts"]:
                    places.append(f"| {workload} | {scenario} | {against} | "
                                  + R.parts_text(p["parts"]) + " |")
    if splits:
        lines += ["", "Over the reps of runs that split each generate (`engine_iterations_s`): the "
                  "other scenario's engine iterations over these (below 1: slower), and the ms "
                  "more outside them:", "",
                  "| workload | scenario | against | engine iterations | outside them, ms | reps |",
                  "|---|---|---|---|---|---|", *splits]
    if places:
        lines += ["", "Over the reps of runs that kept every iteration (`engine_iteration_ms`): "
                  "the ms more than the other scenario in each place of the generate (mean, 95% "
                  "interval):", "", "| workload | scenario | against | by place |", "|---|---|---|---|",
                  *places]
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run folders (each with its results.json[.gz])")
    args = p.parse_args()
    reports = [R.load(r) for r in args.runs]
    suites = {(r["suite"], r["model"]) for r in reports}
    if len(suites) > 1:
        p.error(f"runs of different suites or models: {sorted(suites)}")
    gpus = {(r.get("env") or {}).get("gpu") for r in reports} - {None}
    if len(gpus) > 1:
        p.error(f"runs on different GPUs: {sorted(gpus)}")
    print(markdown(reports, [Path(r).name for r in args.runs]), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
