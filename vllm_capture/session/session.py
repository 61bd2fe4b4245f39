"""CaptureSession: one worker's streams, requests and step lifecycle.

The engine glue calls, per real step: ``observe_scheduler_output`` (requests that joined, finished
or were preempted), ``begin_step(step)`` (plan every enabled stream and upload the plans), the
model forward (the op writes rows on the device), then ``end_step()``. Rows of many steps gather in
the device ring and leave it in one drain (``CaptureGraphState.drain_due``; also before the ring
wraps and before anything reads a store: fetch, status, clear, stop). Drained rows reach the stores
on a harvest thread, in step order, so the step path never waits for a copy. Request-finish markers
travel through the same queue, after the drain that carries the request's last rows, so a finished
request's label index is only recycled after every row of it has been stored.
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from vllm_capture.kernels import layout as L
from vllm_capture.selection import (
    BatchGeometry,
    DecodeRepeat,
    RequestTrack,
    SelectSpec,
    Skipped,
    StepBuffers,
    plan_rows,
    plan_segments,
)
from vllm_capture.session.components import COMPONENTS
from vllm_capture.session.config import (STREAM_OPTIONS, StreamConfig, storage_dtype_name,
                                         warn_if_unbounded)
from vllm_capture.session.shm import WRITE_PARTS
from vllm_capture.session.store import StreamStore, check_fetch_filters

logger = logging.getLogger("vllm_capture")

# The key in SamplingParams.extra_args that carries a per-request selection.
EXTRA_ARGS_KEY = "capture"

# The harvest thread stores drained steps in batches: one store append per layer for many steps,
# because its Python work holds the GIL the step path needs. A batch is stored when its host rows
# reach HARVEST_BATCH_BYTES, when it holds HARVEST_BATCH_ITEMS queue items, when the queue has been
# idle for HARVEST_IDLE_S, or when the session waits for the harvest (fetch, status, stop). A
# stream holds at most HARVEST_BATCH_ITEMS finish markers for its next fetch (Stream.held).
HARVEST_BATCH_BYTES = 32 << 20
HARVEST_BATCH_ITEMS = 64
HARVEST_IDLE_S = 0.02


class _GCTimer:
    """Seconds this process spent in Python's garbage collector (every thread waits for it), for
    ``host_timers["gc_ms"]`` (from the first real step): a collection of a large heap is a pause
    no stage timer explains."""

    def __init__(self):
        self.seconds = 0.0
        self._start: float | None = None
        gc.callbacks.append(self._phase)

    def _phase(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self._start = None


_gc_timer = _GCTimer()


@dataclass
class RequestInfo:
    """What the worker learns about a request when it is first scheduled."""

    prompt_token_ids: tuple[int, ...]
    # stream -> its SelectSpec (decoded once, interned); "*" applies to every stream.
    selects: dict[str, SelectSpec] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Stream:
    """An enabled stream: its store, planner tracks and accumulator slots."""

    component: str
    config: StreamConfig
    store: StreamStore
    tracks: dict[str, RequestTrack] = field(default_factory=dict)
    free_slots: list[int] = field(default_factory=list)
    slots: dict[str, int] = field(default_factory=dict)  # req_id -> accumulator slot
    # Per accumulator slot: its request's label index, and the position of the last row reduced
    # into it (-1: none yet). Arrays, so a step's segments update them without a Python loop.
    slot_req_index: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    slot_last_position: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    # Requests this stream will not track again: failed, or reduced and closed by a fetch.
    closed: set[str] = field(default_factory=set)
    # Reductions a fetch closed before the worker heard that their request finished, each with
    # the first position it did not take: rows the request computes from there are not reduced,
    # and count as dropped. Rows it recomputes below it, after a preemption, do not count: the
    # reduction took them, or never wanted them (below a prefix-cache hit it started on, or
    # before the stream started). A clear leaves the marks.
    cut: dict[str, int] = field(default_factory=dict)
    # reduce="all": the steps whose rows wait in the device ring, as planned; and finish markers
    # of requests whose rows may be among them.
    pending_steps: list[PendingStep] = field(default_factory=list)
    pending_finishes: list = field(default_factory=list)
    # reduce="last"/"mean": requests whose reductions are closed, their rows still in their
    # accumulator slots (req_id -> slot), and the finish markers that must follow those rows into
    # the store, held for the next fetch. A generate's requests finish in its last step or two
    # (vLLM reported 1 of 16 equal requests a step before the rest); the fetch reads every slot
    # in one device gather and stores the rows on its own thread, in one append whose host copy
    # the store keeps (_read_finished). On the H200, storing them elsewhere cost the fetch:
    # - handed to the harvest thread, 8-14 ms of wall time to store a 32-layer reduction
    #   (contending for the GIL with the engine's end of the generate), while the fetch waited;
    # - read at each step where requests finished and stored by the fetch, 10-13 ms for 8B, where
    #   joining two steps' host copies (16.8 MB) ran on one thread into fresh pages.
    # The rows go to the harvest thread instead when new requests need slots (more of the
    # generate, or the next one), past a harvest batch of markers, and when anything else needs
    # the store (_queue_held).
    finished: dict[str, int] = field(default_factory=dict)
    held: list = field(default_factory=list)
    # The last step, if the next one may repeat it (steady decode); dropped, and its positions
    # written back, whenever tracks change (_drop_repeat).
    repeat: DecodeRepeat | None = None

    @property
    def reduce_mode(self) -> int:
        return {"all": L.MODE_ROWS, "last": L.MODE_LAST, "mean": L.MODE_MEAN}[self.config.reduce]


class PendingStep(NamedTuple):
    """A step's rows in the device ring, as planned: each row's label index, and its condition
    (None: every row unconditional; else -1 or an index into ``conditions``)."""

    req_index: np.ndarray
    condition: np.ndarray | None
    conditions: list


@dataclass
class _Drained:
    stream: Stream
    rows: Any  # DrainedRows
    condition: np.ndarray | None
    conditions: list
    # The drain's order: its row i is planned row ``order[i]`` (None: rows as planned).
    order: np.ndarray | None = None


@dataclass
class _Reduced:
    stream: Stream
    req_ids: list[str]
    req_index: list[int]
    positions: list[int]
    acc: Any  # DrainedRows: layer_id -> (reduced rows, labels, counts)


@dataclass
class _Finish:
    """Requests of one stream that finished in one step (one queue item for all of them: each
    put wakes the harvest thread, which then contends for the GIL with the step path)."""

    store: StreamStore
    req_ids: list[str]


class _Opened:
    """Queue sentinel: reductions were opened, so the next fetch will be larger than the store
    (the harvest thread reports it, ``on_stored``)."""


class _Flush:
    """Queue sentinel: store whatever the harvest thread holds (``_wait_harvest``)."""


class _Stop(_Flush):
    """Queue sentinel: store what is held, then end the harvest thread (interpreter exit)."""


class CaptureSession:
    """Owns capture streams for one worker's model (see the spec's CaptureSession)."""

    def __init__(self, graph_state=None, layouts: dict[str, dict[int, dict[str, int]]] | None = None,
                 rank0_only: tuple[str, ...] = ()):
        self.graph_state = graph_state
        # Streams another rank captures: enabled here (same requests, same plans) with the
        # kernels left idle, so this rank copies nothing and fetches return no rows.
        self._rank0_only = frozenset(rank0_only)
        self._layouts = layouts or {name: {} for name in COMPONENTS}
        self._streams: dict[str, Stream | None] = dict.fromkeys(COMPONENTS)
        # The enabled streams, kept beside _streams: every step reads them (twice), and on the
        # CPU VM building the list each time was a fifth of a repeated step's host time.
        self._active_streams: tuple[Stream, ...] = ()
        self._requests: dict[str, RequestInfo] = {}
        self._unsupported_requests: dict[str, str] = {}
        self._step_executions_baseline: int | None = None
        self._eager_forwards = 0
        # Host time the step path spends in capture code (begin/end of a step, finished
        # requests); "begin_repeat" is the part of begin_step spent on steps that planned
        # nothing (every stream repeated its last step: steady decode), over repeat_steps.
        # "harvest" is the harvest thread's (off the step path, but it shares the GIL), of which
        # "harvest_sync" waited for device-to-host copies to finish (a fetch storing reductions
        # itself adds its wait there too); "harvest_cpu" is the CPU time the thread spent in it
        # (harvest far above harvest_cpu: it waited, for the GIL or a lock, beyond those copies).
        # The fetch_* stages are a fetch's, in the worker: closing the reductions still open and
        # enqueueing the read of every closed one (finalize), enqueueing the copy of the rings'
        # pending rows, waiting for the harvest thread to store everything, storing the
        # reductions the fetch read (store), planning the rows (serialize) and
        # copying them out (write, timed by the caller), of which write_file found and prepared
        # the reply file, write_copy copied the rows, write_keep kept or let go of mappings and
        # write_release let go of the rows' sources, using release_cpu of CPU time
        # (shm.WRITE_PARTS).
        self._host_s = {"begin_step": 0.0, "begin_repeat": 0.0, "end_step": 0.0,
                        "finish_requests": 0.0,
                        "harvest": 0.0, "harvest_sync": 0.0, "harvest_cpu": 0.0,
                        "fetch_finalize": 0.0, "fetch_drain": 0.0, "fetch_wait": 0.0,
                        "fetch_store": 0.0, "fetch_serialize": 0.0, "fetch_write": 0.0,
                        **{f"fetch_write_{part}": 0.0 for part in WRITE_PARTS}}
        # From the first real step: vLLM's start-up (compiling, graph capture) collects for
        # seconds, which no step paid.
        self._gc_baseline: float | None = None
        self._host_steps = 0
        self._repeat_steps = 0
        # What capture added to the engine's start, by part (the worker fills it in at load;
        # graph copies are in the graph_nodes status).
        self.startup_ms: dict[str, float] = {}
        # Told, after the harvest thread stores rows or reductions open, the most bytes a fetch
        # of one active stream would carry (the worker prepares its reply file, shm.want_spare).
        self.on_stored: Callable[[int], None] | None = None
        self._queue: queue.Queue = queue.Queue()
        self._harvester = threading.Thread(target=self._harvest_loop, name="vllm-capture-harvest",
                                           daemon=True)
        self._harvester.start()
        # A daemon thread still working with tensors when the interpreter shuts down aborts the
        # process (exit code 134), so the thread is ended first.
        atexit.register(self._stop_harvest)
        self._harvest_error: BaseException | None = None

    # ---- components -----------------------------------------------------------------------------

    def hooked_layers(self, stream: str) -> set[int]:
        if self.graph_state is None:
            return set()
        return {s.layer_id for s in self.graph_state.sites_of(stream)}

    # ---- stream control (RPCs) ------------------------------------------------------------------

    def _check_stream(self, stream) -> None:
        if not isinstance(stream, str) or stream not in self._streams:
            raise ValueError(f"stream: unknown capture stream {stream!r}; choose one of "
                             f"{list(COMPONENTS)}")

    def enable_stream(self, stream: str, **config_kwargs) -> None:
        self._check_stream(stream)
        if self.graph_state is None or not self.graph_state.ready:
            raise RuntimeError(
                "Capture hooks are not attached to this model; attachment happens once at model "
                "load (build the engine with vllm_capture.LLM or vllm_capture.engine_kwargs)."
            )
        unknown = sorted(set(config_kwargs) - STREAM_OPTIONS)
        if unknown:
            raise ValueError(f"unknown stream option(s) {unknown}; StreamConfig takes "
                             f"{sorted(STREAM_OPTIONS)}")
        config = StreamConfig(**config_kwargs)
        warn_if_unbounded(config)
        available = self.hooked_layers(stream)
        if not available:
            raise ValueError(
                f"stream {stream!r}: this model has no instrumented {stream} call sites "
                f"(instrumented components: {[c for c in COMPONENTS if self.hooked_layers(c)]})"
            )
        if config.layers is not None and config.layers - available:
            raise ValueError(
                f"layers: {sorted(config.layers - available)} are not available for {stream!r}; "
                f"available layers are {sorted(available)}"
            )
        self.disable_stream(stream)
        st = Stream(stream, config, StreamStore(config))
        st.free_slots = list(range(self.graph_state.acc_slots - 1, -1, -1))
        # Slots are zeroed as they are read (read_acc_slots), not as they are handed out; an
        # earlier stream of this component may have left any of them written.
        self.graph_state.reset_acc_slots(stream)
        st.slot_req_index = np.zeros(self.graph_state.acc_slots, dtype=np.int32)
        st.slot_last_position = np.full(self.graph_state.acc_slots, -1, dtype=np.int64)
        self._set_stream(stream, st)
        self.graph_state.set_enabled(stream, set() if stream in self._rank0_only else config.layers,
                                     last=config.reduce == "last")

    def disable_stream(self, stream: str) -> None:
        self._check_stream(stream)
        if self._streams[stream] is not None:
            self._wait_harvest()
            self.graph_state.set_enabled(stream, set())
            self._set_stream(stream, None)

    def _set_stream(self, stream: str, st: Stream | None) -> None:
        self._streams[stream] = st
        self._active_streams = tuple(s for s in self._streams.values() if s is not None)

    def fetch_stream(self, stream: str, clear: bool = True, layers: list[int] | None = None,
                     req_ids: list[str] | None = None, raw_data: bool = False,
                     build: Callable[[dict], Any] | None = None) -> Any:
        """The stream's rows as ``{layer: wire dict}``, or what ``build`` makes of them: the
        reply, built before ``clear`` removes any row, so that a reply that fails to build
        (say, no memory for its file) leaves every row for the next fetch."""
        self._check_stream(stream)
        if not isinstance(clear, bool):
            raise ValueError(f"clear: expected True or False, got {clear!r}")
        check_fetch_filters(layers, req_ids)  # before the fetch closes any open reduction
        st = self._streams[stream]
        if st is None:
            return {} if build is None else build({})
        t0 = time.perf_counter()
        # A fetch that will be refused changes nothing: no reduction is cut for it.
        captured = st.config.layers if st.config.layers is not None else self.hooked_layers(stream)
        if layers is not None and set(layers) - captured:
            raise ValueError(f"layers: {sorted(set(layers) - captured)} are not captured by "
                             f"stream {stream!r}; it captures {sorted(captured)}")
        st.store.check_servable(req_ids)
        if st.config.reduce != "all":
            # Reductions of requests still open close now (capture() fetches after generate()
            # returned, when every request is done; vLLM tells the worker they finished only
            # with its next step), and are read with those closed before.
            st.cut.update(self._close(st, [r for r in list(st.slots)
                                           if req_ids is None or _matches_any(r, req_ids)]))
        reduced = self._read_finished(st)
        held, st.held = st.held, []
        if reduced is not None:
            held.insert(0, reduced)  # before the finish markers held after its rows
        t1 = time.perf_counter()
        try:
            self._drain_all()
            t_drain = time.perf_counter()
            self._await_harvest()
        except BaseException:
            st.held = held + st.held  # read, slots freed: stored at the next fetch, not lost
            raise
        t_store = time.perf_counter()
        if held:
            # Stored on this thread, after everything queued before them: handed to the harvest
            # thread, they would cost the same work plus its wake-up and the GIL's hand-overs.
            try:
                self._store_batch(held)
            except BaseException as exc:
                _mark_lost(held, f"storing the reductions a fetch read failed: {exc!r}")
                raise
        t2 = time.perf_counter()

        # Serialize, build the reply and remove under one store lock: rows the harvest thread
        # appends meanwhile stay for the next fetch instead of being cleared unseen.
        build_s = [0.0]  # the reply's own timers count its building

        def finish(result):
            for layer, info in result.items():
                layout = self._layouts.get(stream, {}).get(layer)
                if layout:
                    info["layout"] = dict(layout)
            if build is None:
                return result
            started = time.perf_counter()
            try:
                return build(result)
            finally:
                build_s[0] = time.perf_counter() - started

        out = st.store.serialize(layers=layers, req_ids=req_ids, clear_selected=clear,
                                 raw_data=raw_data, build=finish)
        self._host_s["fetch_finalize"] += t1 - t0
        self._host_s["fetch_drain"] += t_drain - t1
        self._host_s["fetch_wait"] += t_store - t_drain
        self._host_s["fetch_store"] += t2 - t_store
        self._host_s["fetch_serialize"] += time.perf_counter() - t2 - build_s[0]
        return out

    def add_host_time(self, name: str, seconds: float) -> None:
        """Count ``seconds`` of capture work done outside the session (``host_timers``)."""
        self._host_s[name] += seconds

    def clear_stream(self, stream: str) -> None:
        self._check_stream(stream)
        st = self._streams[stream]
        if st is not None:
            self._wait_harvest()
            # A failed request that still runs stays failed: none of its later rows come. A mean
            # whose request skipped positions stays elided: its open reduction lacks them.
            st.store.clear(still_failed=st.closed,
                           still_elided=st.slots if st.config.reduce == "mean" else ())

    def stream_status(self, stream: str) -> dict[str, Any]:
        self._check_stream(stream)
        gs = self.graph_state
        execution = {
            "layouts": {int(k): dict(v) for k, v in self._layouts.get(stream, {}).items()},
            "graph_ready": bool(gs is not None and gs.ready),
            "graph_buffer_bytes": 0 if gs is None else int(gs.buffer_bytes),
            "graph_allocation_bytes": 0 if gs is None else int(gs.allocation_bytes),
            "graph_replays": self.graph_replays(),
            "eager_capture_forwards": self.eager_capture_forwards(),
            # Capture nodes in captured graphs, and how many are switched off (idle sites).
            "graph_nodes": (None if gs is None or gs.nodes is None else gs.nodes.status()),
            "startup_ms": {**self.startup_ms, **({} if gs is None else gs.startup_ms)},
            # plan_uploads: host-to-device plan copies; steady decode repeats its plan and
            # copies none, so far fewer than steps. last_row_uploads: copies of the last-row
            # stores' dest, made only with a plan that changed it.
            "host_timers": {"steps": self._host_steps, "repeat_steps": self._repeat_steps,
                            "plan_uploads": 0 if gs is None else gs.plan_uploads,
                            "last_row_uploads": 0 if gs is None else sum(
                                plan.uploads for plan in gs.last_row_plans.values()),
                            "plan_steps": 0 if gs is None else gs.plan_steps,
                            **{f"{k}_ms": round(v * 1e3, 3) for k, v in self._host_s.items()},
                            "gc_ms": 0.0 if self._gc_baseline is None else
                            round((_gc_timer.seconds - self._gc_baseline) * 1e3, 3)},
        }
        st = self._streams[stream]
        hooked = len(self.hooked_layers(stream))
        execution["dtypes"] = self._storage_dtypes(stream, st)
        if st is None:
            return {"enabled": False, "hooked_layers": hooked, **execution}
        self._wait_harvest()
        store_status = st.store.status()
        return {
            "enabled": True,
            "hooked_layers": hooked,
            "layers_captured": store_status["layers_captured"],
            "tokens_stored": store_status["tokens_stored"],
            "tokens_dropped": store_status["tokens_dropped"],
            "reduce": st.config.reduce,
            "select": st.config.select,
            # False once rows of the stream were lost before they were stored (rows_lost says
            # why): every fetch raises until the stream is cleared.
            "meta_complete": store_status["rows_lost"] is None,
            "rows_lost": store_status["rows_lost"],
            "cache_elided_reqs": store_status["cache_elided_reqs"],
            "failed_reqs": store_status["failed_reqs"],
            "pending_reductions": len(st.slots),
            **execution,
        }

    def _storage_dtypes(self, stream: str, st: Stream | None) -> dict[int, str]:
        """Each instrumented layer's storage dtype: the stream's own, else its site's ring's (the
        activation's: a float32 router beside a bfloat16 model), so that a result can hold an
        empty layer in the dtype its rows would have had."""
        if self.graph_state is None:
            return {}
        own = None if st is None else st.config.dtype
        return {site.layer_id: storage_dtype_name(own or site.dtype)
                for site in self.graph_state.sites_of(stream)}

    # ---- counters -------------------------------------------------------------------------------

    def _reference_site(self):
        return None if self.graph_state is None else self.graph_state.reference_site

    def eager_capture_forwards(self) -> int:
        """Real steps in which at least one capture launch ran from the op's Python body."""
        return self._eager_forwards

    def graph_replays(self) -> int:
        """Forwards of real steps in which the capture kernel ran inside a replayed CUDA graph.

        The device counts every launch of the reference site's kernel; launches made in eager
        mode are counted on the host; the difference since the first real step are replays.
        """
        site = self._reference_site()
        if site is None or self._step_executions_baseline is None:
            return 0
        executions = int(site.counter[L.SITE_EXECUTIONS].item())
        return max(0, executions - self._step_executions_baseline - site.eager_executions)

    # ---- request lifecycle ----------------------------------------------------------------------

    def add_request(self, req_id: str, prompt_token_ids, sampling_params=None) -> None:
        if req_id in self._requests:
            return  # resumed after preemption: keep the original prompt length
        # Every new request passes here, with or without a stream on (one may start while it
        # runs), so on an idle engine's step path: a plain copy of vLLM's list of ints (4 us for
        # 2,048 ids on the CPU VM; converting each id with int() took 180 us).
        info = RequestInfo(tuple(prompt_token_ids or ()))
        if not info.prompt_token_ids:
            self._unsupported_requests[req_id] = (
                "capture needs the prompt's token ids (prompt embeddings are not supported)")
        extra = getattr(sampling_params, "extra_args", None) or {}
        raw = extra.get(EXTRA_ARGS_KEY)
        if raw is not None:
            try:
                info.selects = _parse_request_selects(raw)
            except Exception as exc:  # a client's payload fails its request, never the engine
                self._unsupported_requests[req_id] = f"invalid extra_args[{EXTRA_ARGS_KEY!r}]: {exc}"
        self._requests[req_id] = info

    def finish_requests(self, req_ids) -> None:
        t0 = time.perf_counter()
        try:
            self._finish_requests(list(req_ids))
        finally:
            self._host_s["finish_requests"] += time.perf_counter() - t0

    def _finish_requests(self, req_ids: list[str]) -> None:
        for st in self._active_streams:
            self._close(st, req_ids)
            finished = [r for r in dict.fromkeys(req_ids) if r in st.tracks or r in st.closed]
            if not finished:
                continue
            self._drop_repeat(st)
            for req_id in finished:
                st.tracks.pop(req_id, None)
                st.closed.discard(req_id)
                st.cut.pop(req_id, None)
            if st.pending_steps:
                st.pending_finishes.append(_Finish(st.store, finished))
            elif st.finished or st.held:  # after the rows still to be stored, never before
                st.held.append(_Finish(st.store, finished))
            else:
                self._queue.put(_Finish(st.store, finished))
            if len(st.held) >= HARVEST_BATCH_ITEMS:
                self._queue_held(st)
        for req_id in req_ids:
            self._requests.pop(req_id, None)
            self._unsupported_requests.pop(req_id, None)

    def any_stream_enabled(self) -> bool:
        return bool(self._active_streams)

    @property
    def step_open(self) -> bool:
        return self.graph_state is not None and self.graph_state.step_active

    # ---- per step -------------------------------------------------------------------------------

    def begin_step(self, step: StepBuffers) -> None:
        t0 = time.perf_counter()
        planned = True
        try:
            planned = self._begin_step(step)
        finally:
            spent = time.perf_counter() - t0
            self._host_s["begin_step"] += spent
            self._host_steps += 1
            if not planned:
                self._host_s["begin_repeat"] += spent
                self._repeat_steps += 1

    def _begin_step(self, step: StepBuffers) -> bool:
        """Whether any stream planned this step (False: every one repeated its last)."""
        gs = self.graph_state
        planned = False
        if self._step_executions_baseline is None:
            site = self._reference_site()
            self._step_executions_baseline = (
                0 if site is None else int(site.counter[L.SITE_EXECUTIONS].item()) - site.eager_executions)
            self._gc_baseline = _gc_timer.seconds
        geometry = None  # built (and checked) only for a step that is planned
        for st in self._active_streams:
            repeat = st.repeat
            positions = None if repeat is None else repeat.advance(step)
            if positions is None:
                planned = True
                self._drop_repeat(st)
                if geometry is None:
                    geometry = step.geometry()
                self._open_tracks(st, geometry)
                plan = (plan_rows(geometry, st.tracks, gs.capacity) if st.config.reduce == "all"
                        else plan_segments(geometry, st.tracks, st.slots))
                for skipped in plan.skipped:
                    if self._selects_missing(st, st.tracks[skipped.req_id], skipped):
                        st.store.mark_elided(skipped.req_id)
                st.repeat = DecodeRepeat.after(geometry, st.tracks, plan)
            else:
                plan = repeat.plan
            if st.config.reduce == "all":
                if plan.dropped:
                    st.store.count_dropped(plan.dropped)
                if not gs.fits(st.component, len(plan.rows)):
                    self._drain(st)
                gs.upload_rows(st.component, plan.rows, plan.req_index,
                               plan.positions if positions is None else positions,
                               repeat=positions is not None)
                st.pending_steps.append(PendingStep(
                    plan.req_index, plan.condition if plan.conditions else None, plan.conditions))
            elif positions is None or not gs.holds_plan(st.component):
                # A repeated reduction's plan is the one on the device (unless a forward that
                # was not a step switched it off); its last positions are the repeat's to keep.
                if positions is None:
                    st.slot_last_position[plan.slot] = plan.last_position
                gs.upload_segments(st.component, st.reduce_mode, plan.row_start, plan.row_count,
                                   plan.slot, st.slot_req_index[plan.slot])
        gs.step_eager_launches = 0
        gs.step_active = True
        return planned

    def _drop_repeat(self, st: Stream) -> None:
        """Stop repeating ``st``'s last step: the tracks and reduction positions the repeat moved
        on are written back first."""
        repeat, st.repeat = st.repeat, None
        if repeat is None:
            return
        repeat.settle()
        if st.config.reduce != "all":
            st.slot_last_position[repeat.plan.slot] = repeat.last_positions()

    def switch_off(self) -> None:
        """Before a forward that is not a step (vLLM's dummy, profile and capture runs): the
        device plans go off, so that its replays capture nothing."""
        if self.graph_state is not None:
            self.graph_state.switch_off()

    def await_kernels(self) -> None:
        """Before vLLM captures graphs: the capture kernels compiled and loaded."""
        if self.graph_state is not None:
            self.graph_state.await_kernels()

    def end_step(self) -> None:
        t0 = time.perf_counter()
        try:
            self._end_step()
        finally:
            self._host_s["end_step"] += time.perf_counter() - t0

    def _end_step(self) -> None:
        gs = self.graph_state
        gs.step_active = False
        if gs.step_eager_launches:
            self._eager_forwards += 1
        for st in self._active_streams:
            if st.pending_steps and gs.drain_due(st.component):
                self._drain(st)

    def _drain(self, st: Stream) -> None:
        """Send the rows ``st`` holds in the device ring to the harvest thread, then the finish
        markers that waited for them."""
        steps, st.pending_steps = st.pending_steps, []
        # The rows leave the device grouped by request, in the order the store keeps them, so
        # the store keeps the host copy as it is. On the H200 host, copying drained rows into
        # that order on the harvest thread (fresh pages, four threads beside the step path) cost
        # the 1B's 4-layer capture 6% of its throughput (harvest_ablation.py).
        # Past the state's gather_bytes the rows leave as the ring holds them, and the store
        # puts them in its order on the host (a large drain, rare: a prefill step's, say).
        order = None
        if self.graph_state.gathers(st.component):
            owners = (np.concatenate([step.req_index for step in steps]) if steps
                      else np.zeros(0, np.int64))
            order = st.store.registration_order(owners)
            if np.all(order[1:] > order[:-1]):
                order = None  # already in that order
        try:
            drained = self.graph_state.drain(st.component, order)
        except BaseException as exc:  # say, no pinned memory for a prefill step's rows
            st.store.mark_lost(f"a drain of the device ring failed: {exc!r}")
            raise
        if drained is not None:
            condition, conditions = _merge_conditions(steps)
            if condition is not None and order is not None:
                condition = condition[order]
            self._queue.put(_Drained(st, drained, condition, conditions, order))
        for finish in st.pending_finishes:
            self._queue.put(finish)
        st.pending_finishes = []

    def _drain_all(self) -> None:
        for st in self._active_streams:
            if st.pending_steps:
                self._drain(st)

    def _queue_held(self, st: Stream) -> None:
        """Hand the closed reductions of ``st`` (and the finish markers after them) to the
        harvest thread, freeing their slots: something other than a fetch of this stream comes
        first."""
        reduced = self._read_finished(st)
        if reduced is not None:
            self._queue.put(reduced)
        for item in st.held:
            self._queue.put(item)
        st.held = []

    def _open_tracks(self, st: Stream, geometry: BatchGeometry) -> None:
        """Create planner tracks for requests this stream sees for the first time."""
        opened = False  # a reduction slot handed out (the next fetch grows: _Opened)
        unreduced = 0
        for i, req_id in enumerate(geometry.req_ids):
            if req_id in st.tracks:
                continue
            if req_id in st.closed:
                if req_id in st.cut:
                    start = int(geometry.num_computed[i])
                    end = start + int(geometry.query_start_loc[i + 1] - geometry.query_start_loc[i])
                    unreduced += max(0, end - max(start, st.cut[req_id]))
                    st.cut[req_id] = max(end, st.cut[req_id])
                continue
            info = self._requests.get(req_id)
            if info is None:
                continue  # warm-up or dummy request
            reason = self._unsupported_requests.get(req_id)
            if reason is None and st.store.holds_request(req_id):
                # An id vLLM did not make unique (VLLM_DISABLE_REQUEST_ID_RANDOMIZATION) given
                # again right after its first request: one label cannot tell their rows apart.
                reason = ("request id reused while the stream still holds rows of an earlier "
                          "request with that id (or has not yet released it): request ids must "
                          "be unique until their rows are fetched")
            select = None
            if reason is None:
                select = info.selects.get(st.component, info.selects.get("*"))
                if select is not None and st.config.reduce != "all":
                    reason = (f"a per-request selection cannot combine with reduce="
                              f"{st.config.reduce!r} on stream {st.component!r}")
                elif select is None:
                    select = st.config.select_spec
            if reason is not None:
                st.store.fail_request(req_id, reason)
                st.closed.add(req_id)
                continue
            track = RequestTrack(req_index=st.store.request_index(req_id),
                                 prompt_len=info.prompt_len,
                                 prompt_token_ids=info.prompt_token_ids,
                                 select=select, next_position=0)
            if st.config.reduce != "all":
                if st.finished:
                    # Their slots, for these requests (more of the generate, or a generate that
                    # began without a fetch); the held notices go with them, as only finished
                    # rows are ever held ahead of notices.
                    self._queue_held(st)
                if not st.free_slots:
                    st.store.fail_request(
                        req_id, f"more concurrent requests than reduce slots "
                                f"({self.graph_state.acc_slots}): a request holds one while it "
                                f"runs or waits preempted; capture_reduce_slots sets how many "
                                f"(max_num_seqs by default)")
                    st.closed.add(req_id)
                    continue
                slot = st.free_slots.pop()
                st.slots[req_id] = slot
                st.slot_req_index[slot] = track.req_index
                st.slot_last_position[slot] = -1
                opened = True
            st.tracks[req_id] = track
        if unreduced:
            st.store.count_dropped(unreduced)
        if opened and self.on_stored is not None:
            self._queue.put(_Opened())

    def _selects_missing(self, st: Stream, track: RequestTrack, skipped: Skipped) -> bool:
        """Whether the positions ``skipped`` (never computed here) held rows ``st`` wanted: a
        mean wants them all, a last row comes later anyway."""
        if st.config.reduce == "last":
            return False
        if st.config.reduce == "mean":
            return True
        return selects_positions_in(track, skipped.start, skipped.stop)

    def _close(self, st: Stream, req_ids: list[str]) -> dict[str, int]:
        """Close the reductions (last/mean) of ``req_ids`` still open: their rows wait in their
        accumulator slots (``st.finished``) for ``_read_finished``. Returns those it closed,
        each with the first position its reduction did not take."""
        closing = [r for r in dict.fromkeys(req_ids) if r in st.slots]
        if not closing:
            return {}
        self._drop_repeat(st)  # the tracks' high-water marks, as of the last step
        taken = {}
        for r in closing:
            st.finished[r] = st.slots.pop(r)
            # A request closed while still running (by a fetch) is not reduced again: its later
            # rows would otherwise start a second, partial reduction.
            track = st.tracks.pop(r, None)
            taken[r] = 0 if track is None else track.next_position
            st.closed.add(r)
        return taken

    def _read_finished(self, st: Stream) -> _Reduced | None:
        """The rows of every closed reduction of ``st``, one per request and layer, on their way
        to the host in one device gather, to be stored (None: there are none). Their slots are
        free again, zeroed on the main stream right after the gather (``read_acc_slots``)."""
        if not st.finished:
            return None
        req_ids = list(st.finished)
        slots = np.fromiter(st.finished.values(), dtype=np.int64, count=len(req_ids))
        st.finished = {}
        # Gathered in the store's order, the rows go in without a copy: on the H200 host,
        # reordering 8B's 16.8 MB on one thread into fresh pages took about 5 ms, and letting go
        # of those pages after the fetch 3-10 ms more (vLLM reports one request a step early).
        order = st.store.registration_order(st.slot_req_index[slots])
        req_ids, slots = [req_ids[i] for i in order], slots[order].tolist()
        mean = st.config.reduce == "mean"
        # A mean leaves the device in the stream's dtype where one is set: in the site's (the
        # model's) it would be rounded there, below the precision asked for. A last row is one
        # of the site's rows, exact in its dtype.
        drained = self.graph_state.read_acc_slots(st.component, slots, mean,
                                                  st.config.dtype if mean else None)
        positions = (st.slot_last_position[slots].tolist() if st.config.reduce == "last"
                     else [-1] * len(slots))
        st.free_slots.extend(slots)
        return _Reduced(st, req_ids, st.slot_req_index[slots].tolist(), positions, drained)

    # ---- harvest thread -------------------------------------------------------------------------

    def _wait_harvest(self) -> None:
        """Store every row captured so far: drain the device rings, then wait for the harvest."""
        for st in self._active_streams:
            self._queue_held(st)
        self._drain_all()
        self._await_harvest()

    def _await_harvest(self) -> None:
        """Wait until the harvest thread has stored everything queued so far."""
        if not self._harvester.is_alive():
            raise RuntimeError("capture session is shut down (the interpreter is exiting)")
        self._queue.put(_Flush())
        self._queue.join()
        if self._harvest_error is not None:
            err, self._harvest_error = self._harvest_error, None
            raise RuntimeError(f"capture harvest failed: {err!r}") from err

    def _harvest_loop(self) -> None:
        batch: list = []
        batch_bytes = 0
        while True:
            try:
                item = self._queue.get(timeout=HARVEST_IDLE_S if batch else None)
            except queue.Empty:
                item = None  # idle: store what is held
            if isinstance(item, _Opened):
                self._report_stored()
                self._queue.task_done()
                continue
            stop = isinstance(item, _Stop)
            if item is not None and not isinstance(item, _Flush):
                batch.append(item)
                batch_bytes += _item_bytes(item)
                if batch_bytes < HARVEST_BATCH_BYTES and len(batch) < HARVEST_BATCH_ITEMS:
                    continue
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                self._store_batch(batch)
            except BaseException as exc:  # surfaced at the next fetch/status
                logger.exception("vllm-capture harvest failed")
                self._harvest_error = exc
                _mark_lost(batch, f"the harvest failed: {exc!r}")
            finally:
                self._host_s["harvest"] += time.perf_counter() - t0
                self._host_s["harvest_cpu"] += time.thread_time() - c0
                done = len(batch) + isinstance(item, _Flush)
                if batch:  # before a fetch waiting on this batch goes on to take the spare
                    self._report_stored()
                # Free the batch's tensors before anyone waiting is released: a thread freeing
                # tensors while the interpreter shuts down aborts the process.
                batch, batch_bytes, item = [], 0, None
                for _ in range(done):
                    self._queue.task_done()
            if stop:
                return

    def _report_stored(self) -> None:
        on_stored = self.on_stored
        if on_stored is None:
            return
        try:
            on_stored(max((self._fetch_bytes(st) for st in self._active_streams), default=0))
        except Exception:  # a hint: the fetch works without it
            logger.warning("vllm-capture: on_stored failed", exc_info=True)

    def _fetch_bytes(self, st: Stream) -> int:
        """About what a fetch of ``st`` would carry: its store, and a row per enabled layer for
        each reduction open or closed but not yet read (read at the end of a generate, so that
        the reply file can grow while the generate runs, not while the fetch waits)."""
        held = st.store.bytes_stored
        if st.config.reduce != "all":
            reductions = len(st.slots) + len(st.finished)
            held += reductions * self.graph_state.streams[st.component].row_bytes
        return held

    def _wait_copy(self, rows) -> None:
        """Wait for a drain's device-to-host copy (harvest thread); counted as ``harvest_sync``."""
        t0 = time.perf_counter()
        rows.wait()
        self._host_s["harvest_sync"] += time.perf_counter() - t0

    def _stop_harvest(self) -> None:
        if self._harvester.is_alive():
            self._queue.put(_Stop())
            self._harvester.join(timeout=10)

    def _store_batch(self, batch: list) -> None:
        """Store a batch of queue items: drained rows first (one append per stream and layer
        set, rows in queue order), then reductions, then finished requests. Finishing a request
        only lets its label index be reused, so it may wait until after later rows; it must not
        come before its own rows, and never does here."""
        drained: dict[tuple, list] = {}
        for item in batch:
            if isinstance(item, _Drained):
                tensors, labels, arrival = self._drained_rows(item)
                key = (id(item.stream), tuple(tensors))
                drained.setdefault(key, []).append((item, tensors, labels, arrival))
        for parts in drained.values():
            item = parts[0][0]
            labels = _joined([p[2] for p in parts])
            tensors = {layer: _joined([p[1][layer] for p in parts]) for layer in parts[0][1]}
            arrival = None
            if any(p[3] is not None for p in parts):
                # Each part's rows after the earlier parts' (a budget keeps the earliest).
                offsets = np.cumsum([0] + [len(p[2]) for p in parts])
                arrival = np.concatenate([
                    offset + (np.arange(len(p[2])) if p[3] is None else p[3])
                    for offset, p in zip(offsets, parts)])
            # The drain's host copies were made for this append alone: the store may keep them.
            item.stream.store.append_layers(tensors, labels, item.rows.layer_names, adopt=True,
                                            arrival=arrival)
        reduced: dict[int, list[_Reduced]] = {}
        for item in batch:
            if isinstance(item, _Reduced):
                reduced.setdefault(id(item.stream), []).append(item)
        for items in reduced.values():
            self._store_reduced(items)
        for item in batch:
            if isinstance(item, _Finish):
                item.store.finish_requests(item.req_ids)

    def _drained_rows(self, item: _Drained
                      ) -> tuple[dict[int, torch.Tensor], torch.Tensor, np.ndarray | None]:
        """``({layer: rows}, labels, arrival)`` of one drain, with conditional rows decided;
        ``arrival`` is each row's place in the planned order (None: they are in it)."""
        rows = item.rows
        self._wait_copy(rows)
        # Every layer of a drain carries the same rows and one labels tensor.
        labels = next(iter(rows.layers.values()))[1]
        tensors = {layer_id: tensor for layer_id, (tensor, _) in rows.layers.items()}
        arrival = item.order
        if item.condition is not None:
            tokens = labels[:, L.LABEL_TOKEN].numpy()
            keep = item.condition < 0
            for c, condition in enumerate(item.conditions):
                mine = item.condition == c
                keep[mine] = condition.accepts_array(tokens[mine])
            # Ranks among the rows kept: _store_batch places a later drain's rows after them.
            arrival = None if arrival is None else arrival[keep].argsort().argsort()
            keep = torch.from_numpy(keep)
            labels = labels[keep]
            tensors = {layer_id: tensor[keep] for layer_id, tensor in tensors.items()}
        return tensors, labels, arrival

    def _store_reduced(self, items: list[_Reduced]) -> None:
        """Store one stream's read reductions, in queue order. Layers holding rows for the
        same requests (in practice every layer of the stream) go into the store in one append
        for all of ``items``: labels checked and rows grouped by request once, not once per layer
        and step, and each layer's rows of a generate land in one chunk, which a fetch takes
        whole."""
        stream = items[0].stream
        mean = stream.config.reduce == "mean"
        # layer -> [(which rows: item and labels, live mask), labels of those rows, rows]
        parts: dict[int, list[tuple[tuple, torch.Tensor, torch.Tensor]]] = {}
        names: dict[int, str] = {}
        for n, item in enumerate(items):
            self._wait_copy(item.acc)
            req_index = torch.tensor(item.req_index, dtype=torch.int32)
            positions = torch.tensor(item.positions, dtype=torch.int32)
            metas: dict[tuple, torch.Tensor] = {}
            layers = list(item.acc.layers.items())
            if not layers:
                continue  # no layer enabled on this rank
            # Layers where some request reduced no row (one check for all of them).
            partial = torch.stack([counts for _, (_, _, counts) in layers]).eq(0).any(dim=1)
            for (layer_id, (values, acc_labels, counts)), holes in zip(layers, partial.tolist()):
                live = counts != 0 if holes else None  # None: every reduction holds rows
                key = (n, id(acc_labels), None if live is None else live.numpy().tobytes())
                if key not in metas:
                    meta = torch.empty((len(item.req_ids), 3), dtype=torch.int32)
                    meta[:, 0] = req_index
                    meta[:, 1] = positions
                    meta[:, 2] = -1 if mean else acc_labels[:, 2]
                    metas[key] = meta if live is None else meta[live]
                parts.setdefault(layer_id, []).append(
                    (key, metas[key], values if live is None else values[live]))
                names[layer_id] = item.acc.layer_names[layer_id]
        appends: dict[tuple, tuple[list[torch.Tensor], dict[int, list[torch.Tensor]]]] = {}
        for layer_id, entries in parts.items():
            keys = tuple(key for key, _, _ in entries)
            if keys not in appends:
                appends[keys] = ([meta for _, meta, _ in entries], {})
            appends[keys][1][layer_id] = [rows for _, _, rows in entries]
        # The host copies of the reductions were made for this append: the store may keep them.
        for metas_of, rows_of in appends.values():
            stream.store.append_layers(
                {layer: _joined(rows) for layer, rows in rows_of.items()}, _joined(metas_of),
                {layer: names[layer] for layer in rows_of}, adopt=True)


def _mark_lost(batch: list, reason: str) -> None:
    """After ``batch`` failed to store: which of its rows were stored is not known, so each
    stream it fed refuses fetches until cleared."""
    for store in {s for s in map(_item_store, batch) if s is not None}:
        store.mark_lost(reason)


def _item_store(item) -> StreamStore | None:
    """The store a harvest item feeds (None: an item that stores nothing)."""
    if isinstance(item, _Finish):
        return item.store
    stream = getattr(item, "stream", None)
    return None if stream is None else stream.store


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _merge_conditions(steps: list[PendingStep]) -> tuple[np.ndarray | None, list]:
    """One (condition, conditions) for the rows of several steps, renumbering each step's
    conditions after the ones before it; ``None`` when every row is unconditional."""
    if all(step.condition is None for step in steps):
        return None, []
    parts, merged = [], []
    for step in steps:
        if step.condition is None:
            parts.append(np.full(len(step.req_index), -1, dtype=np.int32))
        else:
            parts.append(np.where(step.condition >= 0, step.condition + len(merged), step.condition))
            merged.extend(step.conditions)
    return np.concatenate(parts).astype(np.int32, copy=False), merged


def _item_bytes(item) -> int:
    """Host bytes a queue item holds (pinned staging of drained rows or reductions)."""
    if isinstance(item, _Drained):
        return sum(t.numel() * t.element_size() for t, _ in item.rows.layers.values())
    if isinstance(item, _Reduced):
        return sum(a.numel() * a.element_size() for a, _, _ in item.acc.layers.values())
    return 0


def selects_positions_in(track: RequestTrack, start: int, stop: int) -> bool:
    """Whether ``track``'s selection wants any position in ``[start, stop)``.

    Reuses the planner on a synthetic one-request step covering those positions, so the answer
    follows exactly the rules that plan real steps. Generated tokens there are not known, so a
    row whose selection depends on its token counts as wanted.
    """
    rows = stop - start
    if rows <= 0:
        return False
    prompt = np.asarray(track.prompt_token_ids or (), dtype=np.int32)[start:stop]
    token_ids = np.full(rows, -1, dtype=np.int32)
    token_ids[:len(prompt)] = prompt
    geometry = BatchGeometry(
        req_ids=("probe",),
        query_start_loc=np.array([0, rows], dtype=np.int32),
        num_computed=np.array([start], dtype=np.int64),
        num_rows_padded=rows,
        token_ids=token_ids,
    )
    probe = replace(track, next_position=start)
    plan = plan_rows(geometry, {"probe": probe}, rows)
    return len(plan.rows) > 0 or plan.dropped > 0


# Payloads decoded on the step path, by their text (a small clause took 31 us to decode on the
# CPU VM, one of 1,000 prompt tokens 275 us; its text 5 us to write, none for a JSON string).
_DECODED_SELECTS: dict[str, dict[str, SelectSpec]] = {}
DECODED_SELECTS_KEPT = 1024


def _parse_request_selects(raw) -> dict[str, SelectSpec]:
    """``extra_args["capture"]``: a SelectSpec wire dict, or {stream: wire dict}, or either as a
    JSON string (the OpenAI-compatible server's ``vllm_xargs`` only carries scalars and lists),
    decoded once: the request's tracks take the specs as they are, and requests that carry the
    same payload share them (it is decoded once for all of them). ValueError on a bad one."""
    try:
        # JSON text tells apart what decodes apart (True from 1, 1.0 from 1); lists and tuples,
        # which it does not, decode alike.
        key = raw if isinstance(raw, str) else json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError):  # numpy ints, keys of mixed types: decoded each time
        return _decode_request_selects(raw)
    decoded = _DECODED_SELECTS.get(key)
    if decoded is None:
        decoded = _decode_request_selects(raw)
        if len(_DECODED_SELECTS) >= DECODED_SELECTS_KEPT:
            _DECODED_SELECTS.clear()
        _DECODED_SELECTS[key] = decoded
    return decoded


def _decode_request_selects(raw) -> dict[str, SelectSpec]:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a SelectSpec wire dict or {stream: SelectSpec wire dict}")
    if raw and set(raw) <= set(COMPONENTS):
        per_stream = {}
        for stream, wire in raw.items():
            try:
                per_stream[stream] = SelectSpec.from_wire(wire).interned()
            except ValueError as exc:
                raise ValueError(f"{stream}: {exc}") from None
        return per_stream
    return {"*": SelectSpec.from_wire(raw).interned()}


def _matches_any(req_id: str, client_ids) -> bool:
    from vllm_capture.session.wire import match_capture_request_id

    return any(match_capture_request_id(req_id, c) for c in client_ids)
