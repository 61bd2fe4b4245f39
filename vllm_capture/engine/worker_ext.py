"""The worker extension: installs capture at model load and serves the capture RPCs.

vLLM imports this module in every worker process before the worker loads its model (it is named
by ``worker_extension_cls``). Importing it patches ``Worker.load_model`` (shared by the V1, V2 and
CPU runners) so that, right after the weights are loaded and before the first forward compiles
the model, the call sites are instrumented, the graph-static buffers allocated and counted as
model memory, and the per-step wrappers installed. Engines without ``additional_config["capture"]``
are left untouched.

RPC methods return only msgpack-native values, so they work without
``VLLM_ALLOW_INSECURE_SERIALIZATION``. Their names cannot collide with Worker attributes (vLLM
asserts that), hence the ``*_capture*`` names of the spec.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from vllm_capture.capture_graph.state import CaptureGraphState
from vllm_capture.engine.config import EngineCaptureConfig
from vllm_capture.engine.instrument import WHERE_SITES_ARE, find_targets, instrument
from vllm_capture.engine.runners import wrap_runner
from vllm_capture.kernels.ops import register_op, set_site_handler
from vllm_capture.session import shm, wire
from vllm_capture.session.components import (COMPONENTS, HIDDEN_STATES, REPLICATED_COMPONENTS,
                                             ROUTER_LOGITS)
from vllm_capture.session.session import CaptureSession

logger = logging.getLogger("vllm_capture")
SESSION_ATTR = "_vllm_capture_session"


def _ring_bytes_per_row(cfg: EngineCaptureConfig, targets) -> int:
    """Device bytes that one row a step costs across ``targets``' rings (rows and labels)."""
    return sum((t.width * t.dtype.itemsize + 12) * cfg.ring_slots for t in targets)


def max_num_batched_tokens(vllm_config) -> int:
    return int(vllm_config.scheduler_config.max_num_batched_tokens)


