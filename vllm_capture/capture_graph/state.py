"""CaptureGraphState: the graph-static device memory that capture kernels read and write.

Everything a kernel touches is allocated once, at model load, before vLLM profiles memory and
captures CUDA graphs, and is never reallocated: a replayed graph holds raw addresses. What changes
per step (the row plan, the ring slot, whether a stream is on) is written into those buffers by the
host before the forward; the kernels read it from device memory. After the forward, ``drain``
enqueues asynchronous device-to-host copies of exactly the rows the host planned (the host knows the
count, so no device value is read back) on a side stream, ordered by events, and returns them as
``DrainedRows`` for the session to hand to the store off the step path.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_capture.kernels import launch_capture, warmup
from vllm_capture.kernels import layout as L


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
    eager_executions: int = 0
    enabled: bool = False  # host mirror of counter[1]


@dataclass
class RingGroup:
    """Sites of one component with one width and dtype, sharing one ring tensor."""

    sites: list[Site]
    ring: torch.Tensor  # [sites, slots, capacity, width]
    labels: torch.Tensor  # int32 [sites, slots, capacity, 3]


@dataclass
class StreamPlanBuffers:
    """Per-component plan, shared by all of its sites: one H2D copy per step."""

    buffer: torch.Tensor  # int32 [META_SIZE + PLAN_ROWS * capacity], device
    meta: torch.Tensor  # view: int32 [META_SIZE]
    plan: torch.Tensor  # view: int32 [PLAN_ROWS, capacity]
    host: np.ndarray  # the host image of ``buffer``
    mode: int = L.MODE_OFF
    count: int = 0
    slot: int = 0


@dataclass
class DrainedRows:
    """Rows of one component for one step, on their way to the host."""

    component: str
    count: int
    # layer_id -> (rows [count, width], labels int32 [count, 3]); host tensors once ``done`` is set.
    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    layer_names: dict[int, str]
    event: object | None = None  # torch.cuda.Event on GPU; None when the copy already finished

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


@dataclass
class CaptureGraphState:
    device: torch.device
    capacity: int  # rows per step per component (ring slot size)
    ring_slots: int = 2
    acc_slots: int = 64
    sites: dict[int, Site] = field(default_factory=dict)  # counter.data_ptr() -> Site
    streams: dict[str, StreamPlanBuffers] = field(default_factory=dict)
    groups: dict[str, list[RingGroup]] = field(default_factory=dict)
    input_ids: torch.Tensor | None = None
    ready: bool = False
    step_active: bool = False
    step_eager_launches: int = 0  # launches made by the op's Python body in the current step
    allocation_bytes: int = 0
    _slot_free: dict = field(default_factory=dict)
    _copy_stream: object | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # ---- set-up (model load time) -------------------------------------------------------------

    def add_site(self, component: str, layer_id: int, layer_name: str, width: int,
                 dtype: torch.dtype) -> torch.Tensor:
        if self.ready:
            raise RuntimeError("capture sites must be added before the capture buffers are allocated")
        counter = L.new_site_buffer(self.device, enabled=False)
        self.sites[counter.data_ptr()] = Site(component, layer_id, layer_name, width, dtype, counter)
        return counter

    def sites_of(self, component: str) -> list[Site]:
        return sorted((s for s in self.sites.values() if s.component == component),
                      key=lambda s: s.layer_id)

    def allocate(self) -> None:
        """Allocate every ring, accumulator and plan buffer (once, before graphs are captured).

        Sites of one component with the same width and dtype share one ring tensor
        ``[sites, slots, capacity, width]`` (each site's ring is a contiguous view of it), so a
        step's rows of every layer leave the device in one copy.
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
                plan=buf[L.META_FIELDS:].view(L.PLAN_FIELDS, columns),
                host=np.zeros(buf.numel(), dtype=np.int32),
            )
            nbytes += buf.numel() * 4
            shapes: dict[tuple[int, torch.dtype], list[Site]] = {}
            for site in self.sites_of(component):
                shapes.setdefault((site.width, site.dtype), []).append(site)
            for (width, dtype), members in shapes.items():
                group = RingGroup(members, *L.new_ring_buffers(
                    self.ring_slots * len(members), self.capacity, width, dtype, self.device))
                group.ring = group.ring.view(len(members), self.ring_slots, self.capacity, width)
                group.labels = group.labels.view(len(members), self.ring_slots, self.capacity,
                                                 L.LABEL_FIELDS)
                for i, site in enumerate(members):
                    site.ring, site.ring_labels = group.ring[i], group.labels[i]
                self.groups.setdefault(component, []).append(group)
                nbytes += group.ring.numel() * group.ring.element_size()
                nbytes += group.labels.numel() * group.labels.element_size()
        for site in self.sites.values():
            site.acc, site.acc_labels, site.acc_count = L.new_acc_buffers(
                self.acc_slots, site.width, self.device)
            nbytes += sum(t.numel() * t.element_size() for t in (
                site.acc, site.acc_labels, site.acc_count, site.counter))
        self.allocation_bytes = nbytes
        if self.device.type == "cuda":
            self._copy_stream = torch.cuda.Stream(device=self.device)
            self._slot_free = {}
        self.ready = True

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

        Then the kernel variants this model needs are compiled, before vLLM captures graphs:
        one per (site dtype, with/without residual) for this token-id dtype.
        """
        self.input_ids = input_ids
        if self.device.type == "cuda":
            warmup(self.device, sorted({s.dtype for s in self.sites.values()}, key=str),
                   ids_dtypes=(input_ids.dtype,))

    def set_enabled(self, component: str, layers: set[int] | None) -> None:
        """Switch sites of ``component`` on (layers=None: all) or off (empty set)."""
        for site in self.sites_of(component):
            site.enabled = layers is None or site.layer_id in layers
            site.counter[L.SITE_ENABLED] = int(site.enabled)

    # ---- per step ------------------------------------------------------------------------------

    def upload_rows(self, component: str, rows: np.ndarray, req_index: np.ndarray,
                    positions: np.ndarray) -> None:
        buf = self.streams[component]
        n = len(rows)
        if n > self.capacity:
            raise ValueError(f"plan has {n} rows, capacity is {self.capacity}")
        buf.slot = (buf.slot + 1) % self.ring_slots
        self._write(buf, L.MODE_ROWS, n, (rows, req_index, positions))

    def upload_segments(self, component: str, mode: int, row_start: np.ndarray,
                        row_count: np.ndarray, slots: np.ndarray, req_index: np.ndarray) -> None:
        self._write(self.streams[component], mode, len(row_start),
                    (row_start, row_count, slots, req_index))

    def _write(self, buf: StreamPlanBuffers, mode: int, count: int, columns) -> None:
        host = buf.host
        host[L.META_MODE] = mode
        host[L.META_COUNT] = count
        host[L.META_SLOT] = buf.slot
        plan = host[L.META_FIELDS:].reshape(L.PLAN_FIELDS, self.plan_columns)
        for i, col in enumerate(columns):
            plan[i, :count] = col
        buf.mode, buf.count = mode, count
        if self.device.type == "cuda":
            # The slot we are about to overwrite may still be copying out from two steps ago.
            pending = self._slot_free.get((id(buf), buf.slot))
            if pending is not None and mode == L.MODE_ROWS:
                torch.cuda.current_stream(self.device).wait_event(pending)
            # A fresh pinned tensor per step: the caching host allocator keeps it alive until
            # the non-blocking copy has run, so the step never waits for the copy.
            staged = torch.from_numpy(host.copy()).pin_memory()
            buf.buffer.copy_(staged, non_blocking=True)
        else:
            buf.buffer.copy_(torch.from_numpy(host))

    def switch_off(self) -> None:
        """Set every stream's mode to off, so dummy, profile and capture runs capture nothing."""
        for buf in self.streams.values():
            if buf.mode != L.MODE_OFF:
                buf.mode, buf.count = L.MODE_OFF, 0
                buf.host[L.META_MODE] = L.MODE_OFF
                buf.host[L.META_COUNT] = 0
                buf.meta.zero_()

    def handle(self, x: torch.Tensor, residual: torch.Tensor | None, counter: torch.Tensor) -> None:
        """The op body. At graph capture it records the launch; in eager mode it runs it."""
        site = self.sites.get(counter.data_ptr())
        if site is None or not self.ready:
            return
        buf = self.streams[site.component]
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:
            if not self.step_active or buf.mode == L.MODE_OFF or not site.enabled:
                # Eager step with nothing to capture: skip the launch (counter not bumped).
                return
            site.eager_executions += 1
            self.step_eager_launches += 1
        launch_capture(x, residual, self.input_ids, buf.meta, buf.plan, counter, site.ring,
                       site.ring_labels, site.acc, site.acc_labels, site.acc_count)

    def drain(self) -> list[DrainedRows]:
        """Enqueue copies of this step's planned rows (mode rows) to host memory.

        One device-to-host copy per ring group carries the rows of every enabled layer; the labels
        are the same for all sites of a stream, so one site's labels travel once.
        """
        drained = []
        for component, buf in self.streams.items():
            if buf.mode != L.MODE_ROWS or buf.count == 0:
                continue
            n, slot = buf.count, buf.slot
            groups = [(g, [i for i, s in enumerate(g.sites) if s.enabled])
                      for g in self.groups.get(component, ())]
            groups = [(g, idx) for g, idx in groups if idx]
            if not groups:
                continue
            cuda = self.device.type == "cuda"
            event = None
            if cuda:
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                self._copy_stream.wait_event(done)
            layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            names: dict[int, str] = {}
            labels = None
            with torch.cuda.stream(self._copy_stream) if cuda else _no_stream():
                for group, idx in groups:
                    sites = [group.sites[i] for i in idx]
                    # [enabled sites, n, width]: only the planned rows of enabled layers.
                    rows = group.ring[:, slot, :n].index_select(0, self._device_index(idx))
                    if labels is None:
                        labels = group.labels[idx[0], slot, :n]
                        labels = _to_host(labels, cuda)
                    rows = _to_host(rows, cuda)
                    for k, site in enumerate(sites):
                        layers[site.layer_id] = (rows[k], labels)
                        names[site.layer_id] = site.layer_name
                if cuda:
                    event = torch.cuda.Event()
                    event.record(self._copy_stream)
            if cuda:
                self._slot_free[(id(buf), slot)] = event
            drained.append(DrainedRows(component, n, layers, names, event))
        return drained

    # ---- reductions ------------------------------------------------------------------------------

    def _device_index(self, values: list[int]) -> torch.Tensor:
        """An index tensor on the device, copied from pinned memory so the host does not wait."""
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def reset_acc_slots(self, component: str, slots: list[int]) -> None:
        if not slots:
            return
        idx = self._device_index(slots)
        for s in self.sites_of(component):
            s.acc.index_fill_(0, idx, 0.0)
            s.acc_count.index_fill_(0, idx, 0)
            s.acc_labels.index_fill_(0, idx, 0)

    def read_acc_slots(self, component: str, slots: list[int]) -> DrainedRows:
        """Enqueue copies of the accumulators of ``slots`` to host memory, without waiting.

        ``layers`` maps layer -> (acc fp32 [n, W], labels int32 [n, 3], counts int32 [n]). The
        gather runs on the main stream, ahead of any later reset or reuse of those slots.
        """
        idx = self._device_index(slots)
        sites = [s for s in self.sites_of(component) if s.enabled]
        picked = {s.layer_id: (s.acc.index_select(0, idx), s.acc_labels.index_select(0, idx),
                               s.acc_count.index_select(0, idx)) for s in sites}
        names = {s.layer_id: s.layer_name for s in sites}
        if self.device.type != "cuda":
            return DrainedRows(component, len(slots), picked, names)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        layers = {}
        with torch.cuda.stream(self._copy_stream):
            self._copy_stream.wait_event(done)
            for layer_id, tensors in picked.items():
                host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
                for h, t in zip(host, tensors):
                    h.copy_(t, non_blocking=True)
                    # The gathered temporaries must outlive the copy that reads them.
                    t.record_stream(self._copy_stream)
                layers[layer_id] = host
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return DrainedRows(component, len(slots), layers, names, event)


def _to_host(t: torch.Tensor, cuda: bool) -> torch.Tensor:
    """A host copy of ``t``: pinned and non-blocking from the device (the caller records an event)."""
    if not cuda:
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@contextlib.contextmanager
def _no_stream():
    yield
