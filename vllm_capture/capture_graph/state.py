"""CaptureGraphState: the graph-static device memory that capture kernels read and write.

Everything a kernel touches is allocated once, at model load, before vLLM profiles memory and
captures CUDA graphs, and is never reallocated: a replayed graph holds raw addresses. What changes
per step (the row plan, the ring offset, whether a stream is on) is written into those buffers by
the host before the forward; the kernels read it from device memory.

Steps pack their rows one after another into each stream's ring (``ring_slots`` full steps of
``capacity`` rows). The host knows every step's row count, so it knows which ring rows hold rows not
yet copied out, without reading anything back. ``drain`` copies all of them at once: one gather and
one asynchronous device-to-host copy per ring group (past ``gather_bytes``, one copy per site and no
gather), on a side stream ordered by events, returned as ``DrainedRows`` for the session to hand to
the store off the step path. The session drains when
``drain_due`` says the pending rows are worth a copy, when the next step would not fit before the
ring's end, and before anything reads the store; so a decode step of a few rows costs a plan
upload, not a copy and a store append.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_capture.capture_graph import graph_nodes
from vllm_capture.capture_graph.last_rows import LastRowPlan
from vllm_capture.capture_graph.uploads import upload
from vllm_capture.kernels import compile_process, launch_capture, warmup
from vllm_capture.kernels import layout as L

logger = logging.getLogger("vllm_capture")


@dataclass
class Site:
    """One instrumented call site: a (component, layer) pair and its own ring and accumulators."""

    component: str
    layer_id: int
    layer_name: str
    width: int
    dtype: torch.dtype
    # int32 [2] = (executions, enabled); registered as a buffer on the instrumented module.
    counter: torch.Tensor
    ring: torch.Tensor | None = None
    ring_labels: torch.Tensor | None = None
    acc: torch.Tensor | None = None
    acc_labels: torch.Tensor | None = None
    acc_count: torch.Tensor | None = None
    # Hidden states: the layer's own tensor that its forward stores last rows into, at the
    # component's ``CaptureGraphState.last_row_plans`` dest (last_rows.py).
    last_rows: torch.Tensor | None = None
    eager_executions: int = 0
    enabled: bool = False  # whether the component's stream captures this layer
    launches: bool = False  # whether its capture kernel acts (host mirror of counter[1])


@dataclass
class RingGroup:
    """Sites of one component with one width and dtype, sharing one ring tensor and one set of
    accumulators, so a step's rows (or a batch of finished reductions) of every layer leave the
    device in one gather and one copy."""

    sites: list[Site]
    # Views of padded tensors: each site's part starts 16-byte aligned (``_aligned_rows``).
    ring: torch.Tensor  # [sites, ring_rows, width]
    labels: torch.Tensor  # int32 [sites, ring_rows, 3]
    acc: torch.Tensor | None = None  # fp32 [sites, acc_slots, width]
    acc_labels: torch.Tensor | None = None  # int32 [sites, acc_slots, 3]
    acc_count: torch.Tensor | None = None  # int32 [sites, acc_slots]
    # Positions in ``sites`` of the enabled ones, on the host and on the device (set_enabled).
    enabled: list[int] = field(default_factory=list)
    enabled_index: torch.Tensor | None = None


@dataclass
class StreamPlanBuffers:
    """Per-component plan, shared by all of its sites: at most one H2D copy per step (none
    when the device holds the step's plan already)."""

    buffer: torch.Tensor  # int32 [META_FIELDS + PLAN_FIELDS * plan_columns], device
    meta: torch.Tensor  # view: int32 [META_FIELDS]
    plan: torch.Tensor  # view: int32 [PLAN_FIELDS, plan_columns], entry-major
    host: np.ndarray  # the host image of ``buffer``
    step_cell: torch.Tensor  # view: meta[META_STEP], what a repeated step sets
    mode: int = L.MODE_OFF
    count: int = 0
    # MODE_ROWS: steps the device's plan has been repeated (its META_STEP; the host image's stays
    # 0, so every copy resets it), and the ring row its first step's rows went to.
    step: int = 0
    plan_offset: int = 0
    # The bytes of the prefix of ``host`` that ``buffer`` holds (None: unknown, or switched off).
    # A step whose plan equals it uploads nothing: at steady decode a reduction's plan repeats.
    on_device: bytes | None = None
    # Ring rows: the next step writes from ``offset``; ``[pending_start, offset)`` holds rows of
    # earlier steps not drained yet; ``copies`` are the drains still in flight as (first row,
    # end row, event): a step that writes over their rows waits for them first.
    offset: int = 0
    pending_start: int = 0
    copies: list = field(default_factory=list)
    # Bytes one ring row takes across the enabled sites, labels included (set by set_enabled).
    row_bytes: int = 0

    @property
    def pending_rows(self) -> int:
        return self.offset - self.pending_start


@dataclass
class DrainedRows:
    """Rows of one component for one or more steps, on their way to the host."""

    component: str
    count: int
    # layer_id -> (rows [count, width], labels int32 [count, 3]), and counts int32 [count] for
    # reductions; host tensors once ``wait()`` returns.
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    layer_names: dict[int, str]
    event: object | None = None  # torch.cuda.Event on GPU; None when the copy already finished

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass
class CaptureGraphState:
    device: torch.device
    capacity: int  # rows per step per component
    ring_slots: int = 2  # the ring holds this many steps of ``capacity`` rows
    # A drain is due once the pending rows of a stream take this many host bytes (or fill half of
    # the ring): large enough to amortise a copy and a store append over many decode steps, small
    # enough to keep the pinned staging modest.
    drain_bytes: int = 64 << 20
    # A drain of more bytes than this copies each site's rows straight from the ring to the host,
    # in ring order, with no gather: a gather's result is device memory outside vLLM's memory
    # profile, and one 16,384-token prefill step of an 8B's 32 layers is 4 GiB of it.
    gather_bytes: int = 256 << 20
    acc_slots: int = 64
    # The most tokens a forward runs (what a last-row plan's ``dest`` covers); 0: ``capacity``.
    max_tokens: int = 0
    sites: dict[int, Site] = field(default_factory=dict)  # counter.data_ptr() -> Site
    last_row_plans: dict[str, LastRowPlan] = field(default_factory=dict)
    streams: dict[str, StreamPlanBuffers] = field(default_factory=dict)
    groups: dict[str, list[RingGroup]] = field(default_factory=dict)
    input_ids: torch.Tensor | None = None
    ready: bool = False
    step_active: bool = False
    step_eager_launches: int = 0  # launches made by the op's Python body in the current step
    plan_uploads: int = 0  # host-to-device plan copies (a step repeating the last plan makes none)
    plan_steps: int = 0  # repeated row steps that only moved the device plan's META_STEP on
    allocation_bytes: int = 0
    # The capture kernels' nodes in captured CUDA graphs, left out of replays while their site
    # is off (CUDA only; see graph_nodes).
    nodes: graph_nodes.GraphNodes | None = None
    # What preparing the kernels took (ms): the compile process from its start to its end, and
    # what the first launch waited for (that end, then loading each variant).
    startup_ms: dict[str, float] = field(default_factory=dict)
    _compiling: compile_process.CompileProcess | None = None
    _copy_stream: object | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self):
        if self.device.type == "cuda" and self.device.index is None and torch.cuda.is_available():
            # The device current now, by index: what the kernels are compiled for and launched
            # on, whichever device is current later.
            self.device = torch.device("cuda", torch.cuda.current_device())

    # ---- set-up (model load time) -------------------------------------------------------------

    def add_site(self, component: str, layer_id: int, layer_name: str, width: int,
                 dtype: torch.dtype, last_rows: bool = False) -> torch.Tensor:
        """A call site's counter. ``last_rows``: the site's forward also stores its rows for
        ``last`` streams (``last_rows.store_last_rows`` into ``Site.last_rows``, at the
        component's ``last_row_plans`` ``dest``)."""
        if self.ready:
            raise RuntimeError("capture sites must be added before the capture buffers are allocated")
        counter = L.new_site_buffer(self.device, enabled=False)
        site = Site(component, layer_id, layer_name, width, dtype, counter)
        if last_rows:
            plan = self.last_row_plans.get(component)
            if plan is None:
                plan = LastRowPlan.allocate(self.max_tokens or self.capacity, self.acc_slots,
                                            self.device)
                self.last_row_plans[component] = plan
            site.last_rows = plan.rows_for(width, dtype)
        self.sites[counter.data_ptr()] = site
        return counter

    def sites_of(self, component: str) -> list[Site]:
        return sorted((s for s in self.sites.values() if s.component == component),
                      key=lambda s: s.layer_id)

    def allocate(self) -> None:
        """Allocate every ring, accumulator and plan buffer (once, before graphs are captured).

        Sites of one component with the same width and dtype share one ring tensor
        ``[sites, ring_rows, width]`` (each site's ring is a contiguous view of it), so pending
        rows of every layer leave the device in one copy.
        """
        nbytes = 0
        for component in sorted({s.component for s in self.sites.values()}):
            # A plan holds up to `capacity` rows, or one segment per reduce slot.
            columns = self.plan_columns
            buf = torch.zeros(L.META_FIELDS + L.PLAN_FIELDS * columns, dtype=torch.int32,
                              device=self.device)
            self.streams[component] = StreamPlanBuffers(
                buffer=buf,
                meta=buf[: L.META_FIELDS],
                plan=L.plan_view(buf[L.META_FIELDS:]),
                host=np.zeros(buf.numel(), dtype=np.int32),
                step_cell=buf[L.META_STEP:L.META_STEP + 1],
            )
            nbytes += buf.numel() * 4
            shapes: dict[tuple[int, torch.dtype], list[Site]] = {}
            for site in self.sites_of(component):
                shapes.setdefault((site.width, site.dtype), []).append(site)
            for (width, dtype), members in shapes.items():
                k = len(members)
                # Each site's part of a group's tensor starts 16-byte aligned (rows padded
                # between sites where need be), so every site launches the variant compiled
                # before graph capture.
                rows = _aligned_rows(self.ring_rows, width * dtype.itemsize, L.LABEL_FIELDS * 4)
                ring, labels = L.new_ring_buffers(k * rows, width, dtype, self.device)
                slots = _aligned_rows(self.acc_slots, width * 4, L.LABEL_FIELDS * 4, 4)
                acc, acc_labels, acc_count = L.new_acc_buffers(k * slots, width, self.device)
                group = RingGroup(
                    members,
                    ring.view(k, rows, width)[:, :self.ring_rows],
                    labels.view(k, rows, L.LABEL_FIELDS)[:, :self.ring_rows],
                    acc.view(k, slots, width)[:, :self.acc_slots],
                    acc_labels.view(k, slots, L.LABEL_FIELDS)[:, :self.acc_slots],
                    acc_count.view(k, slots)[:, :self.acc_slots])
                for i, site in enumerate(members):
                    site.ring, site.ring_labels = group.ring[i], group.labels[i]
                    site.acc, site.acc_labels = group.acc[i], group.acc_labels[i]
                    site.acc_count = group.acc_count[i]
                self.groups.setdefault(component, []).append(group)
                nbytes += sum(t.numel() * t.element_size()
                              for t in (ring, labels, acc, acc_labels, acc_count))
        nbytes += sum(t.numel() * t.element_size() for site in self.sites.values()
                      for t in (site.counter, site.last_rows) if t is not None)
        nbytes += sum(plan.dest.numel() * 8 for plan in self.last_row_plans.values())
        self.allocation_bytes = nbytes
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=self.device)
            reference = self.reference_site
            self.nodes = graph_nodes.GraphNodes(
                graph_nodes.load_driver(),
                pinned=set() if reference is None else {reference.counter.data_ptr()})
            self.nodes.set_sites({key: site.launches for key, site in self.sites.items()})
            graph_nodes.install(self.nodes)
        self.ready = True

    @property
    def reference_site(self) -> Site | None:
        """The site whose execution counter counts forwards (``graph_replays``): its graph nodes
        stay in replays while it is idle."""
        return min(self.sites.values(), key=lambda s: (s.component, s.layer_id), default=None)

    @property
    def ring_rows(self) -> int:
        return self.ring_slots * self.capacity

    @property
    def plan_columns(self) -> int:
        return max(self.capacity, self.acc_slots)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the ring buffers alone (what rows occupy on the device)."""
        return sum(g.ring.numel() * g.ring.element_size()
                   for groups in self.groups.values() for g in groups)

    def set_input_ids(self, input_ids: torch.Tensor) -> None:
        """The runner's persistent token-id buffer; the kernels read row labels from it.

        Then the kernel variants this model needs (one per site dtype, with and without a
        residual, for this token-id dtype) start compiling in a child process
        (``kernels.compile_process``; none where Triton's cache holds a child's marker for
        them): vLLM compiles the model meanwhile, and :meth:`await_kernels` waits for them
        before the first launch.
        """
        for component, plan in self.last_row_plans.items():
            if input_ids.shape[0] > plan.dest.shape[0]:
                raise ValueError(f"{component}: the runner's token buffer holds "
                                 f"{input_ids.shape[0]} tokens, more than the "
                                 f"{plan.dest.shape[0]} its last-row plan was sized for")
        self.input_ids = input_ids
        if self.device.type == "cuda":
            self._compiling = compile_process.start(compile_process.current_target(self.device),
                                                    self.site_dtypes, (input_ids.dtype,))

    @property
    def site_dtypes(self) -> list[torch.dtype]:
        return sorted({s.dtype for s in self.sites.values()}, key=str)

    def await_kernels(self) -> None:
        """Before the first launch (graph capture, or an eager step): wait for the compile
        process, then launch each variant once on dummy buffers, which loads it from Triton's
        cache into the CUDA context (a graph being captured must not see that happen). Where
        the process failed, that launch compiles the variant here, after a warning."""
        if self._compiling is None:
            return
        started = time.perf_counter()
        compiling, self._compiling = self._compiling, None
        failure = compiling.wait()
        self.startup_ms["kernel_compile"] = round(compiling.seconds * 1e3, 1)
        if failure is not None:
            logger.warning("vllm-capture: the capture kernels' compile process failed (%s); "
                           "compiling them in the engine instead", failure)
        with compiling.cache():
            for dtype in self.site_dtypes:  # one at a time: warmup crosses the dtypes it is given
                warmup(self.device, [dtype], ids_dtypes=(self.input_ids.dtype,))
        self.startup_ms["kernel_wait"] = round((time.perf_counter() - started) * 1e3, 1)

    def set_enabled(self, component: str, layers: set[int] | None, last: bool = False) -> None:
        """Switch sites of ``component`` on (layers=None: all) or off (empty set).

        ``last``: the stream keeps each request's last row. Where the sites store last rows
        themselves (``add_site(last_rows=True)``), the capture kernel acts at the first enabled
        site only, for the slots' labels and counts, and the graphs replay no other site's."""
        buf = self.streams.get(component)
        if buf is not None and buf.pending_rows:
            raise RuntimeError(f"{component}: {buf.pending_rows} ring rows are not drained; "
                               "drain before switching layers")
        sites = self.sites_of(component)
        for site in sites:
            site.enabled = layers is None or site.layer_id in layers
        enabled = [site for site in sites if site.enabled]
        plan = self.last_row_plans.get(component)
        stores = last and plan is not None and bool(enabled)
        for site in sites:
            site.launches = site.enabled and (not stores or site is enabled[0])
            site.counter[L.SITE_ENABLED] = int(site.launches)
        if plan is not None:
            plan.active = stores
            plan.clear()
        if self.nodes is not None:
            self.nodes.set_sites({site.counter.data_ptr(): site.launches for site in sites})
        for group in self.groups.get(component, ()):
            group.enabled = [i for i, site in enumerate(group.sites) if site.enabled]
            group.enabled_index = torch.tensor(group.enabled, dtype=torch.long, device=self.device)
        if buf is not None:
            buf.row_bytes = sum(len(g.enabled) * g.ring.shape[2] * g.ring.element_size()
                                for g in self.groups.get(component, ())) + 4 * L.LABEL_FIELDS

    # ---- per step ------------------------------------------------------------------------------

    def fits(self, component: str, n: int) -> bool:
        """Whether ``n`` more rows fit before the ring's end (else the next upload wraps)."""
        return self.streams[component].offset + n <= self.ring_rows

    def drain_due(self, component: str) -> bool:
        """Whether the pending rows are worth a copy now (half the ring, or ``drain_bytes``)."""
        buf = self.streams[component]
        rows = buf.pending_rows
        if rows == 0:
            return False
        return 2 * rows >= self.ring_rows or rows * buf.row_bytes >= self.drain_bytes

    def upload_rows(self, component: str, rows: np.ndarray, req_index: np.ndarray,
                    positions: np.ndarray, repeat: bool = False) -> None:
        """Plan this step's rows, written at the ring's next rows. ``repeat``: the step repeats
        the last one (the same rows and requests, each position one further; the caller's
        ``DecodeRepeat`` says so). Then, while the device holds the plan those steps repeat and
        the rows follow on in the ring, the step sets the plan's ``META_STEP`` (a 4-byte fill)
        instead of copying a plan (on the H200, a 4-layer row stream's ``begin_step`` took
        0.085-0.112 ms of the 1B's decode step, most of it the plan copy)."""
        buf = self.streams[component]
        n = len(rows)
        if n > self.capacity:
            raise ValueError(f"plan has {n} rows, capacity is {self.capacity}")
        if buf.offset + n > self.ring_rows:
            if buf.pending_rows:
                raise RuntimeError(f"{component}: drain the ring before it wraps")
            buf.offset = buf.pending_start = 0
        self._wait_for_copies(buf, buf.offset, buf.offset + n)
        if (repeat and buf.on_device is not None and buf.mode == L.MODE_ROWS and buf.count == n
                and buf.offset == buf.plan_offset + (buf.step + 1) * n):
            buf.step += 1
            buf.step_cell.fill_(buf.step)
            self.plan_steps += 1
        else:
            self._write(buf, L.MODE_ROWS, n, (rows, req_index, positions), offset=buf.offset)
            buf.plan_offset = buf.offset
        buf.offset += n

    def _wait_for_copies(self, buf: StreamPlanBuffers, start: int, end: int) -> None:
        """Order this step's writes to ring rows ``[start, end)`` after the drains reading them
        (a wait on the device; the host goes on). Only the last step's drain is usually still
        running, so a step that wraps does not wait for it unless it overwrites its rows."""
        still = []
        for copy in buf.copies:
            first, stop, event = copy
            if first < end and start < stop:
                if event is not None:
                    torch.cuda.current_stream(self.device).wait_event(event)
            else:
                still.append(copy)
        buf.copies = still

    def holds_plan(self, component: str) -> bool:
        """Whether the device still holds the last plan written for ``component`` (no forward
        that was not a step has switched it off since)."""
        return self.streams[component].on_device is not None

    def upload_segments(self, component: str, mode: int, row_start: np.ndarray,
                        row_count: np.ndarray, slots: np.ndarray, req_index: np.ndarray) -> None:
        plan = self.last_row_plans.get(component)
        if plan is not None and plan.active:
            if mode != L.MODE_LAST:
                raise ValueError(f"{component}: the sites store last rows; a plan of mode {mode}")
            plan.point(row_start, row_count, slots)
        self._write(self.streams[component], mode, len(row_start),
                    (row_start, row_count, slots, req_index))

    def _write(self, buf: StreamPlanBuffers, mode: int, count: int, columns, offset: int = 0) -> None:
        host = buf.host
        host[L.META_MODE] = mode
        host[L.META_COUNT] = count
        host[L.META_OFFSET] = offset
        plan = L.plan_view(host[L.META_FIELDS:])
        for i, col in enumerate(columns):
            plan[i, :count] = col
        buf.mode, buf.count = mode, count
        # Entry-major: meta and this step's entries are one prefix; the rest is never read.
        used = L.META_FIELDS + L.PLAN_FIELDS * count
        image = host[:used].tobytes()  # a bytes compare: a tenth of np.array_equal's time
        if image == buf.on_device and buf.step == 0:
            return
        buf.step = 0
        upload(buf.buffer[:used], host[:used])
        buf.on_device = image
        self.plan_uploads += 1

    def switch_off(self) -> None:
        """Set every stream's mode to off on the device, so that the forwards which follow
        capture nothing until the next step's plan: vLLM's dummy, profile and capture runs.

        A step leaves its plan on the device (a replay reads it before the host would know the
        forward ended), so the runner wrappers call this before each of those runs instead."""
        for buf in self.streams.values():
            if buf.mode != L.MODE_OFF:
                buf.mode, buf.count, buf.step = L.MODE_OFF, 0, 0
                buf.host[L.META_MODE] = L.MODE_OFF
                buf.host[L.META_COUNT] = 0
                buf.meta.zero_()
                buf.on_device = None
        for plan in self.last_row_plans.values():
            plan.clear()

    def handle(self, x: torch.Tensor, residual: torch.Tensor | None, counter: torch.Tensor) -> None:
        """The op body. At graph capture it records the launch; in eager mode it runs it."""
        site = self.sites.get(counter.data_ptr())
        if site is None or not self.ready:
            return
        buf = self.streams[site.component]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            if not self.step_active or buf.count == 0 or not site.launches:
                # Eager step with nothing to capture (no plan, or a plan of no rows: a clause
                # that selects nothing in this step): skip the launch (counter not bumped).
                return
            site.eager_executions += 1
            self.step_eager_launches += 1
            self.await_kernels()
        launch_capture(x, residual, self.input_ids, buf.meta, buf.plan, counter, site.ring,
                       site.ring_labels, site.acc, site.acc_labels, site.acc_count,
                       entries=None if capturing else buf.count)
        if capturing and self.nodes is not None:
            self.nodes.note_launch(counter.data_ptr(), torch.cuda.current_stream(x.device).cuda_stream)

    def gathers(self, component: str) -> bool:
        """Whether a drain of ``component``'s pending rows gathers them on the device (and so can
        put them in an order), or copies each site's rows as the ring holds them (``gather_bytes``)."""
        buf = self.streams[component]
        return buf.pending_rows * buf.row_bytes <= self.gather_bytes

    def drain(self, component: str, order: np.ndarray | None = None) -> DrainedRows | None:
        """Enqueue the copy of every pending ring row of ``component`` to host memory.

        Up to ``gather_bytes``, one gather and one device-to-host copy per ring group carry the
        rows of every enabled layer, and ``order`` (indices into the pending rows) puts them in
        another order on the device, so the host copy arrives in the order the store keeps. Past
        it, each enabled site's rows are copied as they are and ``order`` must be None. The labels
        are the same for all sites of a stream, so one site's labels travel once.
        """
        buf = self.streams[component]
        gather = self.gathers(component)
        start, n = buf.pending_start, buf.pending_rows
        groups = [g for g in self.groups.get(component, ()) if g.enabled]
        if order is not None and len(order) != n:
            raise ValueError(f"{component}: an order of {len(order)} rows for {n} pending rows")
        if order is not None and not gather:
            raise ValueError(f"{component}: {n} pending rows are past gather_bytes and are copied "
                             f"as the ring holds them, in no other order")
        buf.pending_start = buf.offset
        if n == 0 or not groups:
            return None
        cuda = self.device.type == "cuda"
        # The gathers run on the current stream and only the copies on the copy stream: device
        # work of this process on a second stream left the 8B's decode graph 2.7% slower on the
        # H200 until another CUDA context was made (session 26, benchmarks/slow_state.py); the
        # reductions' gathers, already on the current stream, never did.
        index = None if order is None else self._device_index(order + start)
        gathered = []
        labels = None
        for group in groups:
            # [enabled sites, n, width]: only the pending rows of enabled layers, in one gather
            # (its result is the only device memory a drain takes, outside vLLM's memory
            # profile: at most gather_bytes).
            if not gather:
                rows = None  # each site's rows are copied below, from the ring
            elif index is None:
                rows = group.ring[:, start:start + n].index_select(0, group.enabled_index)
            else:
                rows = group.ring[group.enabled_index.unsqueeze(1), index]
            if labels is None:
                site_labels = group.labels[group.enabled[0]]
                labels = (site_labels[start:start + n] if index is None
                          else site_labels.index_select(0, index))
            gathered.append((group, rows))
        event = None
        if cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._copy_stream.wait_event(done)
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        names: dict[int, str] = {}
        with torch.cuda.stream(self._copy_stream) if cuda else _no_stream():
            if cuda:  # the gathered temporaries must outlive the copies that read them
                labels.record_stream(self._copy_stream)
            labels = _to_host(labels, cuda)
            for group, rows in gathered:
                if rows is None:
                    rows = _sites_to_host(group, start, n, cuda)
                elif cuda:
                    rows.record_stream(self._copy_stream)
                    rows = _to_host(rows, cuda)  # on the CPU, index_select made ``rows``
                for k, i in enumerate(group.enabled):
                    site = group.sites[i]
                    layers[site.layer_id] = (rows[k], labels)
                    names[site.layer_id] = site.layer_name
            if cuda:
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        buf.copies.append((start, start + n, event))
        return DrainedRows(component, n, layers, names, event)

    # ---- reductions ------------------------------------------------------------------------------

    def _device_index(self, values) -> torch.Tensor:
        """An index tensor on the device, copied from pinned memory so the host does not wait."""
        host = torch.from_numpy(np.asarray(values, dtype=np.int64))
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def reset_acc_slots(self, component: str, idx: torch.Tensor | None = None) -> None:
        """Zero the reduction slots ``idx`` (a device index; None: every slot) of every site of
        ``component``, on the current stream: after the reads and steps enqueued before."""
        for group in self.groups.get(component, ()):
            if idx is None:
                group.acc.zero_()
                group.acc_count.zero_()
                group.acc_labels.zero_()
            else:
                group.acc.index_fill_(1, idx, 0.0)
                group.acc_count.index_fill_(1, idx, 0)
                group.acc_labels.index_fill_(1, idx, 0)

    def read_acc_slots(self, component: str, slots: list[int], mean: bool,
                       dtype: torch.dtype | None = None) -> DrainedRows:
        """Enqueue copies of the reductions in ``slots`` to host memory, without waiting.

        ``layers`` maps layer -> (rows [n, W] in ``dtype``, or the site's dtype where it is None,
        labels int32 [n, 3], counts int32 [n]): the fp32 accumulator as it is (``last``) or
        divided by its count (``mean``), then cast on the device, so the copy carries storage
        bytes and the host converts nothing (a worker's torch runs on one CPU thread); where the
        sites store last rows themselves, their rows. The gather (one per ring group, every
        enabled layer at once; a layer at a time from the sites' own tensors) runs on the main
        stream, and the slots are zeroed right after it there, so that they are clean when
        handed out again: a new request's first step then resets nothing (on the 1B's engine, a
        generate's first steps are where capture's host time shows, and the engine core's input
        thread runs beside them). The last-row tensors need no zeroing: a slot's row is read
        only where its count says the kernel, and so the stores, wrote it.
        """
        idx = self._device_index(slots)
        cuda = self.device.type == "cuda"
        plan = self.last_row_plans.get(component)
        if plan is not None and plan.active:
            gathered = [self._stored_last_rows(component, idx)]
        else:
            gathered = [([group.sites[i] for i in group.enabled],
                         self._reduced_rows(group, idx, mean, dtype))
                        for group in self.groups.get(component, ()) if group.enabled]
        event = None
        if cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._copy_stream.wait_event(done)
        # After the event: the copies wait for the gathers, not for the fills.
        self.reset_acc_slots(component, idx)
        layers, names = {}, {}
        with torch.cuda.stream(self._copy_stream) if cuda else _no_stream():
            for sites, picked in gathered:
                if cuda:
                    # The gathered temporaries must outlive the copies that read them.
                    for t in picked:
                        t.record_stream(self._copy_stream)
                # On the CPU the gathers above made these for this read alone: no copy.
                rows, labels, counts = (_to_host(t, cuda) for t in picked) if cuda else picked
                for k, site in enumerate(sites):
                    layers[site.layer_id] = (rows[k], labels, counts[k])
                    names[site.layer_id] = site.layer_name
            if cuda:
                event = torch.cuda.Event()
                event.record(self._copy_stream)
        return DrainedRows(component, len(slots), layers, names, event)

    def _reduced_rows(self, group: RingGroup, idx: torch.Tensor, mean: bool,
                      dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        """The capture kernel's reductions in slots ``idx`` of ``group``'s enabled sites:
        (rows [sites, n, W] in ``dtype`` or the sites', labels [n, 3], counts [sites, n])."""
        # Slots first: the other order copies every slot of every enabled layer (512 MiB for
        # an 8B's hidden states at 1,024 slots) to read a few.
        acc = group.acc.index_select(1, idx).index_select(0, group.enabled_index)
        counts = group.acc_count.index_select(1, idx).index_select(0, group.enabled_index)
        if mean:
            acc = acc / counts.clamp(min=1).unsqueeze(2).to(acc.dtype)
        labels = group.acc_labels[group.enabled[0]].index_select(0, idx)
        return acc.to(dtype or group.ring.dtype), labels, counts

    def _stored_last_rows(self, component: str, idx: torch.Tensor
                          ) -> tuple[list[Site], tuple[torch.Tensor, ...]]:
        """Slots ``idx`` of the enabled sites' last-row tensors, with the labels and counts the
        capture kernel wrote at the one site where it acts (the same for every layer)."""
        sites = [site for site in self.sites_of(component) if site.enabled]
        counted = next(site for site in sites if site.launches)
        rows = torch.stack([site.last_rows.index_select(0, idx) for site in sites])
        counts = counted.acc_count.index_select(0, idx)
        return sites, (rows, counted.acc_labels.index_select(0, idx),
                       counts.unsqueeze(0).expand(len(sites), -1))


def _aligned_rows(rows: int, *row_bytes: int) -> int:
    """The fewest rows, at least ``rows``, that fill a multiple of 16 bytes at every row size in
    ``row_bytes``: the rows a site takes in a group's tensors, so that the next site's part starts
    16-byte aligned. Triton specializes a pointer on that alignment; a site's buffer off it would
    be another kernel variant, compiled at its first launch, inside graph capture (as with
    ``max_num_seqs=50``: 50 accumulator slots of 12-byte labels)."""
    aligned = rows
    while any(aligned * size % 16 for size in row_bytes):
        aligned += 1
    return aligned


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    """A host copy of ``t``: pinned and non-blocking from the device (the caller records an event)."""
    if not cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


def _sites_to_host(group: RingGroup, start: int, n: int, cuda: bool) -> torch.Tensor:
    """``[enabled sites, n, width]`` on the host: ring rows ``[start, start + n)`` of each enabled
    site of ``group``, one copy a site from its contiguous rows (no device memory taken)."""
    host = torch.empty((len(group.enabled), n, group.ring.shape[2]), dtype=group.ring.dtype,
                       pin_memory=cuda)
    for k, i in enumerate(group.enabled):
        host[k].copy_(group.ring[i, start:start + n], non_blocking=cuda)
    return host


@contextlib.contextmanager
def _no_stream():
    yield
