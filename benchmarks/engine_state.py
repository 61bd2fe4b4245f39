"""What a capture engine holds, read and let go of between generates: the releases
``after_capture.py`` steps through and ``run.py --release-after-capture`` runs after each capture,
and the probe of the FULL decode graph (``device_state``) both can run.

The worker's functions travel through ``collective_rpc`` as pickled functions, so the engine
must run with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``."""

from __future__ import annotations

import gc
import time

#: Seconds the ``wait`` release waits, doing nothing: a slowdown that fades with time fades here.
WAIT_S = 5.0


# ---- releases in the engine's worker (sent by collective_rpc as pickled functions) ----------

def release_worker_shm(worker) -> int:
    """Drop the worker's spare and close its kept reply-file mappings; the bytes they mapped."""
    from vllm_capture.session import shm

    shm.drop_spare()
    maps = list(shm._kept.values())
    mapped = sum(len(m) for m in maps)
    shm._kept.clear()
    shm._reap(maps=maps)
    shm.settle()
    return mapped


def synchronize(worker) -> int:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return 1


def empty_device_cache(worker) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return reserved - torch.cuda.memory_reserved()


def empty_host_cache(worker) -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch._C._host_emptyCache()
    return 1


def drop_graph_copies(worker) -> int:
    """Destroy every graph copy but the one its graph's replays use; how many."""
    from vllm_capture.engine.worker_ext import SESSION_ATTR

    session = getattr(worker, SESSION_ATTR, None)
    nodes = None if session is None or session.graph_state is None else session.graph_state.nodes
    if nodes is None or nodes.driver is None:
        return 0
    dropped = 0
    for entry in list(nodes._graphs.values()):
        for key, graph_exec in list(entry.variants.items()):
            if graph_exec != entry.use:
                nodes.driver.destroy_exec(graph_exec)
                del entry.variants[key]
                dropped += 1
    return dropped


def device_state(worker, tokens: int, replays: int = 50) -> dict | None:
    """On CUDA (None elsewhere): the worker's device allocator (reserved, allocated) and pinned
    host allocator (held, handed out) in MB; the FULL decode graph of ``tokens`` tokens replayed
    back to back, launched as the engine launches it now (from the copy for the sites now on),
    GPU and host us a replay (None off the V2 runner; between generates its stale inputs write
    nothing a request reads); and, for reference, work of no graph on the same device: a 256 MiB
    device-to-device copy (memory bound) and a 4096-square bf16 matmul (compute bound), GPU us
    each. The graph slower and the references not: the graph's own work changed; all slower:
    the device runs slower for this process (clocks, or work beside it)."""
    import torch

    from benchmarks.graph_replay import _time, full_graph_desc, runner_graphs

    if not torch.cuda.is_available():
        return None
    host = torch.cuda.host_memory_stats()
    mb = 1 << 20
    memory = {"device_reserved_mb": torch.cuda.memory_reserved() // mb,
              "device_allocated_mb": torch.cuda.memory_allocated() // mb,
              "pinned_held_mb": host.get("allocated_bytes.current", 0) // mb,
              "pinned_active_mb": host.get("active_bytes.current", 0) // mb}
    graphs = runner_graphs(worker)
    desc = None if not graphs else full_graph_desc(graphs, tokens)
    sync = torch.cuda.synchronize
    graph = None if desc is None else _time(graphs[desc].replay, replays, sync)
    src = torch.empty(256 * mb, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    square = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    reference = {"copy_256mb": _time(lambda: dst.copy_(src), 20, sync),
                 "matmul_4096": _time(lambda: square @ square, 20, sync)}
    del src, dst, square
    return {"graph": graph, "reference": reference, "memory": memory}


#: The worker's releases, by name.
WORKER_RELEASES = {"synchronize": synchronize, "worker-shm": release_worker_shm,
                   "device-cache": empty_device_cache, "host-cache": empty_host_cache,
                   "graph-copies": drop_graph_copies}
#: What ``release`` runs: 5 s of nothing, the client's fetched files, and the worker's releases.
RELEASES = ("wait", "client", *WORKER_RELEASES)


def release_client() -> None:
    from vllm_capture.session import shm

    gc.collect()
    shm.settle()


def release(llm, name: str):
    """Run release ``name`` (one of ``RELEASES``) on ``llm``; what it reports (bytes or counts,
    by worker)."""
    if name == "wait":
        time.sleep(WAIT_S)
        return None
    try:
        if name == "client":
            return release_client()
        fn = WORKER_RELEASES[name]
        return llm.collective_rpc(fn)
    except Exception as exc:  # an older package (PACKAGE_AT) may lack what a release reaches
        print(f"release {name} failed: {exc!r}", flush=True)
        return {"error": repr(exc)}
