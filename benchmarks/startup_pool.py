#!/usr/bin/env python3
"""Start-up rounds pooled over runs: capture's start-up over vanilla's, round by round.

    python3 benchmarks/startup_pool.py benchmarks/results/2026-12-07-h100-session62/logs.tgz \\
        benchmarks/results/2026-12-07-h100-session63/logs.tgz [DIR | startup.json ...]

A source is a ``startup.json`` that ``startup.py --out`` wrote, a folder searched for them (one
without any is an error), or a session's ``logs.tgz`` (every ``startup.json`` inside; one without
any adds nothing, so ``benchmarks/results/*/logs.tgz`` reads every session). The GPU and host
come from the ``gpu.txt`` beside each one (``gpu_session.sh`` writes it). A round's ratio is its
capture start's seconds over its vanilla start's (``startup.round_ratios``): the two ran minutes
apart on one host, while a whole start moved by a third from machine to machine and by 30%
within one (session 63's 8B: every segment of one warm capture start slower, the weights' load
included). One round reads within that noise, so the bound is judged on the pool: per GPU, model
and cache state, the geometric mean of the rounds' ratios with a 95% t interval over rounds, and
how many rounds read over the bound.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import report as R  # noqa: E402
from benchmarks.startup import round_ratios  # noqa: E402

BOUND = 1.1
# Only the capture engine of the tree that ran: ``capture-before`` is another commit's package,
# which differs from run to run.
KIND = "capture"


def machine(gpu_txt: str | None) -> tuple[str, str]:
    """``(GPU name, host CPU model number)`` from a ``gpu.txt``, "?" for what it lacks."""
    gpu, cpu = "?", "?"
    for line in (gpu_txt or "").splitlines():
        if line.startswith("cpu "):
            try:
                cpu = json.loads(line[4:]).get("model_number", "?")
            except json.JSONDecodeError:
                pass
        elif gpu == "?" and "," in line and not line.startswith("vllm "):
            gpu = line.split(",")[0].strip()
    return gpu, cpu


def load(source: str) -> list[dict]:
    """Every run in ``source``: ``{"name", "gpu", "cpu", "model", "rounds"}`` with ``rounds``
    ``{cache: [ratio, ...]}`` of the capture kind."""
    path = Path(source)
    found: list[tuple[str, dict, str | None]] = []
    if path.is_file() and path.name.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}

            def read(name: str) -> str | None:
                member = members.get(name)
                return None if member is None else io.TextIOWrapper(tar.extractfile(member)).read()

            for name in sorted(n for n in members if Path(n).name == "startup.json"):
                folder = Path(name).parent
                found.append((f"{path.parent.name}/{folder}", json.loads(read(name)),
                              read(str(folder / "gpu.txt"))))
    else:
        files = [path] if path.is_file() else sorted(path.rglob("startup.json"))
        if not files:
            raise SystemExit(f"{source}: no startup.json")
        for f in files:
            gpu_txt = f.parent / "gpu.txt"
            found.append((str(f.parent), json.loads(f.read_text()),
                          gpu_txt.read_text() if gpu_txt.is_file() else None))
    runs = []
    for name, result, gpu_txt in found:
        gpu, cpu = machine(gpu_txt)
        runs.append({"name": name, "gpu": gpu, "cpu": cpu, "model": result.get("model", "?"),
                     "rounds": round_ratios(result["starts"]).get(KIND, {})})
    return runs


def pooled(runs: list[dict]) -> list[dict]:
    """Per GPU, model and cache state over every round of ``runs``: the geometric mean and its
    interval (``report.geometric_mean_interval``), the rounds and those over ``BOUND``."""
    groups: dict[tuple[str, str, str], list[float]] = {}
    for run in runs:
        for cache in ("cold", "warm"):
            groups.setdefault((run["gpu"], run["model"], cache), []).extend(
                run["rounds"].get(cache, []))
    out = []
    for (gpu, model, cache), ratios in groups.items():
        if ratios:
            out.append({"gpu": gpu, "model": model, "cache": cache,
                        "pooled": R.geometric_mean_interval([math.log(x) for x in ratios]),
                        "rounds": len(ratios), "over_bound": sum(x > BOUND for x in ratios)})
    return out


def markdown(runs: list[dict]) -> str:
    lines = ["| run | GPU | host CPU model | model | cold by round | warm by round |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        by_cache = [", ".join(f"{x:.3f}" for x in run["rounds"].get(c, [])) or "-"
                    for c in ("cold", "warm")]
        lines.append(f"| {run['name']} | {run['gpu']} | {run['cpu']} | {run['model']} | "
                     f"{by_cache[0]} | {by_cache[1]} |")
    lines += ["", f"| GPU | model | cache | rounds | capture / vanilla (95% CI) | rounds over "
                  f"{BOUND} |", "|---|---|---|---|---|---|"]
    for p in pooled(runs):
        lines.append(f"| {p['gpu']} | {p['model']} | {p['cache']} | {p['rounds']} | "
                     f"{R.ratio_text(p['pooled'])} | {p['over_bound']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sources", nargs="+",
                   help="startup.json files, folders holding them, or sessions' logs.tgz")
    args = p.parse_args()
    runs = [run for source in args.sources for run in load(source)]
    if not runs:
        p.error("no startup.json in the sources")
    print(markdown(runs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
