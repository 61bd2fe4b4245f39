#!/usr/bin/env python3
"""What one decode step's CUDA graph costs, replayed alone: capture engine against vanilla.

    python3 benchmarks/graph_replay.py --model 8b --engine capture --out /tmp/out
    python3 benchmarks/graph_replay.py --model 8b --engine vanilla --out /tmp/out

Builds one engine in this process (CUDA graphs on; vanilla keeps its graphs too, so their nodes
can be counted), runs the decode workload once, then takes the FULL graph of ``--tokens`` decode
tokens and replays it back to back: the GPU time per replay, with no scheduler or host work
around it. On the capture engine the same graph is replayed in several states, in rounds:

* ``idle``: as the engine replays it with no stream on (from the copy without the idle sites'
  nodes: only the replay counter's site is left);
* ``hidden_nodes``: as it replays with the hidden-state sites on and the others idle (the kernels
  exit at once: their ``enabled`` flags stay off, so this is the nodes' cost, not the rows');
* ``hidden_last_active``: the same nodes doing a last-token step's work: flags on, and a plan
  reducing each of the step's rows into an accumulator slot (the GPU side of hidden-last);
* ``torch_exec``: torch's own executable graph, every capture node in it;
* ``stripped``: a copy without any capture node (the topology of a vanilla graph of the same
  compiled model).

Both engines also report their graph's nodes by type and their kernels by name, so the two
compiled models can be compared kernel by kernel. One JSON file per engine in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import scenarios as S  # noqa: E402
from benchmarks.run import Prompts, prepare_model  # noqa: E402

_P = ctypes.c_void_p
_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL


class _Cuda:
    """The driver calls that list a graph's nodes and name its kernels (graph copies are
    ``graph_nodes.Driver``'s)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        sig = {
            "cuGraphGetNodes": [_P, ctypes.POINTER(_P), ctypes.POINTER(ctypes.c_size_t)],
            "cuGraphNodeGetType": [_P, ctypes.POINTER(ctypes.c_int)],
            "cuGraphKernelNodeGetParams_v2": [_P, _P],
            "cuFuncGetName": [ctypes.POINTER(ctypes.c_char_p), _P],
            "cuKernelGetName": [ctypes.POINTER(ctypes.c_char_p), _P],
        }
        for name, args in sig.items():
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.argtypes = args
                fn.restype = ctypes.c_int

    def __call__(self, name: str, *args) -> None:
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise RuntimeError(f"{name} failed with CUresult {rc}")

    def _list(self, name: str, first) -> list[int]:
        n = ctypes.c_size_t(0)
        self(name, first, None, ctypes.byref(n))
        out = (_P * max(1, n.value))()
        self(name, first, out, ctypes.byref(n))
        return [out[i] for i in range(n.value)]

    def nodes(self, graph: int) -> list[int]:
        return self._list("cuGraphGetNodes", _P(graph))

    def node_type(self, node: int) -> int:
        t = ctypes.c_int(-1)
        self("cuGraphNodeGetType", _P(node), ctypes.byref(t))
        return t.value

    def kernel_name(self, node: int) -> str:
        # CUDA_KERNEL_NODE_PARAMS_v2: func, grid x3, block x3, shared, params, extra, kern, ctx.
        buf = (ctypes.c_char * 256)()
        self("cuGraphKernelNodeGetParams_v2", _P(node), ctypes.cast(buf, _P))
        func = ctypes.c_void_p.from_buffer(buf, 0).value
        kern = ctypes.c_void_p.from_buffer(buf, 8 + 7 * 4 + 4 + 16).value
        name = ctypes.c_char_p()
        if func:
            self("cuFuncGetName", ctypes.byref(name), _P(func))
        elif kern:
            self("cuKernelGetName", ctypes.byref(name), _P(kern))
        return (name.value or b"?").decode(errors="replace")


def _time(launch, n: int, sync) -> dict:
    import torch

    for _ in range(10):
        launch()
    sync()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        launch()
    host = time.perf_counter() - t0
    end.record()
    sync()
    return {"gpu_us": round(start.elapsed_time(end) * 1e3 / n, 2),
            "host_launch_us": round(host * 1e6 / n, 2)}


def runner_graphs(worker) -> dict | None:
    """The V2 runner's captured CUDA graphs by batch descriptor (None on another runner);
    ``worker`` as ``collective_rpc`` hands it over, or the worker it wraps."""
    runner = getattr(worker, "worker", worker).model_runner
    return getattr(getattr(runner, "cudagraph_manager", None), "graphs", None)


def full_graph_desc(graphs: dict, tokens: int):
    """The descriptor of the FULL graph of ``tokens`` tokens among ``graphs``, or None."""
    from vllm.config import CUDAGraphMode

    return next((d for d in graphs if d.cg_mode == CUDAGraphMode.FULL and d.num_tokens == tokens),
                None)


