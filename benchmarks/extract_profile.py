"""The extract command's capture loop under cProfile: where a batch's time goes, client and
engine together (run with VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the engine core and the
worker run in this process). Engine start-up is not profiled.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/extract_profile.py --report OUT.txt -- \\
        MODEL PROMPTS -o DIR -l all -s last ...   (the arguments of `vllm-capture extract`)

The report gives each batch's capture call in seconds (a first batch's one-time costs apart from
a steady per-batch one), the stream's status after the last batch (host timers, graph copies),
then the top functions by cumulative and by own time. With gpu_session.sh's PACKAGE_AT the same
loop of an earlier package is profiled on the same host.

``--trace-batch N`` also runs batch N (0-based) under torch.profiler and adds its ops and kernels
by device time (by host time without a GPU): whether a batch's extra time is the device's work
or the host's, which cProfile alone cannot tell (a host waiting on the device shows as the call
that waits).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

from vllm_capture import api, cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="where to write the profile's tables")
    parser.add_argument("--top", type=int, default=45)
    parser.add_argument("--trace-batch", type=int, default=None, metavar="N",
                        help="also trace batch N (0-based) with torch.profiler")
    parser.add_argument("extract_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    extract_args = [a for a in args.extract_args if a != "--"]

    profile = cProfile.Profile()

    def profiling(fn):
        def profiled(*a, **k):
            profile.enable()
            try:
                return fn(*a, **k)
            finally:
                profile.disable()
        return profiled

    # The CLI calls extract's undecorated body (``__wrapped__``) where it holds the folder.
    undecorated = getattr(cli.extract, "__wrapped__", None)
    cli.extract = profiling(cli.extract)
    if undecorated is not None:
        cli.extract.__wrapped__ = profiling(undecorated)

    # A batch's capture: capture_streams, or capture() in packages older than it.
    batch_call = "capture_streams" if hasattr(api, "capture_streams") else "capture"
    unwrapped, batch_s, last_status = getattr(api, batch_call), [], {}

    traces = []

    def timed(llm, *a, **k):
        tracing = len(batch_s) == args.trace_batch
        t0 = time.perf_counter()
        try:
            if tracing:
                with _device_trace() as trace:
                    result = unwrapped(llm, *a, **k)
                traces.append(trace)
                return result
            return unwrapped(llm, *a, **k)
        finally:
            batch_s.append(time.perf_counter() - t0)
            try:
                last_status["status"] = api.capture_status(llm)
            except Exception as exc:  # a package whose status needs a running stream
                last_status["status"] = repr(exc)

    setattr(api, batch_call, timed)
    rc = cli.main(["extract", *extract_args])
    text = io.StringIO()
    text.write(f"{batch_call} seconds a batch: {' '.join(f'{s:.3f}' for s in batch_s)}\n")
    if batch_s:
        rest = sorted(batch_s[1:] or batch_s)
        text.write(f"first {batch_s[0]:.3f}, median of the rest {rest[len(rest) // 2]:.3f}\n")
    text.write("status after the last batch: "
               f"{json.dumps(last_status.get('status'), default=str)[:4000]}\n\n")
    for trace in traces:
        text.write(_trace_table(trace, args.trace_batch, args.top))
    for order in ("cumulative", "tottime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
    with open(args.report, "w") as f:
        f.write(text.getvalue())
    raise SystemExit(rc)


def _device_trace():
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def _trace_table(trace, batch: int, top: int) -> str:
    """Batch ``batch``'s ops and kernels, by device time where a GPU ran them."""
    import torch

    on_device = torch.cuda.is_available()
    events = trace.key_averages()
    order = "self_device_time_total" if on_device else "self_cpu_time_total"
    total = sum(getattr(e, order) for e in events) / 1e3
    return (f"batch {batch} under torch.profiler: {total:.1f} ms of "
            f"{'device' if on_device else 'host'} time (self, all ops)\n"
            f"{events.table(sort_by=order, row_limit=top, max_name_column_width=70)}\n\n")


if __name__ == "__main__":
    main()
