#!/usr/bin/env python3
"""Engine start-up, vanilla against capture-installed, each from its own empty compile cache.

    python3 benchmarks/startup.py --model 1b [--order vanilla,capture,vanilla,capture] [--rounds N]
        [--package-before DIR] [--gpu-memory-utilization SHARE] [--out DIR]

Start order decides who finds a warm cache: in one cache directory, the engine started second
reuses the Triton kernels and Inductor code the first one compiled. So every kind gets a fresh
cache root of its own (``VLLM_CACHE_ROOT``, ``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``):
its first start is cold, its next start in the same order list is warm (what a user restarting
an engine sees). Each start runs in a fresh process and times ``LLM(...)`` until it returns, CUDA
graphs and torch.compile on (vLLM's defaults). Prints one line per start (the parts vLLM logs,
``PHASES``; a capture start also gives what capture's own parts took: its install at model load,
its kernels' compile (``kernel_compile``: the child process from start to end, 0 where Triton's
cache held a child's marker for the variants, so none ran), graph capture's wait for it and
loads (``kernel_wait``), and the graph copies; every start, the seconds from
``LLM(...)``'s call to each step of vLLM's start, ``MILESTONES``, read from log lines stamped to
the millisecond), each capture kind's extra seconds per segment between milestones (``SEGMENTS``)
and the capture/vanilla ratios last; writes ``startup.json`` and each start's whole log
(``startup-logs/ROUND-KIND-CACHE.log.gz``) into ``--out``.

Before b635ec6 the kernels compiled on a thread beside vLLM's own compile, sharing the GIL with
it: 6 to 8 s cold on the H100 (1.5 s alone), graph capture waiting 0.2 to 0.4 s for it, and
Dynamo's tracing slower beside it (``benchmarks/compile_beside_tracing.py``: 28% on the CPU VM).
``--package-before`` with the package before b635ec6 compares the two in the same rounds.

One start per case is within the host's noise (a cold vanilla start of the 1B shape took 53 to
75 s across sessions), so ``--rounds N`` repeats the order N times, each round from new empty
caches and every second round in reverse (so neither kind always starts first), and the ratios
are of the medians; each round's own ratio is printed beside them and kept in ``startup.json``
(``over_vanilla_by_round``), and ``benchmarks/startup_pool.py`` pools rounds over runs.

``--package-before DIR`` adds a third kind, capture-before: the capture engine with the
``vllm_capture/`` package in DIR (another commit's, e.g. ``git archive COMMIT vllm_capture``),
first on its processes' path, started in the same rounds from caches of its own. Whether a
change moved start-up is then read on one machine against one vanilla; each start records the
package it ran (``package``).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# capture-before: the capture engine with another commit's package (``--package-before``).
KINDS = ("vanilla", "capture", "capture-before")
# Where a capture-before start finds its package (the folder that holds its vllm_capture/).
PACKAGE_DIR_ENV = "STARTUP_PACKAGE_DIR"
# What vLLM logs about the parts of a start (seconds, summed over the lines of a part), when it
# logs them. compile_s holds dynamo_s (tracing, on the engine's main thread) and inductor_s (the
# compiled pieces, one line per compile range): session 55's cold capture starts read compile_s
# 1 to 6 s over vanilla's, which these two place.
PHASES = {
    "load_s": re.compile(r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds"),
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "inductor_s": re.compile(r"Compiling a graph for compile range .+? takes ([\d.]+) s"),
    "compile_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
}

# Where a start's time goes, at a millisecond: the seconds from ``LLM(...)``'s call to the first
# log line of each step of vLLM's start, in order (session 56's warm capture start was 1.3 s over
# vanilla's, and vLLM's own lines, stamped to the second, placed only 0.9 s of it). The starts
# log through LOGGING_CONFIG, whose lines carry the epoch time.
MILESTONES = {
    "engine_core": re.compile(r"Initializing a V1 LLM engine"),
    "load_begin": re.compile(r"Loading model from scratch"),
    "load_end": re.compile(r"Model loading took"),
    "dynamo_end": re.compile(r"Dynamo bytecode transform time"),
    "compile_end": re.compile(r"torch\.compile took"),
    "profile_end": re.compile(r"Initial profiling/warmup run took"),
    "kv_cache": re.compile(r"Available KV cache memory"),
    "graphs_end": re.compile(r"Graph capturing finished"),
    "engine_init_end": re.compile(r"init engine \(profile, create kv cache, warmup model\)"),
}
# vLLM's own logging config (vllm/logger.py) but for the time: epoch seconds to the millisecond.
LOGGING_CONFIG = {
    "version": 1, "disable_existing_loggers": False,
    "formatters": {"vllm": {"class": "vllm.logging_utils.NewLineFormatter",
                            "format": "%(levelname)s %(created).3f [%(fileinfo)s:%(lineno)d] %(message)s"}},
    "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": "INFO",
                          "stream": "ext://sys.stdout"}},
    "loggers": {"vllm": {"handlers": ["vllm"], "level": "INFO", "propagate": False}},
}
_STAMPED_LINE = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (\d+\.\d{3}) \[[^\]]*\] (.*)")


def milestones(log: str, t0: float) -> dict[str, float]:
    """Seconds from ``t0`` (epoch) to the first stamped line of each MILESTONES step in ``log``."""
    found: dict[str, float] = {}
    for line in log.splitlines():
        stamped = _STAMPED_LINE.search(line)
        if stamped is None:
            continue
        for name, pattern in MILESTONES.items():
            if name not in found and pattern.search(stamped.group(2)):
                found[name] = round(float(stamped.group(1)) - t0, 3)
    return {name: found[name] for name in MILESTONES if name in found}


def start_once(kind: str, folder: str, cpu: bool, gpu_share: float) -> float:
    """Build one engine in this process and return the seconds ``LLM(...)`` took."""
    from vllm import LLM

    import vllm_capture as vc

    if kind != "vanilla":
        print(f"CAPTURE_PACKAGE {Path(vc.__file__).parent}", flush=True)
    kw = dict(dtype="float32" if cpu else "bfloat16", max_model_len=1024, seed=0, max_num_seqs=64)
    if not cpu:
        kw.update(load_format="dummy", gpu_memory_utilization=gpu_share)
    else:
        kw["enforce_eager"] = True
    print(f"STARTUP_T0 {time.time():.3f}", flush=True)
    t = time.perf_counter()
    llm = LLM(folder, **kw) if kind == "vanilla" else vc.LLM(folder, **kw)
    seconds = time.perf_counter() - t
    if kind != "vanilla":
        parts = capture_startup_parts(vc.capture_status(llm))
        print(f"CAPTURE_STARTUP_MS {json.dumps(parts)}", flush=True)
    del llm
    return seconds


def capture_startup_parts(status: dict) -> dict[str, float]:
    """What capture added to an engine's start, ms by part, from its ``capture_status``: the
    worker's own parts (``startup_ms``: install, the kernels' compile and the wait for it) and
    the graph copies without idle sites' nodes (``graph_nodes``, None off CUDA)."""
    parts = dict(status["startup_ms"])
    if status["graph_nodes"] is not None:
        parts["graph_copies"] = status["graph_nodes"]["copy_ms"]
    return parts


