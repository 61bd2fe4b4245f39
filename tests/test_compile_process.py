"""The capture kernel's variants compiled in a child process (``kernels.compile_process``), for
an sm_90 target on this machine (no GPU: Triton's NVIDIA backend and its ptxas suffice).

The engine's first launch finds the variants in Triton's cache only where the child's cache keys
are the ones a compile in the engine would make: here a second, separate process compiles the
same variants the way the engine's JIT does (``compile_variants`` with the tile of now), and
must find every one of them in the child's cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_capture.kernels import capture, compile_process

triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401  (ptxas lives there)
except ImportError:  # pragma: no cover
    pytest.skip("Triton without its NVIDIA backend", allow_module_level=True)

SM90 = GPUTarget("cuda", 90, 32)

# A compile in a process of its own, as the engine's JIT does it: the stand-in driver for the
# target, the variants of the dtypes given, the kernel's tile of now.
JIT_COMPILE = """
import sys, torch
from triton.runtime.driver import driver
from vllm_capture.kernels import capture, compile_process
driver.set_active(compile_process.TargetOnlyDriver("cuda", 90, 32))
print(capture.compile_variants([torch.bfloat16], ids_dtypes=[torch.int64]))
"""


def entries(folder: Path) -> set[str]:
    return set(os.listdir(folder)) if folder.exists() else set()


def jit_compile(cache: Path) -> str:
    done = subprocess.run([sys.executable, "-c", JIT_COMPILE],
                          env=compile_process.compile_env(str(cache)), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_the_child_fills_the_cache_a_later_compile_in_another_process_reads(tmp_path,
                                                                              monkeypatch):
    ours, vllms = tmp_path / "triton-at-start", tmp_path / "vllm-triton-cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(ours))
    child = compile_process.start(SM90, [torch.bfloat16], [torch.int64])
    # vLLM points Triton at its own compile cache while the child runs
    monkeypatch.setenv("TRITON_CACHE_DIR", str(vllms))
    child.process.wait(timeout=300)
    time.sleep(1.0)  # the engine compiles on long after the child ended
    assert child.wait() is None
    # its seconds end where the child did, not at the wait
    assert 0 < child.seconds <= time.time() - child.started - 0.9
    assert child.cache_dir == str(ours)
    compiled = entries(ours) - {"vllm_capture"}
    assert len(compiled) == 2  # with and without a residual
    assert len(entries(ours / "vllm_capture")) == 1  # the child's marker
    assert entries(vllms) == set()
    with child.cache():
        assert triton.knobs.cache.dir == str(ours)
    assert triton.knobs.cache.dir == str(vllms)
    assert jit_compile(ours) == "2"
    assert entries(ours) - {"vllm_capture"} == compiled  # every variant found, none compiled again


def test_a_marked_cache_starts_no_child_and_other_variants_do(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert compile_process.start(SM90, [torch.bfloat16], [torch.int64]).wait() is None
    cached = compile_process.start(SM90, [torch.bfloat16], [torch.int64])
    assert cached.process is None and cached.wait() is None and cached.seconds == 0.0
    assert cached.cache_dir == str(tmp_path)
    # another dtype, and the same variants for another target, are not what the marker names
    for target, dtypes in ((SM90, [torch.float16]), (GPUTarget("cuda", 80, 32), [torch.bfloat16])):
        child = compile_process.start(target, dtypes, [torch.int64])
        assert child.process is not None and child.wait() is None
    assert len(entries(tmp_path / "vllm_capture")) == 3
    # nor are the variants of changed kernels' sources
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    for module in compile_process.KERNELS_DIR.glob("*.py"):
        (kernels / module.name).write_bytes(module.read_bytes())
    (kernels / "gather.py").write_text((kernels / "gather.py").read_text() + "\n# changed\n")
    monkeypatch.setattr(compile_process, "KERNELS_DIR", kernels)
    child = compile_process.start(SM90, [torch.bfloat16], [torch.int64])
    assert child.process is not None and child.wait() is None


def test_a_changed_tile_is_compiled_again(tmp_path, monkeypatch):
    """What the test above rests on: a variant the child did not make is a new cache entry."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(capture, "NUM_WARPS", capture.NUM_WARPS // 2)
    assert compile_process.start(SM90, [torch.bfloat16], [torch.int64]).wait() is None
    compiled = entries(tmp_path)
    jit_compile(tmp_path)
    assert len(entries(tmp_path) - compiled) == 2


def test_a_marker_that_cannot_be_written_fails_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    (tmp_path / "vllm_capture").write_text("a file where the markers' folder would be")
    for _ in range(2):  # no marker, so the second start compiles again, in a child
        child = compile_process.start(SM90, [torch.bfloat16], [torch.int64])
        assert child.process is not None and child.wait() is None
    assert len(entries(tmp_path) - {"vllm_capture"}) == 2


def test_a_failed_child_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    child = compile_process.start(SimpleNamespace(backend="cuda", arch="sm_ninety", warp_size=32),
                                  [torch.bfloat16], [torch.int64])
    failure = child.wait()
    assert failure.startswith("exit status 1") and "sm_ninety" in failure
    assert entries(tmp_path) == set()  # no variant and no marker


def test_bad_arguments_name_the_field(capsys):
    with pytest.raises(SystemExit):
        compile_process.main(["--target", "cuda:90:32", "--dtypes", "bfloat17",
                              "--ids-dtypes", "int64", "--tile", "{}"])
    assert "--dtypes" in capsys.readouterr().err