def measure(worker, tokens: int, n: int, rounds: int) -> dict:
    """Runs in the worker (``collective_rpc``)."""
    import torch

    worker = getattr(worker, "worker", worker)  # the wrapper's worker
    graphs = runner_graphs(worker)
    if graphs is None:
        return {"error": f"no cudagraph_manager.graphs on {type(worker.model_runner).__name__} "
                         "(V2 runner only)"}
    desc = full_graph_desc(graphs, tokens)
    if desc is None:
        return {"error": f"no FULL graph of {tokens} tokens; have "
                         f"{sorted({(d.cg_mode.name, d.num_tokens) for d in graphs})[:40]}"}
    g = graphs[desc]
    cuda = _Cuda()
    raw = g.raw_cuda_graph()
    stream = torch.cuda.current_stream()
    sync = torch.cuda.synchronize
    out: dict = {"desc": repr(desc), "graphs": len(graphs)}
    nodes = cuda.nodes(raw)
    out["node_types"] = dict(collections.Counter(cuda.node_type(x) for x in nodes))
    session = getattr(worker, "_vllm_capture_session", None)
    if session is not None:
        from vllm_capture.capture_graph.graph_nodes import _KeptGraphMixin
        from vllm_capture.session.components import COMPONENTS, HIDDEN_STATES

        import numpy as np

        from vllm_capture.kernels import layout as L

        state = session.graph_state
        registry = state.nodes
        entry = registry._graphs.get(id(g))
        out["capture_nodes"] = sum(len(n) for n in entry.by_site.values()) if entry else 0
        stripped = registry.driver.exec_without(raw, [n for ns in entry.by_site.values() for n in ns])
        s = stream.cuda_stream
        keys = {c: [site.counter.data_ptr() for site in state.sites_of(c)] for c in COMPONENTS}
        idle = {k: False for ks in keys.values() for k in ks}
        hidden = {**idle, **{k: True for k in keys[HIDDEN_STATES]}}

        def last_token_on():
            # What a last-token stream of every layer asks of this graph each decode step: the
            # sites' flags on, and a plan of one segment per row into accumulator slots 0..T-1
            # (no stream is enabled, so those slots hold nothing of anyone's).
            registry.set_sites(hidden)
            for site in state.sites_of(HIDDEN_STATES):
                site.counter[L.SITE_ENABLED] = 1
            rows = np.arange(tokens, dtype=np.int32)
            state.upload_segments(HIDDEN_STATES, L.MODE_LAST, rows, np.ones_like(rows), rows,
                                  np.zeros_like(rows))

        def last_token_off():
            for site in state.sites_of(HIDDEN_STATES):
                site.counter[L.SITE_ENABLED] = 0
            state.switch_off()

        def nothing():
            pass

        states = {
            "idle": (lambda: g.replay(), lambda: registry.set_sites(idle), nothing),
            "hidden_nodes": (lambda: g.replay(), lambda: registry.set_sites(hidden), nothing),
            "hidden_last_active": (lambda: g.replay(), last_token_on, last_token_off),
            "torch_exec": (lambda: super(_KeptGraphMixin, g).replay(), nothing, nothing),
            "stripped": (lambda: registry.driver.launch(stripped, s), nothing, nothing),
        }
    else:
        states = {"vanilla": (lambda: g.replay(), lambda: None, lambda: None)}
    results = collections.defaultdict(list)
    for _ in range(rounds):
        for name, (launch, enter, leave) in states.items():
            enter()
            sync()
            results[name].append(_time(launch, n, sync))
            leave()
    if session is not None:
        registry.set_sites(idle)
        out["graph_nodes"] = registry.status()
    out["states"] = {k: {"gpu_us": sorted(r["gpu_us"] for r in v),
                         "host_launch_us": sorted(r["host_launch_us"] for r in v)}
                     for k, v in results.items()}
    sync()
    out["kernels"] = dict(collections.Counter(
        cuda.kernel_name(x) for x in nodes if cuda.node_type(x) == _KERNEL_NODE).most_common())
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="8b", choices=sorted(S.MODELS))
    p.add_argument("--engine", default="capture", choices=("capture", "vanilla"))
    p.add_argument("--tokens", type=int, default=64, help="the decode graph's size")
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import SamplingParams

    import vllm_capture as vc
    from vllm_capture.capture_graph import graph_nodes

    shape = S.MODELS[args.model]
    suite = S.make_suite("quick", args.model)
    w = suite.workloads[0]
    model_dir = prepare_model(shape, Path(tempfile.mkdtemp(prefix="vllm-capture-replay-")))
    kw = S.engine_kwargs(suite, shape, "capture-graph" if args.engine == "capture" else "vanilla-graph")
    kw["gpu_memory_utilization"] = suite.gpu_memory_utilization
    if args.engine == "capture":
        llm = vc.LLM(str(model_dir), **kw)
    else:
        graph_nodes.install(graph_nodes.GraphNodes(driver=None))  # keep graphs, to count nodes
        llm = vllm.LLM(str(model_dir), **kw)
    params = SamplingParams(max_tokens=w.new_tokens, ignore_eos=True, temperature=0.0,
                            detokenize=False)
    llm.generate(Prompts(shape.vocab).make(w), params, use_tqdm=False)
    t = time.perf_counter()
    result = llm.collective_rpc(measure, args=(args.tokens, args.replays, args.rounds))[0]
    result["measure_s"] = round(time.perf_counter() - t, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"graph_replay_{args.model}_{args.engine}.json").write_text(json.dumps(result, indent=1))
    summary = {k: v for k, v in result.items() if k != "kernels"}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