def against_vanilla(starts: list[dict], summary, compare) -> dict[str, dict]:
    """Per capture kind and cache state: ``compare(ours, vanilla's)`` of the ``summary`` of each
    side's starts, where both sides have one (``summary`` gives None for none)."""
    def group(kind: str, cache: str):
        return summary([s for s in starts if s["kind"] == kind and s["cache"] == cache])

    out: dict[str, dict] = {}
    for kind in KINDS[1:]:
        for cache in ("cold", "warm"):
            ours, vanilla = group(kind, cache), group("vanilla", cache)
            if ours is not None and vanilla is not None:
                out.setdefault(kind, {})[cache] = compare(ours, vanilla)
    return out


def over_vanilla(starts: list[dict]) -> dict[str, dict[str, float]]:
    """Per capture kind and cache state, the median of its starts' seconds over vanilla's."""
    def median_seconds(group: list[dict]) -> float | None:
        seconds = [s["llm_s"] for s in group if s["llm_s"] is not None]
        return statistics.median(seconds) if seconds else None

    return against_vanilla(starts, median_seconds, lambda ours, vanilla: ours / vanilla)


def round_ratios(starts: list[dict]) -> dict[str, dict[str, list[float]]]:
    """Per capture kind and cache state, each round's ratio: the median of its starts' seconds
    over vanilla's median in the same round (rounds where either side has none are left out).
    A round's two kinds ran minutes apart on one host, so its ratio is the unit to pool
    (``startup_pool.py``). Starts written before ``--rounds`` (session 6) name no round: one."""
    out: dict[str, dict[str, list[float]]] = {}
    for r in sorted({s.get("round", 0) for s in starts}):
        ratios = over_vanilla([s for s in starts if s.get("round", 0) == r])
        for kind, by_cache in ratios.items():
            for cache, ratio in by_cache.items():
                out.setdefault(kind, {}).setdefault(cache, []).append(ratio)
    return out


