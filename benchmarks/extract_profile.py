"""The extract command's capture loop under cProfile: where a batch's time goes, client and
engine together (run with VLLM_ENABLE_V1_MULTIPROCESSING=0, so that the engine core and the
worker run in this process). Engine start-up is not profiled.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python3 benchmarks/extract_profile.py --report OUT.txt -- \\
        MODEL PROMPTS -o DIR -l all -s last ...   (the arguments of `vllm-capture extract`)

The report lists the top functions by cumulative and by own time. With gpu_session.sh's
PACKAGE_AT the same loop of an earlier package is profiled on the same host.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from vllm_capture import cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", required=True, help="where to write the profile's tables")
    parser.add_argument("--top", type=int, default=45)
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
    rc = cli.main(["extract", *extract_args])
    text = io.StringIO()
    for order in ("cumulative", "tottime"):
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
    with open(args.report, "w") as f:
        f.write(text.getvalue())
    raise SystemExit(rc)


if __name__ == "__main__":
    main()
