"""The capture kernel's variants compiled in a child process, into Triton's cache on disk.

Why a process: the variants compile while vLLM traces and compiles the model on the engine's
main thread. On a thread, the two shared one interpreter lock: the compile took 6 to 8 s cold
beside vLLM's (1.5 s alone; H100, session 55), Dynamo's tracing took 28% longer beside it on
the CPU VM (``benchmarks/compile_beside_tracing.py``; the 1B on the H200: 3.85 s against 3.48 s
beside the child), and Triton's ``ast.parse`` once failed beside it (CPython 3.11's AST
recursion counter is not safe across threads). A child compiles on a core of its own for the
parent's GPU target without touching CUDA (no context, no device memory for vLLM's memory
profiling to see), writes Triton's cache, and the parent's first launch (``warmup``) loads each
variant from there.

Once the child has compiled a set of variants it leaves a marker beside them in that cache, named
for the set, the kernels' sources and Triton's version; a later engine that finds the marker
starts no child. A warm child only imports and finds every variant cached, yet it took 3.6 to 6.1
s on an H100 host beside vLLM's compile, and graph capture waited for it up to 0.5 s (sessions 63
and 64). Where the marker outlives a variant, the engine's first launch compiles that variant
itself: slower, never wrong.

    python -m vllm_capture.kernels.compile_process --target cuda:90:32 --dtypes bfloat16 \
        --ids-dtypes int64 --tile '{"BLOCK_R": 16, ...}'
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import torch

from vllm_capture.dtypes import dtype_name
from vllm_capture.kernels import capture

# The child's stderr kept for the parent's warning when it fails.
STDERR_TAIL = 2000
# The kernels' modules: the marker of compiled variants is named for their sources.
KERNELS_DIR = Path(__file__).parent


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtypes/--ids-dtypes: {name!r} is not a torch dtype")
    return dtype


class TargetOnlyDriver:
    """A Triton driver that knows the GPU target and nothing else: enough for
    ``JITFunction.warmup`` to compile (which asks for the current device, stream and target),
    never to launch."""

    def __init__(self, backend: str, arch: int, warp_size: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget(backend, arch, warp_size)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def target_spec(target) -> str:
    """``backend:arch:warp_size`` of a Triton ``GPUTarget`` (what ``--target`` takes)."""
    return f"{target.backend}:{target.arch}:{target.warp_size}"


@dataclass
class CompileProcess:
    """A started child, or none where the variants were cached already; :meth:`wait` ends it."""

    process: subprocess.Popen | None  # None: the cache's marker says every variant is there
    cache_dir: str  # Triton's cache dir the child writes (the parent's at start)
    started: float = field(default_factory=time.time)
    seconds: float | None = None  # from start to the child's end (the child prints its end)

    def wait(self) -> str | None:
        """None once the child compiled every variant, else why not (its exit status and the
        tail of its stderr)."""
        if self.process is None:
            self.seconds = 0.0
            return None
        out, err = self.process.communicate()
        ended = out.decode(errors="replace").strip()
        self.seconds = (float(ended) if ended else time.time()) - self.started
        if self.process.returncode != 0:
            return (f"exit status {self.process.returncode}: "
                    f"{err.decode(errors='replace')[-STDERR_TAIL:].strip()}")
        return None

    @contextmanager
    def cache(self) -> Iterator[None]:
        """Triton's cache as the child saw it, for the parent's loads: vLLM points
        ``TRITON_CACHE_DIR`` at its own compile cache after the child started."""
        import triton

        with triton.knobs.cache.scope():
            triton.knobs.cache.dir = self.cache_dir
            yield


def current_target(device: torch.device):
    """The Triton ``GPUTarget`` of ``device`` (what the parent's launches compile for)."""
    import triton

    with torch.cuda.device(device):
        return triton.runtime.driver.active.get_current_target()


def start(target, dtypes: Iterable[torch.dtype],
          ids_dtypes: Iterable[torch.dtype]) -> CompileProcess:
    """Start compiling the variants of ``dtypes`` x ``ids_dtypes`` x (residual or not) for
    ``target`` (:func:`current_target`), with the kernel's tile of now, into Triton's cache
    dir of now, in a child that imports this package from where the parent did; no child where
    that cache holds the marker of a child that compiled the same variants."""
    import triton

    cache_dir = triton.knobs.cache.dir
    args = ["--target", target_spec(target), "--dtypes", *(dtype_name(d) for d in dtypes),
            "--ids-dtypes", *(dtype_name(d) for d in ids_dtypes),
            "--tile", json.dumps(capture.kernel_tile())]
    if variants_marker(cache_dir, args).exists():
        return CompileProcess(None, cache_dir)
    process = subprocess.Popen([sys.executable, "-m", __name__, *args],
                               env=compile_env(cache_dir), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return CompileProcess(process, cache_dir)


def variants_marker(cache_dir: str, args: list[str]) -> Path:
    """The file in Triton's cache ``cache_dir`` that says a child compiled the variants its
    ``args`` name, for the kernels' sources and the Triton of now.

    The sources are every module of this folder, where the kernel and every function it calls
    live: not Triton's own cache key of the kernel, which a process running the kernels in
    Triton's interpreter (the tests) does not have."""
    import triton

    named = hashlib.sha256(json.dumps([args, triton.__version__]).encode())
    for module in sorted(KERNELS_DIR.glob("*.py")):
        named.update(module.read_bytes())
    return Path(cache_dir) / "vllm_capture" / named.hexdigest()


def compile_env(cache_dir: str) -> dict[str, str]:
    """The environment of a process that compiles the kernels into ``cache_dir``: this one's,
    importing this package from where this process does."""
    package_root = str(Path(__file__).resolve().parents[2])
    # No GPU in the child, so nothing there can make a CUDA context by accident; and a real
    # compile, where a test process runs the kernels in Triton's interpreter.
    env = dict(os.environ, TRITON_CACHE_DIR=cache_dir, CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH"))
                                          if p))
    env.pop("TRITON_INTERPRET", None)
    return env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="backend:arch:warp_size, e.g. cuda:90:32")
    p.add_argument("--dtypes", nargs="+", required=True, type=_dtype)
    p.add_argument("--ids-dtypes", nargs="+", required=True, type=_dtype)
    p.add_argument("--tile", required=True, type=json.loads, help="the kernel's tile, as JSON")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    backend, arch, warp_size = args.target.split(":")
    import triton
    from triton.runtime.driver import driver

    driver.set_active(TargetOnlyDriver(backend, int(arch), int(warp_size)))
    capture.compile_variants(args.dtypes, ids_dtypes=args.ids_dtypes, tile=args.tile)
    marker = variants_marker(triton.knobs.cache.dir, argv)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:  # the variants are compiled; with no marker the next engine starts a child
        pass
    print(time.time())  # when it ended, for the parent's seconds
    return 0


if __name__ == "__main__":
    sys.exit(main())