def segments(start: dict) -> dict[str, float]:
    """A start's time between consecutive milestones, each named for the step it ends with
    (``return``: the last milestone to ``LLM(...)``'s return); empty without all milestones."""
    marks = start.get("milestones_s") or {}
    if start.get("llm_s") is None or list(marks) != list(MILESTONES):
        return {}
    ends = [*marks.items(), ("return", start["llm_s"])]
    before = 0.0
    out = {}
    for name, at in ends:
        out[name] = round(at - before, 3)
        before = at
    return out


def segments_over_vanilla(starts: list[dict]) -> dict[str, dict[str, dict[str, float]]]:
    """Per capture kind and cache state, each segment's median seconds minus vanilla's."""
    def median_segments(group: list[dict]) -> dict[str, float] | None:
        split = [x for x in map(segments, group) if x]
        if not split:
            return None
        return {name: statistics.median(x[name] for x in split) for name in split[0]}

    return against_vanilla(starts, median_segments, lambda ours, vanilla: {
        name: round(ours[name] - vanilla[name], 3) for name in ours})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1b", help="a benchmarks.scenarios.MODELS key")
    p.add_argument("--order", default=None,
                   help="starts, in order; each kind's first start is cold, later ones warm "
                        "(default: vanilla,capture twice, with capture-before after each capture "
                        "where --package-before is given)")
    p.add_argument("--package-before", metavar="DIR",
                   help="a folder holding another commit's vllm_capture/ (e.g. .bisect/COMMIT): "
                        "its engine starts as the kind capture-before, in the same rounds")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the order, each time from new caches, every second time reversed")
    p.add_argument("--out", help="folder for startup.json")
    p.add_argument("--timeout-s", type=float, default=400.0, help="per start")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                   help="every start's share of the GPU (default 0.4, every session's 1B reading; "
                        "it leaves the 8B's capture engine no KV cache on an 80 GiB card)")
    p.add_argument("--one", nargs=4, metavar=("KIND", "FOLDER", "DEVICE", "SHARE"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        if os.environ.get(PACKAGE_DIR_ENV):
            sys.path.insert(0, os.environ[PACKAGE_DIR_ENV])
        kind, folder, device, share = args.one
        print(f"STARTUP_S {start_once(kind, folder, device == 'cpu', float(share)):.3f}", flush=True)
        os._exit(0)  # engine threads can hang interpreter exit; the number is out
    before = Path(args.package_before).resolve() if args.package_before else None
    if before is not None and not (before / "vllm_capture" / "__init__.py").is_file():
        p.error(f"--package-before: {before} holds no vllm_capture/ package")
    kinds = [k for k in KINDS if k != "capture-before" or before is not None]
    order = (args.order or ",".join(kinds * 2)).split(",")
    if not order or not set(order) <= set(kinds):
        p.error(f"--order: a comma list of {'|'.join(kinds)} "
                "(capture-before needs --package-before)")
    if not 0 < args.gpu_memory_utilization <= 1:
        p.error("--gpu-memory-utilization: a share in (0, 1]")
    from benchmarks import scenarios as S
    from benchmarks.run import has_cuda, prepare_model

    cpu = not has_cuda()

    work = Path(tempfile.mkdtemp(prefix="startup-"))
    folder = str(prepare_model(S.MODELS[args.model], work))
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.rounds < 1:
        p.error("--rounds: at least 1")
    logging_config = work / "logging.json"
    logging_config.write_text(json.dumps(LOGGING_CONFIG))
    starts = []
    runs = [(r, kind) for r in range(args.rounds) for kind in (order[::-1] if r % 2 else order)]
    for r, kind in runs:
        cache = work / f"cache-{kind}-{r}"
        env = dict(os.environ, VLLM_CACHE_ROOT=str(cache / "vllm"),
                   TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), TRITON_CACHE_DIR=str(cache / "triton"))
        if kind == "capture-before":
            # First on the path of this process and of the engine's (which inherit PYTHONPATH).
            env[PACKAGE_DIR_ENV] = str(before)
            env["PYTHONPATH"] = os.pathsep.join(
                x for x in (str(before), env.get("PYTHONPATH")) if x)
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
        cold = not cache.exists()
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", kind, folder, "cpu" if cpu else "cuda",
                               str(args.gpu_memory_utilization)],
                              env=env,
                              capture_output=True, text=True, timeout=args.timeout_s)
        log = proc.stdout + proc.stderr
        found = re.search(r"STARTUP_S ([\d.]+)", proc.stdout)
        start = {"round": r, "kind": kind, "cache": "cold" if cold else "warm", "rc": proc.returncode,
                 "llm_s": float(found.group(1)) if found else None,
                 "process_s": round(time.perf_counter() - t, 3)}
        for name, pattern in PHASES.items():
            hit = pattern.findall(log)
            start[name] = round(sum(map(float, hit)), 3) if hit else None
        t0 = re.search(r"STARTUP_T0 ([\d.]+)", proc.stdout)
        if t0:
            start["milestones_s"] = milestones(log, float(t0.group(1)))
        parts = re.search(r"CAPTURE_STARTUP_MS (\{.*\})", proc.stdout)
        if parts:
            start["capture_parts_ms"] = json.loads(parts.group(1))
        package = re.search(r"CAPTURE_PACKAGE (.+)", proc.stdout)
        if package:
            start["package"] = package.group(1).strip()
        if found is None:
            start["log_tail"] = log[-2000:]
        if args.out:
            logs = Path(args.out) / "startup-logs"
            logs.mkdir(parents=True, exist_ok=True)
            with gzip.open(logs / f"{r}-{kind}-{start['cache']}.log.gz", "wt") as f:
                f.write(log)
        starts.append(start)
        print(json.dumps(start), flush=True)

    ratios = over_vanilla(starts)
    by_round = round_ratios(starts)
    extra = segments_over_vanilla(starts)
    result = {"model": args.model, "order": order, "rounds": args.rounds,
              "gpu_memory_utilization": args.gpu_memory_utilization,
              "package_before": str(before) if before else None, "starts": starts,
              "capture_over_vanilla": ratios.get("capture", {}),
              "capture_before_over_vanilla": ratios.get("capture-before", {}),
              "over_vanilla_by_round": by_round,
              "segments_over_vanilla_s": extra}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "startup.json").write_text(json.dumps(result, indent=1))
    for kind, by_cache in extra.items():
        for cache, by_segment in by_cache.items():
            print(f"SEGMENTS {cache} {kind} - vanilla (s): "
                  + " ".join(f"{n} {v:+.3f}" for n, v in by_segment.items()))
    for kind, by_cache in ratios.items():
        for cache, ratio in by_cache.items():
            verdict = "PASS" if ratio <= 1.1 else "FAIL"
            rounds = ", ".join(f"{x:.3f}" for x in by_round.get(kind, {}).get(cache, []))
            print(f"{verdict}  {cache} start-up, {kind} / vanilla <= 1.1: {ratio:.3f} "
                  f"(by round: {rounds})")
    return 0 if all(s["llm_s"] is not None for s in starts) else 1


if __name__ == "__main__":
    sys.exit(main())