def _capacity(cfg: EngineCaptureConfig, targets, vllm_config) -> int:
    """Rows per step per component: all rows of the largest step, or what the byte budget holds."""
    bytes_per_row = _ring_bytes_per_row(cfg, targets)
    max_tokens = max_num_batched_tokens(vllm_config)
    if bytes_per_row == 0 or cfg.buffer_bytes is None:
        return max_tokens
    capacity = max(1, min(max_tokens, cfg.buffer_bytes // bytes_per_row))
    if capacity < max_tokens:
        logger.warning(
            "vllm-capture: capture_buffer_bytes=%d holds %d rows per step, fewer than "
            "max_num_batched_tokens=%d: a step with more selected rows drops the rest (counted "
            "in tokens_dropped); %d bytes hold every row", cfg.buffer_bytes, capacity, max_tokens,
            bytes_per_row * max_tokens)
    return capacity


def _reduce_slots(cfg: EngineCaptureConfig, vllm_config) -> int:
    """Accumulator slots for last/mean reductions: as asked, else one per request that can run
    at once."""
    if cfg.reduce_slots is not None:
        return cfg.reduce_slots
    return int(vllm_config.scheduler_config.max_num_seqs)


def _buffers_do_not_fit(cfg: EngineCaptureConfig, targets, capacity: int, slots: int) -> str:
    ring_gib = _ring_bytes_per_row(cfg, targets) * capacity / 2**30
    # A slot holds a float32 row, its three labels and its count at each call site, and a row
    # in the site's dtype where the site stores last rows itself (hidden states).
    slot_gib = sum(t.width * 4 + 16 + (t.width * t.dtype.itemsize
                                       if t.component == HIDDEN_STATES else 0)
                   for t in targets) * slots / 2**30
    return (f"vllm-capture: its device rings, {ring_gib:.1f} GiB ({capacity} rows a step at each "
            f"of {len(targets)} call sites: by default every row of the largest step, "
            f"max_num_batched_tokens), and its {slots} reduction slots, {slot_gib:.1f} GiB "
            f"(capture_reduce_slots, max_num_seqs by default), do not fit beside the model; cap "
            f"them with capture_buffer_bytes and capture_reduce_slots, or capture fewer "
            f"capture_components")


def tp_rank_and_size() -> dict:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        return {"tp_rank": int(group.rank_in_group), "tp_size": int(group.world_size)}
    except (ImportError, AssertionError, AttributeError):
        return {"tp_rank": 0, "tp_size": 1}


# Config fields that give a mixture-of-experts model its experts (one of them, by family).
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def check_supported(vllm_config) -> None:
    """Refuse, at load, the engine configurations whose rows capture would get wrong or lose."""
    if vllm_config.speculative_config is not None:
        # Draft tokens are rows of the step that may be rejected and recomputed.
        raise ValueError("vllm-capture does not support speculative decoding (speculative_config)")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_dbo", False):
        raise ValueError("vllm-capture does not support dual-batch overlap (enable_dbo)")
    if getattr(parallel, "data_parallel_size", 1) > 1:
        # vLLM's client sends an RPC to every engine but returns the first engine's replies
        # only: a fetch would clear every engine's rows and hand back one engine's.
        raise ValueError(f"vllm-capture does not support data parallelism "
                         f"(data_parallel_size={parallel.data_parallel_size}): a fetch would "
                         f"return one engine's rows and drop the others'")
    pass_config = getattr(vllm_config.compilation_config, "pass_config", None)
    for flag in ("enable_sp", "fuse_gemm_comms"):
        if getattr(pass_config, flag, False):
            # Sequence parallelism shards the residual stream by token: a rank's rows would no
            # longer be the step's rows.
            raise ValueError(f"vllm-capture needs compilation_config.pass_config.{flag}=False")


def install(worker) -> CaptureSession | None:
    cfg = EngineCaptureConfig.from_vllm_config(worker.vllm_config)
    if cfg is None:
        return None
    runner = worker.model_runner
    check_supported(worker.vllm_config)
    started = time.perf_counter()
    model = runner.get_model()
    model_config = worker.vllm_config.model_config
    targets = [t for t in find_targets(model, model_config.get_hidden_size(), model_config.dtype)
               if t.component in cfg.components]
    hf_config = model_config.hf_text_config
    moe = any(getattr(hf_config, key, None) for key in MOE_CONFIG_KEYS)
    for component in sorted(set(cfg.components) - {t.component for t in targets}):
        if component == ROUTER_LOGITS and not moe:
            continue  # a dense model: no router to find
        logger.warning("vllm-capture: %s has no %s call sites (%s); start_capture of that stream "
                       "will fail", type(model).__name__, component, WHERE_SITES_ARE[component])
    device = next(model.parameters()).device
    capacity = _capacity(cfg, targets, worker.vllm_config)
    slots = _reduce_slots(cfg, worker.vllm_config)
    state = CaptureGraphState(device=device, capacity=capacity, ring_slots=cfg.ring_slots,
                              acc_slots=slots,
                              max_tokens=max_num_batched_tokens(worker.vllm_config))
    try:
        instrument(targets, state)  # allocates the hidden states' last-row tensors
        state.allocate()
    except torch.OutOfMemoryError as exc:
        raise torch.OutOfMemoryError(_buffers_do_not_fit(cfg, targets, capacity, slots)) from exc
    # vLLM sizes the KV cache from memory measured while weights load and during profiling;
    # buffers allocated in between are invisible to it unless counted as model memory.
    if hasattr(runner, "model_memory_usage"):
        runner.model_memory_usage += state.allocation_bytes
    layouts = {c: {} for c in COMPONENTS}
    for t in targets:
        layouts[t.component][t.layer_id] = dict(t.layout)
    # Hidden states and router logits are replicated across tensor-parallel ranks: rank 0
    # captures them, the other ranks keep the call sites (same graphs) with the kernels idle.
    rank = tp_rank_and_size()["tp_rank"]
    session = CaptureSession(state, layouts,
                             rank0_only=() if rank == 0 else REPLICATED_COMPONENTS)
    state.set_input_ids(wrap_runner(runner, session))  # starts compiling the kernel variants
    set_site_handler(state.handle)
    setattr(worker, SESSION_ATTR, session)
    session.startup_ms["install"] = round((time.perf_counter() - started) * 1e3, 1)
    logger.info("vllm-capture: %d call sites instrumented (%s), %d rows/step, %.1f MiB of buffers",
                len(targets), ", ".join(f"{c}={sum(t.component == c for t in targets)}"
                                        for c in cfg.components),
                state.capacity, state.allocation_bytes / 2**20)
    return session


def _patch_load_model() -> None:
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker.load_model, "_vllm_capture", False):
        return
    original = Worker.load_model

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        install(self)
        return result

    load_model._vllm_capture = True
    Worker.load_model = load_model


def _share_vllm_log_handlers() -> None:
    """Log through vLLM's handlers, so capture messages appear beside the engine's."""
    ours, theirs = logging.getLogger("vllm_capture"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for handler in theirs.handlers:
            ours.addHandler(handler)
        ours.setLevel(theirs.level or logging.INFO)
        ours.propagate = False


register_op()
_patch_load_model()
_share_vllm_log_handlers()


ERROR_TAG = "[vllm-capture {kind}] "


def _tagged_errors(method):
    """Tag errors with their type: vLLM hands worker errors to the client as a bare Exception
    carrying only the message, and the client (``api.raise_rpc_error``) raises a ValueError (for
    a ValueError or KeyError) or a RuntimeError again."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (ValueError, RuntimeError, KeyError) as exc:
            kind = "ValueError" if isinstance(exc, (ValueError, KeyError)) else "RuntimeError"
            raise type(exc)(ERROR_TAG.format(kind=kind) + str(exc)) from exc

    return wrapper


class CaptureWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker."""

    def _capture_session(self) -> CaptureSession:
        session = getattr(self, SESSION_ATTR, None)
        if session is None:
            raise RuntimeError(
                "this engine was built without capture: pass "
                "additional_config={'capture': {...}} (use vllm_capture.LLM or "
                "vllm_capture.engine_kwargs; for a server, --additional-config "
                "'{\"capture\": {}}')")
        return session

    @_tagged_errors
    def start_capture(self, stream: str, config: dict | None = None) -> dict:
        session = self._capture_session()
        if config is not None and not isinstance(config, dict):
            raise ValueError(f"config: expected a dict of StreamConfig arguments, got {type(config).__name__}")
        session.enable_stream(stream, **(config or {}))
        return {**tp_rank_and_size(), **session.stream_status(stream)}

    @_tagged_errors
    def stop_capture(self, stream: str) -> dict:
        session = self._capture_session()
        session.disable_stream(stream)
        if not session.any_stream_enabled():
            shm.drop_spare()
        return tp_rank_and_size()

    @_tagged_errors
    def fetch_captured(self, stream: str, clear: bool = True, layers: list | None = None,
                       req_ids: list | None = None, shm_probe: dict | None = None,
                       bytes_as_text: bool = False) -> dict:
        """``bytes_as_text``: the reply crosses JSON (a server's ``/collective_rpc``), so its
        bytes ride as base64 text (``wire.bytes_as_text``)."""
        session = self._capture_session()
        t0 = time.perf_counter()
        # Rows go through shared memory only when this worker can read the client's probe file.
        shared, owner = shm.worker_sees(shm_probe), shm.client_owner(shm_probe)
        probe_s = time.perf_counter() - t0

        def build(data):
            # Called under the store's lock, before a clear removes the fetched rows: a reply
            # that fails here leaves them stored.
            reply = {**tp_rank_and_size(), "layers": {str(k): v for k, v in data.items()}}
            t0 = time.perf_counter()
            parts = {"file": probe_s}  # the probe decides whether there is a file
            reply = shm.write_reply(reply, shared=shared, owner=owner, parts=parts)
            session.add_host_time("fetch_write", time.perf_counter() - t0 + probe_s)
            for part, seconds in parts.items():
                session.add_host_time(f"fetch_write_{part}", seconds)
            return wire.bytes_as_text(reply) if bytes_as_text else reply

        with torch.inference_mode():
            reply = session.fetch_stream(stream, clear=clear, layers=layers, req_ids=req_ids,
                                         raw_data=True, build=build)
        # This client's next fetch finds its reply file populated while the rows arrived.
        session.on_stored = (functools.partial(shm.want_spare, owner=owner) if shared and owner
                             else None)
        return reply

    @_tagged_errors
    def clear_captured(self, stream: str) -> dict:
        self._capture_session().clear_stream(stream)
        return tp_rank_and_size()

    @_tagged_errors
    def capture_status(self, stream: str) -> dict:
        return {**tp_rank_and_size(), **self._capture_session().stream_status(stream)}
