"""Bounded CPU storage for one capture stream, with per-request row labels.

Rows reach the store already on the host (the capture graph's drain copied
them off the device); the store owns budgets, the request-label registry and
serialization. Every stored row carries int32 labels ``(req_idx, position,
token_id)`` where ``req_idx`` indexes ``req_table`` — so clients never
re-derive sample alignment, and malformed labels are refused before any row
enters.

Each ``append`` (one layer; the rows of one or more drained steps, many
requests) becomes one chunk, grouped by request and copied at most once
(kept as it is when it arrives in that order); draining a request marks its
rows dead, and chunks are freed when empty and compacted when mostly dead (see
``StreamStore``). A fetch with ``raw_data`` copies no rows: it hands out each
layer's rows as a ``FetchedRows`` (byte count known, copy planned) that the
caller copies once, into its own buffer (the worker: its shared-memory reply
file, ``session/shm.py``); layers whose chunks match (a drain appends every
layer alike) share one copy plan.
"""

import collections
import concurrent.futures
import functools
import logging
import os
import threading
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np
import torch

from vllm_capture.session.config import StreamConfig
from vllm_capture.session.wire import (
    WIRE_RAW_DTYPES,
    WIRE_TORCH_DTYPES,
    encode_capture_labels,
    encode_capture_layer,
    match_capture_request_id,
)

logger = logging.getLogger("vllm_capture")

_ZERO = np.zeros(1, dtype=np.int64)
# Blocks at least this large are copied by torch (parallel where it has
# intra-op threads); smaller ones by numpy (see _raw).
_LARGE_COPY = 2 << 20
# Appends of at least this many bytes copy their layers on APPEND_THREADS threads (_copy_all).
APPEND_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
_PARALLEL_APPEND = 8 << 20
# Drained rows and finalized reductions arrive in pinned host copies made for them alone, in the
# store's order. The store keeps those instead of copying them while it holds less than this:
# - the copy, into fresh pages, was most of a last-token fetch's wait at 8B (16.8 MB);
# - on the harvest thread, it cost the 1B's 4-layer capture (300 MB a generate) 6% of its
#   throughput, the step path sharing the engine's CPUs with the copying threads.
# torch's caching host allocator keeps a pinned block once it is freed, so past this the rows go
# to pageable memory, and the pinned memory a store leaves behind stays bounded.
ADOPT_BYTES = 512 << 20
# A fetch gathers a layer's rows span by span (a Python step each, about as long as copying
# 30-60 KB) unless its spans are many, several per chunk and on average under this many bytes:
# then it scatters each chunk's rows at once. On the CPU VM, 48 layers of router logits (512-byte
# rows) drained 16 steps at a time, 453 MB: serialize 151 -> 37 ms, write 157 -> 40 ms against
# the rule it replaces (under 8 rows, whatever their width).
_SCATTER_SPAN_BYTES = 64 << 10
_append_pool: concurrent.futures.ThreadPoolExecutor | None = None

# Containers accepted for ``layers`` / ``req_ids``; a bare str would iterate
# as characters and silently select nothing.
_ID_LISTS = (list, tuple, set, frozenset)


def check_fetch_filters(layers: list[int] | None, req_ids: list[str] | None) -> None:
    """Refuse a fetch's ``layers`` or ``req_ids`` that are not lists of ids, before the fetch
    acts on anything (a bare string would match its characters as request ids)."""
    if layers is not None and (not isinstance(layers, _ID_LISTS) or not all(
        isinstance(layer, int) and not isinstance(layer, bool) for layer in layers
    )):
        raise ValueError(f"layers must be a list of layer ids, got {layers!r}")
    if req_ids is not None and (
        not isinstance(req_ids, _ID_LISTS)
        or not all(isinstance(req_id, str) for req_id in req_ids)
    ):
        raise ValueError(f"req_ids must be a list of request id strings, got {req_ids!r}")


class _Spans(NamedTuple):
    """Request spans of one layer, one entry per (chunk, request), as int64 arrays."""

    chunk: np.ndarray  # chunk id
    req: np.ndarray  # request index
    slot: np.ndarray  # the request's slot in the chunk
    start: np.ndarray  # first row of the span in the chunk
    length: np.ndarray  # rows in the span


class _Chunk:
    """The kept rows of one ``append``: one layer, one or more engine steps, many requests.

    Rows are grouped by request (requests in registration order, each
    request's rows in batch order): the request in slot ``s`` is
    ``reqs[s]`` and owns rows ``starts[s] : starts[s] + lens[s]``, its span.
    A request's span leaves as a whole (a drain takes all of its rows in the
    layer, a discard too), so liveness is kept per slot.
    """

    __slots__ = ("tensor", "raw", "meta", "rows", "reqs", "starts", "lens", "live", "live_rows")

    def __init__(
        self,
        tensor: torch.Tensor,
        meta: np.ndarray,
        reqs: np.ndarray,
        starts: np.ndarray,
        lens: np.ndarray,
    ):
        self.set_rows(tensor, meta)
        self.reqs = reqs
        self.starts = starts
        self.lens = lens
        self.live = np.ones(reqs.size, dtype=bool)
        self.live_rows = self.rows

    def set_rows(self, tensor: torch.Tensor, meta: np.ndarray) -> None:
        self.tensor = tensor
        self.raw = _raw(tensor)  # numpy view of tensor's memory, for row copies
        self.meta = meta  # int32 [rows, 3] labels
        self.rows = meta.shape[0]  # allocated, live or dead

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensor) + self.meta.nbytes

    def live_requests(self) -> list[int]:
        """Request indices with live rows here, in storage order."""
        return self.reqs[self.live].tolist()


class FetchedRows:
    """One layer's fetched rows in wire order, planned but not yet copied.

    ``StreamStore.serialize(raw_data=True)`` hands these out so that whoever
    ships the rows copies them exactly once, into a buffer of its own
    (``session/shm.py`` gathers them straight into the reply's shared-memory
    file): ``nbytes`` is known before any row moves, and ``copy_into`` is
    the gather. ``tobytes`` and ``tensor`` use the same gather.

    The plan stays valid after the store's lock is released, and after
    ``clear_selected`` removed the rows: it holds the source chunks' tensors
    (not the chunks), and chunk storage is never written once its chunk
    exists (compaction builds a new tensor).
    """

    __slots__ = ("dtype", "shape", "nbytes", "_sources", "_pieces")

    def __init__(self, dtype: torch.dtype, rows: int,
                 sources: list[tuple[torch.Tensor, np.ndarray]], pieces: list[tuple]):
        width = sources[0][0].shape[1]
        self.dtype = dtype  # promoted over the sources' dtypes
        self.shape = (rows, width)
        self.nbytes = rows * width * dtype.itemsize
        # Sources are (tensor, its numpy view); pieces (index in sources, source rows, destination
        # rows), shared by layers gathered by one plan. Rows are slices or int64 index arrays,
        # and sources of another dtype come with slices only.
        self._sources = sources
        self._pieces = pieces

    def copy_into(self, out, part: tuple[int, int] | None = None) -> None:
        """Copy the rows into ``out``, a writable buffer of exactly ``nbytes``
        bytes, in the wire layout (C-order rows of the wire's raw dtype).

        ``part=(start, stop)`` copies only the rows from the start-th to the
        stop-th that a whole copy moves, counted in the order it moves them
        (not the wire's): calls into one buffer whose parts cover
        ``(0, rows)`` copy every row once, so threads can share one layer."""
        pieces = self._pieces if part is None else self._part(*part)
        dst = np.frombuffer(out, dtype=WIRE_RAW_DTYPES[self.dtype])
        if dst.nbytes != self.nbytes or not dst.flags.writeable:
            kind = "a" if dst.flags.writeable else "a read-only"
            raise ValueError(f"copy_into needs a writable {self.nbytes}-byte buffer, "
                             f"got {kind} {dst.nbytes}-byte one")
        dst = dst.reshape(self.shape)
        dst_t = None  # torch view of dst, made on first use
        for index, src, to in pieces:
            source, raw = self._sources[index]
            if not isinstance(to, slice) or (
                source.dtype == self.dtype and (to.stop - to.start) * raw[:1].nbytes < _LARGE_COPY
            ):
                dst[to] = raw[src]  # numpy: see _raw
                continue
            # torch casts (promotion) and copies large blocks (see _take).
            if dst_t is None:
                dst_t = torch.from_numpy(dst)
                if self.dtype == torch.bfloat16:
                    dst_t = dst_t.view(torch.bfloat16)
            dst_t[to].copy_(source[src])

    def _part(self, start: int, stop: int) -> list[tuple]:
        """The pieces of ``copy_into``'s rows ``start:stop``, cut where a piece straddles them."""
        out = []
        at = 0  # rows of the pieces before this one
        for index, src, to in self._pieces:
            count = _rows(to)
            first, last = max(start - at, 0), min(stop - at, count)
            at += count
            if first < last:
                if (first, last) == (0, count):
                    out.append((index, src, to))
                else:
                    out.append((index, _cut(src, first, last), _cut(to, first, last)))
            if at >= stop:
                break
        return out

    def tensor(self) -> torch.Tensor:
        """The rows as one tensor: the source chunk's own when they are one whole
        chunk (do not write to it), else a fresh copy."""
        index, src, to = self._pieces[0]
        source = self._sources[index][0]
        if (len(self._pieces) == 1 and source.dtype == self.dtype and isinstance(to, slice)
                and isinstance(src, slice) and src.stop - src.start == source.shape[0]):
            return source
        out = torch.empty(self.shape, dtype=self.dtype)
        self.copy_into(_raw(out))
        return out

    def tobytes(self) -> bytes:
        """The rows in the wire layout, as bytes (the RPC reply's ``data``)."""
        return _raw(self.tensor()).astype(WIRE_RAW_DTYPES[self.dtype], copy=False).tobytes()


class _GatherPlan(NamedTuple):
    """How a fetch gathers one layer's spans, naming chunks by their position in the layer (in
    chunk id order), so that it serves any layer whose chunks match the planned layer's chunk
    for chunk (``_same_chunks``), as every layer one drain appends does."""

    dtype: torch.dtype  # promoted over the sources' dtypes
    rows: int
    sources: list[int]  # positions of the chunks the rows come from
    pieces: list[tuple]  # (index in sources, source rows, destination rows), in wire order
    meta: np.ndarray  # the rows' labels
    spans: _Spans  # the planned layer's
    span_chunks: np.ndarray  # positions of the spans' chunks

    def rows_in(self, layer: dict[int, _Chunk]) -> FetchedRows:
        """The layer's rows, gathered by this plan."""
        chunks = list(layer.values())
        # The rows name the chunks' current tensors: compaction may replace them later.
        sources = [(chunks[p].tensor, chunks[p].raw) for p in self.sources]
        return FetchedRows(self.dtype, self.rows, sources, self.pieces)

    def spans_in(self, layer: dict[int, _Chunk]) -> _Spans:
        """The layer's spans this plan gathers (those ``_kill`` takes)."""
        chunk_ids = np.fromiter(layer, dtype=np.int64, count=len(layer))
        return self.spans._replace(chunk=chunk_ids[self.span_chunks])


class StreamStore:
    """Bounded, chunk-appending CPU store for one capture stream.

    Storage: each ``append`` (one layer, one or more engine steps, many
    requests) becomes one chunk. Its kept rows are copied at most once,
    grouped by request with one stable argsort, and the chunk records each request's rows (a
    span per request). Appending costs one copy plus a few whole-batch numpy
    operations, never a copy or Python step per request: the harvest thread
    appends once per layer per harvest batch and must keep up with serving.
    A per-request index ((layer, chunk) -> span) serves per-request fetches;
    it is built lazily, in batches, when a fetch or discard first needs it,
    so neither appends nor drains of everything pay for it.

    Trade-off (this replaces "each request owns its storage"): requests
    share chunks, so draining one request does not by itself release memory,
    and freeing memory can copy other requests' rows. A drained span is
    marked dead; a chunk is freed once none of its rows are live, and
    compacted (its live rows copied into a new, smaller tensor) once fewer
    than half are. Every chunk therefore stays at least half live: the
    memory held (``bytes_stored``, dead rows included) is at most twice the
    live rows, even when long-lived requests share chunks with drained ones,
    at the price of re-copying survivors (a geometric series: at most about
    one extra copy of each row over its lifetime). Budgets count live rows.
    Adopted layers of one drain are views of one host buffer: once the chunks
    left on it hold less than half of it, they are copied out, so the bound
    holds for the buffer too.

    Request labels are small ints so the device-side planner can write them
    into int32 columns; ``request_index`` hands them out and recycles them.
    An index returns to the pool only when its request has finished AND none
    of its rows remain (a per-request live-row count), so a recycled index
    can never make old rows look like they belong to a new request. The
    session must call ``finish_requests`` only after every row of that
    request has been appended (after the drain of its last step): rows that
    arrive for a released index would otherwise be refused, or, once it is
    reused, attributed to its new owner.

    Every public method holds ``lock`` (reentrant, so a caller that already
    holds it to group calls does not deadlock), but for the lock-free reads
    ``holds_request``, ``registration_order`` and ``bytes_stored``.
    """

    def __init__(self, config: StreamConfig):
        self.config = config
        # layer -> chunk id -> chunk; chunk ids grow monotonically, so a
        # layer's dict is in append order.
        self.chunks: dict[int, dict[int, _Chunk]] = {}
        self._next_chunk = 0
        # request index -> layer -> chunk id -> (slot, start row, rows) of the
        # request's live span in that chunk. Built lazily (_index_chunks) from
        # the chunks in _unindexed (chunk id -> layer), so an append costs no
        # per-request Python work and a drain of everything never needs it.
        self._request_chunks: dict[int, dict[int, dict[int, tuple[int, int, int]]]] = {}
        self._unindexed: dict[int, int] = {}
        self.layer_names: dict[int, str] = {}
        self.req_table: dict[int, str] = {}
        self._req_index: dict[str, int] = {}
        # Client-visible id (and the full engine id) -> request indices.
        self._request_aliases: dict[str, set[int]] = {}
        # Per request index, grown on demand so appends check and sort whole
        # batches at once: registration rank (serialize() orders requests by
        # it), live rows across layers, whether the index is assigned, and
        # whether its rows are discarded (failed or elided request).
        self._rank = np.zeros(0, dtype=np.int64)
        self._live = np.zeros(0, dtype=np.int64)
        self._assigned = np.zeros(0, dtype=bool)
        self._blocked = np.zeros(0, dtype=bool)
        self._registrations = 0
        # FIFO: the longest-released index is reused first, so a just-released
        # index is not handed out again while older free ones exist.
        self._free_request_indices: collections.deque[int] = collections.deque()
        self._next_request_index = 0
        self._finished: set[int] = set()
        # Requests whose rows cannot be fetched (prefix-cache hits skipped
        # selected rows / errors): fetch raises until the stream is cleared.
        self.elided_reqs: set[str] = set()
        self._failed_requests: dict[str, str] = {}
        # Why rows of this stream never reached the store (a failed harvest); None: none lost.
        self._lost: str | None = None
        # Live rows per layer: the budget caps each layer at budget_rows,
        # and draining frees room, so it bounds memory, not run length.
        self._layer_rows: dict[int, int] = {}
        # Storage dtypes each layer's chunks may hold (several only when
        # config.dtype is unset and appends differ); fetches promote.
        self._layer_dtypes: dict[int, set[torch.dtype]] = {}
        # Bytes of every chunk's storage, dead rows awaiting compaction included.
        self._bytes_stored = 0
        # Host buffers that several adopted chunks are views of (a drain copies every layer of a
        # ring group in one piece): buffer's data pointer -> (its bytes, (layer, chunk id) keys).
        self._shared: dict[int, tuple[int, set[tuple[int, int]]]] = {}
        self._left_on_shared: set[int] = set()  # buffers some chunk left since the last settle
        # Rows cut before the store (device ring) and by the budget. Every layer of one append
        # holds the same rows, so a row the budget cuts in any of them counts once, in the append
        # that cut it: layers' budgets part once a fetch clears some layers and not others.
        self._ring_dropped = 0
        self._budget_dropped = 0
        self._warned_budget = False
        self.lock = threading.RLock()

    @property
    def tokens_stored(self) -> int:
        """Rows held by the fullest layer: every layer sees the same tokens."""
        with self.lock:
            return max(self._layer_rows.values(), default=0)

    @property
    def bytes_stored(self) -> int:
        """Bytes of every chunk's storage (rows and labels, dead rows awaiting compaction)."""
        return self._bytes_stored

    # ------------------------------------------------------------------ requests

    def request_index(self, req_id: str) -> int:
        """Label index for an engine-internal request id, allocated on first use.

        Asking again for a finished request that still has rows revives it
        instead of allocating a second index for the same id. (The session asks
        once per request, and fails a request whose id ``holds_request``.)
        """
        if not isinstance(req_id, str):
            raise TypeError(f"request id must be a str, got {type(req_id).__name__}")
        with self.lock:
            index = self._req_index.get(req_id)
            if index is not None:
                self._finished.discard(index)
                return index
            if self._free_request_indices:
                index = self._free_request_indices.popleft()
            else:
                index = self._next_request_index
                self._next_request_index += 1
                if index >= self._rank.size:
                    self._grow(index + 1)
            self.req_table[index] = req_id
            self._req_index[req_id] = index
            self._request_chunks[index] = {}
            self._rank[index] = self._registrations
            self._registrations += 1
            self._assigned[index] = True
            self._blocked[index] = self._unservable(req_id)
            for alias in _aliases(req_id):
                self._request_aliases.setdefault(alias, set()).add(index)
            return index

    def holds_request(self, req_id: str) -> bool:
        """Whether ``req_id`` has a label index: rows of it are held or may still arrive, or the
        harvest thread has not yet released it after its finish.

        Without the lock (one dict lookup, atomic): the step path asks for each new request,
        while the harvest thread may hold the lock for a long append."""
        return req_id in self._req_index

    def registration_order(self, req_index: np.ndarray) -> np.ndarray:
        """The order that puts rows of these (registered) label indices in registration order,
        each request's rows in the order given: the order a chunk keeps its rows in. Rows
        appended in it are stored as they are (and adopted), where any other order is copied
        into that one.

        Without the lock: ranks are written only by ``request_index``, on the thread that plans
        steps and calls this, while the harvest thread may hold the lock for a long append."""
        return np.argsort(self._rank[req_index], kind="stable")

    def _grow(self, needed: int) -> None:
        size = max(64, 2 * self._rank.size, needed)
        for name in ("_rank", "_live", "_assigned", "_blocked"):
            old = getattr(self, name)
            new = np.zeros(size, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)

    def finish_requests(self, req_ids) -> None:
        """Let the requests' indices be recycled once their rows are drained."""
        with self.lock:
            indices = {self._req_index[r] for r in req_ids if r in self._req_index}
            self._finished |= indices
            self._reclaim_requests(indices)

    def fail_request(self, req_id: str, reason: str) -> None:
        """Record that a request's capture is invalid.

        Its rows can never be fetched (serialize raises for it), so they are
        released now and later ones are discarded on arrival rather than
        holding memory until the stream is cleared.
        """
        with self.lock:
            self._failed_requests[req_id] = str(reason)
            self._discard_request_rows(req_id)

    def mark_lost(self, reason: str) -> None:
        """Record that rows bound for this store never reached it (which requests' is not
        known): every fetch raises until the stream is cleared."""
        with self.lock:
            self._lost = str(reason)

    def check_servable(self, req_ids: list[str] | None) -> None:
        """Raise what a fetch of ``req_ids`` (None: all) would raise for failed, elided or
        lost rows, before the fetch changes anything."""
        with self.lock:
            self._check_servable(req_ids)

    def mark_elided(self, req_id: str) -> None:
        """Record that a prefix-cache hit skipped rows this request selected.

        The rows that did arrive are an incomplete sample; like a failed
        request's rows they are released and later ones discarded.
        """
        with self.lock:
            self.elided_reqs.add(req_id)
            self._discard_request_rows(req_id)

    def _discard_request_rows(self, req_id: str) -> None:
        index = self._req_index.get(req_id)
        if index is None:
            return
        self._blocked[index] = True
        self._index_chunks()
        for layer_id, held in list(self._request_chunks[index].items()):
            chunk_ids = list(held)
            spans = self._spans_at(chunk_ids, [index] * len(chunk_ids), list(held.values()))
            self._kill(layer_id, spans)
        self._settle_shared()
        self._reclaim_requests({index})

    def _reclaim_requests(self, indices: set[int]) -> None:
        """Release finished requests among ``indices`` that hold no rows."""
        for index in indices:
            if index in self._finished and self._live[index] == 0:
                self._release_request(index)

    def _release_request(self, index: int) -> None:
        req_id = self.req_table.pop(index)
        del self._req_index[req_id]
        del self._request_chunks[index]
        self._finished.discard(index)
        self._assigned[index] = False
        self._blocked[index] = False
        for alias in _aliases(req_id):
            indices = self._request_aliases[alias]
            indices.discard(index)
            if not indices:
                del self._request_aliases[alias]
        self._free_request_indices.append(index)

    def _unservable(self, req_id: str) -> bool:
        return req_id in self._failed_requests or req_id in self.elided_reqs

    # ---------------------------------------------------------------------- rows

    def append(
        self,
        layer_id: int,
        tensor: torch.Tensor,
        meta: torch.Tensor,
        layer_name: str,
    ) -> None:
        """Store one layer's drained host rows as one chunk (see ``append_layers``)."""
        self.append_layers({layer_id: tensor}, meta, {layer_id: layer_name})

    def append_layers(
        self,
        rows: dict[int, torch.Tensor],
        meta: torch.Tensor,
        layer_names: dict[int, str],
        adopt: bool = False,
        arrival: np.ndarray | None = None,
    ) -> None:
        """Store drained host rows of one or more engine steps: one chunk per layer, one set of
        labels.

        Every layer's tensor holds the same rows (the step's plan), labelled by ``meta``, int32
        ``[rows, 3]`` (req_idx, position, token_id) with req_idx from ``request_index``. Checking
        the labels and grouping the rows by request happen once for all layers; only the row copy
        is per layer. The store copies what it keeps (once, grouped by request), so the caller
        may reuse its (pinned) buffers as soon as this returns. Rows of failed or cache-elided
        requests are discarded; rows past a layer's budget are dropped (the first rows in row
        order are kept, or the earliest by ``arrival``, each row's place in the order the rows
        were produced, when they come in another) and counted in ``tokens_dropped``.

        With ``adopt`` the caller hands its tensors over (host copies made for this append
        alone: drained rows, finalized reductions): while the store holds under ``ADOPT_BYTES``, a
        layer whose rows are all kept, in order and in their own dtype, is stored as it is
        instead of copied into fresh memory.
        """
        with self.lock:
            for layer_id, tensor in rows.items():
                self._check_rows(layer_id, tensor, meta, layer_names.get(layer_id))
            if not rows or meta.shape[0] == 0:
                return
            labels = meta.detach().numpy()
            req_idx = labels[:, 0]
            self._check_indices(next(iter(rows)), req_idx)
            for layer_id, tensor in rows.items():
                self._check_width(layer_id, tensor)
            unblocked: np.ndarray | None = None  # rows kept, ascending; None: all
            if self._failed_requests or self.elided_reqs:
                blocked = self._blocked[req_idx]
                if blocked.any():
                    unblocked = np.flatnonzero(~blocked)
            count = req_idx.size if unblocked is None else unblocked.size
            # The chunk layout of the first `keep` rows; layers share it (their budgets agree
            # unless a layer was enabled later), and chunks never modify these arrays in place.
            layouts: dict[int, tuple] = {}
            takes = []  # (layer, source rows, layout, dtype)
            fewest_kept = count
            for layer_id, tensor in rows.items():
                keep = self._limit_rows(layer_id, count)
                fewest_kept = min(fewest_kept, keep)
                if keep == 0:
                    continue
                if keep not in layouts:
                    layouts[keep] = self._chunk_layout(labels, unblocked, keep, arrival)
                dtype = tensor.dtype if self.config.dtype is None else self.config.dtype
                takes.append((layer_id, tensor.detach(), layouts[keep], dtype))
            incoming = sum(source.nbytes for _, source, _, _ in takes)
            adopt = adopt and self._bytes_stored + incoming <= ADOPT_BYTES
            copies = _copy_all([(source, layout[0], dtype) for _, source, layout, dtype in takes],
                               adopt)
            for (layer_id, _, layout, dtype), copy in zip(takes, copies):
                _, chunk_meta, reqs, starts, lens = layout
                self._add_chunk(layer_id, _Chunk(copy, chunk_meta, reqs, starts, lens))
                self._layer_dtypes.setdefault(layer_id, set()).add(dtype)
                self.layer_names[layer_id] = layer_names[layer_id]
            self._budget_dropped += count - fewest_kept

    def _chunk_layout(self, labels: np.ndarray, unblocked: np.ndarray | None, keep: int,
                      arrival: np.ndarray | None = None):
        """``(kept rows, their labels, requests, span starts, span lengths)`` of a chunk holding
        the first ``keep`` unblocked rows (by ``arrival`` where given), grouped by request in
        registration order (one stable argsort), each request's rows staying in batch order."""
        candidates = labels.shape[0] if unblocked is None else unblocked.size
        if arrival is not None and keep < candidates:
            rows = np.arange(labels.shape[0]) if unblocked is None else unblocked
            unblocked = np.sort(rows[np.argsort(arrival[rows], kind="stable")[:keep]])
        if unblocked is None:
            kept: np.ndarray | slice = slice(0, keep)
        else:
            kept = unblocked[:keep]
            if int(kept[-1]) - int(kept[0]) + 1 == keep:
                kept = slice(int(kept[0]), int(kept[0]) + keep)
        owners = labels[:, 0][kept]
        ranks = self._rank[owners]
        steps = ranks[1:] - ranks[:-1]
        if (steps < 0).any():
            order = np.argsort(ranks, kind="stable")
            kept = order + kept.start if isinstance(kept, slice) else kept[order]
            owners = owners[order]
            ranks = ranks[order]
            steps = ranks[1:] - ranks[:-1]
        starts = np.flatnonzero(steps)
        starts += 1
        starts = np.concatenate((_ZERO, starts))
        lens = np.empty_like(starts)
        np.subtract(starts[1:], starts[:-1], out=lens[:-1])
        lens[-1] = keep - starts[-1]
        chunk_meta = (np.take(labels, kept, axis=0) if isinstance(kept, np.ndarray)
                      else labels[kept].copy())
        return kept, chunk_meta, owners[starts].astype(np.int64), starts, lens

    def _add_chunk(self, layer_id: int, chunk: _Chunk) -> None:
        chunk_id = self._next_chunk
        self._next_chunk += 1
        self.chunks.setdefault(layer_id, {})[chunk_id] = chunk
        self._unindexed[chunk_id] = layer_id
        self._live[chunk.reqs] += chunk.lens  # reqs are distinct
        self._layer_rows[layer_id] = self._layer_rows.get(layer_id, 0) + chunk.rows
        self._bytes_stored += chunk.nbytes
        storage = chunk.tensor.untyped_storage()
        if storage.nbytes() > _nbytes(chunk.tensor):
            self._shared.setdefault(storage.data_ptr(), (storage.nbytes(), set()))[1].add(
                (layer_id, chunk_id))

    def _unshare(self, layer_id: int, chunk_id: int, chunk: _Chunk) -> None:
        """``chunk`` leaves its host buffer (freed, compacted): ``_settle_shared`` looks at the
        buffer once the whole fetch or drop is done."""
        ptr = chunk.tensor.untyped_storage().data_ptr()
        entry = self._shared.get(ptr)
        if entry is None:
            return
        entry[1].discard((layer_id, chunk_id))
        if entry[1]:
            self._left_on_shared.add(ptr)
        else:
            del self._shared[ptr]

    def _settle_shared(self) -> None:
        """Copy the chunks left on a drain's buffer out where they hold less than half of it, so
        that they do not keep it all alive. Run after a whole fetch or drop, which would
        otherwise copy chunks it is about to free."""
        for ptr in self._left_on_shared:
            entry = self._shared.get(ptr)
            if entry is None:
                continue
            size, keys = entry
            left = [self.chunks[layer][key] for layer, key in keys]
            if 2 * sum(_nbytes(c.tensor) for c in left) >= size:
                continue
            del self._shared[ptr]
            for kept in left:
                try:
                    kept.set_rows(kept.tensor.clone(), kept.meta)
                except (MemoryError, RuntimeError):
                    logger.warning("vllm-capture: no host memory to copy a chunk out of its "
                                   "drain's buffer; the buffer stays")
        self._left_on_shared.clear()

    def _check_rows(
        self, layer_id: Any, tensor: Any, meta: Any, layer_name: Any
    ) -> None:
        if not isinstance(layer_id, int) or isinstance(layer_id, bool) or layer_id < 0:
            raise RuntimeError(f"capture layer id must be a nonnegative int, got {layer_id!r}")
        if self.config.layers is not None and layer_id not in self.config.layers:
            raise RuntimeError(
                f"capture layer {layer_id} is not one of this stream's layers "
                f"{sorted(self.config.layers)}"
            )
        if not isinstance(layer_name, str):
            raise RuntimeError(f"capture layer {layer_id} needs a str layer_name")
        if (
            not isinstance(meta, torch.Tensor)
            or meta.ndim != 2
            or meta.shape[1] != 3
            or meta.dtype != torch.int32
        ):
            raise RuntimeError(
                f"capture layer {layer_id} requires int32 [rows, 3] row labels"
            )
        if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2:
            raise RuntimeError(f"capture layer {layer_id} rows must be a 2-D tensor")
        if meta.shape[0] != tensor.shape[0]:
            raise RuntimeError(
                f"capture meta rows ({meta.shape[0]}) != data rows "
                f"({tensor.shape[0]}) for layer {layer_id}"
            )
        if tensor.device.type != "cpu" or meta.device.type != "cpu":
            raise RuntimeError(
                f"capture layer {layer_id} rows must be host tensors; the drain "
                "moves them off the device before append()"
            )
        stored = tensor.dtype if self.config.dtype is None else self.config.dtype
        if not tensor.is_floating_point() or stored not in WIRE_TORCH_DTYPES:
            raise RuntimeError(
                f"capture layer {layer_id} rows of dtype {tensor.dtype} cannot be "
                "stored; expected float32, float16 or bfloat16 (or set dtype)"
            )

    def _check_indices(self, layer_id: int, req_idx: np.ndarray) -> None:
        if (
            int(req_idx.min()) >= 0
            and int(req_idx.max()) < self._assigned.size
            and self._assigned[req_idx].all()
        ):
            return
        unknown = [index for index in np.unique(req_idx).tolist() if index not in self.req_table]
        raise RuntimeError(
            f"capture layer {layer_id} rows carry request indices "
            f"{unknown[:5]} that this stream never assigned (or already "
            "released); labels must come from request_index()"
        )

    def _check_width(self, layer_id: int, tensor: torch.Tensor) -> None:
        layer = self.chunks.get(layer_id)
        if not layer:
            return
        width = next(iter(layer.values())).tensor.shape[1]
        if tensor.shape[1] != width:
            raise RuntimeError(
                f"capture layer {layer_id} rows are {tensor.shape[1]} wide but the "
                f"layer already holds rows {width} wide"
            )

    def count_dropped(self, count: int) -> None:
        """Count selected rows that never reached the store: rows past a step's
        capacity (the capture buffer), or rows of a reduction that a fetch
        closed early.

        They share ``tokens_dropped`` with budget drops because a client
        cares that its sample is incomplete, not where it was cut.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"dropped row count must be a nonnegative int, got {count!r}")
        with self.lock:
            self._ring_dropped += count

    @property
    def tokens_dropped(self) -> int:
        """Selected rows (sequence tokens) that were not stored, each counted once."""
        with self.lock:
            return self._ring_dropped + self._budget_dropped

    def _limit_rows(self, layer_id: int, count: int) -> int:
        budget = self.config.budget_rows
        if budget is None:
            return count
        keep = min(count, max(0, budget - self._layer_rows.get(layer_id, 0)))
        if keep < count and not self._warned_budget:
            self._warned_budget = True
            logger.warning(
                "Capture row budget (%d rows per layer) reached; further "
                "rows are dropped and counted in tokens_dropped.",
                budget,
            )
        return keep

    # ------------------------------------------------------------ spans & chunks

    def _index_chunks(self) -> None:
        """Enter the live spans of not yet indexed chunks in ``_request_chunks``.

        Batched: one Python step per (request, layer), not per span.
        """
        if not self._unindexed:
            return
        pending, self._unindexed = self._unindexed, {}
        chunks = [self.chunks[layer_id][chunk_id] for chunk_id, layer_id in pending.items()]
        counts = np.fromiter((c.reqs.size for c in chunks), dtype=np.int64, count=len(chunks))
        live = np.concatenate([c.live for c in chunks])
        reqs = np.concatenate([c.reqs for c in chunks])[live]  # live chunks: never empty
        chunk_ids = np.repeat(np.fromiter(pending, dtype=np.int64, count=len(chunks)), counts)
        layer_ids = np.repeat(
            np.fromiter(pending.values(), dtype=np.int64, count=len(chunks)), counts
        )
        slots = np.arange(live.size, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        starts = np.concatenate([c.starts for c in chunks])
        lens = np.concatenate([c.lens for c in chunks])
        chunk_ids, layer_ids = chunk_ids[live], layer_ids[live]
        slots, starts, lens = slots[live], starts[live], lens[live]
        order = np.lexsort((chunk_ids, layer_ids, reqs))
        reqs, layer_ids = reqs[order], layer_ids[order]
        change = np.empty(reqs.size, dtype=bool)
        change[0] = True
        change[1:] = (reqs[1:] != reqs[:-1]) | (layer_ids[1:] != layer_ids[:-1])
        edges = np.flatnonzero(change).tolist() + [reqs.size]
        reqs_l, layers_l, chunk_l = reqs.tolist(), layer_ids.tolist(), chunk_ids[order].tolist()
        entries = list(zip(slots[order].tolist(), starts[order].tolist(), lens[order].tolist()))
        by_request = self._request_chunks
        for a, b in zip(edges, edges[1:]):
            by_layer = by_request[reqs_l[a]]
            held = by_layer.get(layers_l[a])
            if held is None:
                by_layer[layers_l[a]] = dict(zip(chunk_l[a:b], entries[a:b]))
            else:
                held.update(zip(chunk_l[a:b], entries[a:b]))

    @staticmethod
    def _spans_at(
        chunk_ids: list[int], reqs: list[int], entries: list[tuple[int, int, int]]
    ) -> _Spans:
        """Spans from ``_request_chunks`` entries: (slot, start, length) per chunk."""
        table = np.array(entries, dtype=np.int64).reshape(-1, 3)
        return _Spans(
            np.array(chunk_ids, dtype=np.int64),
            np.array(reqs, dtype=np.int64),
            table[:, 0],
            table[:, 1],
            table[:, 2],
        )

    def _scan_spans(self, layer_id: int, selected: np.ndarray | None) -> _Spans:
        """Every live span of one layer (of ``selected`` requests, if given)."""
        layer = self.chunks[layer_id]
        chunks = list(layer.values())
        counts = np.fromiter((c.reqs.size for c in chunks), dtype=np.int64, count=len(chunks))
        keep = np.concatenate([c.live for c in chunks])
        reqs = np.concatenate([c.reqs for c in chunks])
        if selected is not None:
            wanted = np.zeros(self._rank.size, dtype=bool)
            wanted[selected] = True
            keep &= wanted[reqs]
        firsts = np.cumsum(counts) - counts
        slots = np.arange(reqs.size, dtype=np.int64) - np.repeat(firsts, counts)
        return _Spans(
            np.repeat(np.fromiter(layer, dtype=np.int64, count=len(chunks)), counts)[keep],
            reqs[keep],
            slots[keep],
            np.concatenate([c.starts for c in chunks])[keep],
            np.concatenate([c.lens for c in chunks])[keep],
        )

    def _layer_spans(self, layer_id: int, selected: set[int] | None) -> _Spans | None:
        """The live spans a fetch of ``selected`` requests (None: all) emits."""
        wanted = None
        if selected is not None:
            by_request = self._request_chunks
            found = sum(len(by_request[index].get(layer_id, ())) for index in selected)
            if found == 0:
                return None
            # Few spans: read them off the per-request index; many: scan the layer.
            if found <= 2 * len(self.chunks[layer_id]):
                chunk_ids: list[int] = []
                reqs: list[int] = []
                entries: list[tuple[int, int, int]] = []
                for index in selected:
                    held = by_request[index].get(layer_id)
                    if held:
                        chunk_ids.extend(held)
                        entries.extend(held.values())
                        reqs.extend([index] * len(held))
                return self._spans_at(chunk_ids, reqs, entries)
            wanted = np.fromiter(selected, dtype=np.int64, count=len(selected))
        spans = self._scan_spans(layer_id, wanted)
        return spans if spans.req.size else None

    def _plan_gather(self, layer_id: int, spans: _Spans) -> _GatherPlan:
        """Plan the copy of the spans' rows in wire order, and copy their labels.

        Wire order: requests by registration, each request's rows in append
        (chunk id) order.
        """
        layer = self.chunks[layer_id]
        chunk_ids = np.fromiter(layer, dtype=np.int64, count=len(layer))
        span_chunks = np.searchsorted(chunk_ids, spans.chunk)
        total = int(spans.length.sum())
        first = layer[int(spans.chunk[0])]
        if first.rows == total and (spans.chunk == spans.chunk[0]).all():
            rows = slice(0, total)  # the whole chunk, in wire order
            return _GatherPlan(first.tensor.dtype, total, [int(span_chunks[0])], [(0, rows, rows)],
                               first.meta, spans, span_chunks)
        order = np.lexsort((spans.chunk, self._rank[spans.req]))
        sources = _distinct(span_chunks)
        in_layer = list(layer.values())
        chunks = [in_layer[p] for p in sources]
        source = np.searchsorted(sources, span_chunks)  # each span's chunk, in chunks
        dtypes = self._layer_dtypes[layer_id]
        if len(dtypes) > 1:  # only what these chunks hold
            dtypes = {chunk.tensor.dtype for chunk in chunks}
        dtype = functools.reduce(torch.promote_types, dtypes)
        spans_count = spans.req.size
        row_bytes = first.tensor.shape[1] * dtype.itemsize
        if (
            len(dtypes) == 1
            and spans_count > 8
            and total * row_bytes < _SCATTER_SPAN_BYTES * spans_count
            and spans_count > 8 * len(chunks)
        ):
            # Many small spans per chunk (decode steps drained together): a Python
            # step per span would dominate, so scatter each chunk's rows at once.
            pieces = self._scatter(chunks, source, spans, order, total)
        else:
            # Few or long spans: their row ranges, one after another in wire order.
            starts, lens = spans.start[order], spans.length[order]
            dst = np.cumsum(lens) - lens
            pieces = [
                (i, slice(s, s + n), slice(d, d + n))
                for i, s, n, d in zip(
                    source[order].tolist(), starts.tolist(), lens.tolist(), dst.tolist()
                )
            ]
        meta = np.empty((total, 3), dtype=np.int32)
        for i, src, to in pieces:
            meta[to] = chunks[i].meta[src]
        return _GatherPlan(dtype, total, sources, pieces, meta, spans, span_chunks)

    @staticmethod
    def _scatter(
        chunks: list[_Chunk], source: np.ndarray, spans: _Spans, order: np.ndarray, total: int
    ) -> list[tuple[int, np.ndarray | slice, np.ndarray]]:
        """Many small spans per chunk: one row scatter per chunk, as
        ``(index in chunks, source rows, destination rows)``; ``source`` is each
        span's chunk, as its index in ``chunks`` (in chunk id order).

        Within a chunk, spans ascend in both source and destination rows: the
        chunk stores its requests in registration order.
        """
        lens = spans.length
        dst = np.empty_like(lens)
        dst[order] = np.cumsum(lens[order]) - lens[order]
        by_chunk = np.lexsort((spans.start, source))
        source = source[by_chunk]
        starts, lens, dst = spans.start[by_chunk], lens[by_chunk], dst[by_chunk]
        first_row = np.cumsum(lens) - lens
        span_of = np.repeat(np.arange(lens.size), lens)
        within = np.arange(total, dtype=np.int64) - first_row[span_of]
        src_rows, dst_rows = starts[span_of] + within, dst[span_of] + within
        edges = _run_starts(source)
        row_edges = first_row[edges].tolist() + [total]
        pieces = []
        for g, index in enumerate(source[edges].tolist()):
            chunk = chunks[index]
            r0, r1 = row_edges[g], row_edges[g + 1]
            # The whole chunk (in order) or some of its rows.
            src = slice(0, chunk.rows) if r1 - r0 == chunk.rows else src_rows[r0:r1]
            pieces.append((index, src, dst_rows[r0:r1]))
        return pieces

    def _kill(self, layer_id: int, spans: _Spans) -> None:
        """Remove the spans' rows: free emptied chunks, compact sparse ones.

        ``spans`` holds every live span in this layer of each request it
        names (fetches, discards and layer drops all take whole requests), so
        those requests simply leave the layer's per-request index.
        """
        layer = self.chunks[layer_id]
        unindexed = self._unindexed
        by_request = self._request_chunks
        for index in _distinct(spans.req):
            by_request[index].pop(layer_id, None)
        np.subtract.at(self._live, spans.req, spans.length)
        self._layer_rows[layer_id] -= int(spans.length.sum())
        if spans.chunk.size > 1:
            order = np.argsort(spans.chunk, kind="stable")
            chunk_ids, slots, lens = spans.chunk[order], spans.slot[order], spans.length[order]
        else:
            chunk_ids, slots, lens = spans.chunk, spans.slot, spans.length
        edges = _run_starts(chunk_ids)
        group_rows = np.add.reduceat(lens, edges).tolist()
        bounds = edges.tolist() + [chunk_ids.size]
        for g, chunk_id in enumerate(chunk_ids[edges].tolist()):
            chunk = layer[chunk_id]
            a, b = bounds[g], bounds[g + 1]
            if b - a == 1:
                chunk.live[slots[a]] = False
            else:
                chunk.live[slots[a:b]] = False
            chunk.live_rows -= group_rows[g]
            if chunk.live_rows == 0:
                del layer[chunk_id]
                unindexed.pop(chunk_id, None)
                self._bytes_stored -= chunk.nbytes
                self._unshare(layer_id, chunk_id, chunk)
            elif 2 * chunk.live_rows < chunk.rows:
                self._compact(layer_id, chunk_id, chunk)
        if not layer:
            self._forget_layer(layer_id)

    def _forget_layer(self, layer_id: int) -> None:
        del self.chunks[layer_id]
        del self._layer_rows[layer_id]
        del self._layer_dtypes[layer_id]
        del self.layer_names[layer_id]

    def _compact(self, layer_id: int, chunk_id: int, chunk: _Chunk) -> None:
        """Copy a chunk's live rows into a smaller tensor, releasing the dead ones."""
        slots = np.flatnonzero(chunk.live)
        lens = chunk.lens[slots]
        starts = np.cumsum(lens) - lens
        first = int(chunk.starts[slots[0]])
        rows: np.ndarray | slice
        before = chunk.nbytes
        try:
            if int(chunk.starts[slots[-1]] + lens[-1]) - first == chunk.live_rows:
                rows = slice(first, first + chunk.live_rows)  # one run of rows
            else:
                rows = np.repeat(chunk.starts[slots] - starts, lens) + np.arange(
                    chunk.live_rows, dtype=np.int64
                )
            tensor, meta = _take(chunk.tensor, rows, chunk.tensor.dtype), chunk.meta[rows].copy()
        except (MemoryError, RuntimeError):
            # Compacting only frees memory; failing part-way through a clear would leave some
            # layers cleared and others not. Without room for the copy, the chunk stays sparse.
            logger.warning("vllm-capture: no host memory to compact a chunk; it stays sparse")
            return
        self._unshare(layer_id, chunk_id, chunk)
        chunk.set_rows(tensor, meta)
        chunk.reqs, chunk.starts, chunk.lens = chunk.reqs[slots], starts, lens
        chunk.live = np.ones(slots.size, dtype=bool)
        self._bytes_stored += chunk.nbytes - before
        if chunk_id not in self._unindexed:
            by_request = self._request_chunks
            for slot, (req, start, length) in enumerate(
                zip(chunk.reqs.tolist(), starts.tolist(), lens.tolist())
            ):
                by_request[req][layer_id][chunk_id] = (slot, start, length)

    # ------------------------------------------------------------------- fetches

    def serialize(
        self,
        layers: list[int] | None = None,
        req_ids: list[str] | None = None,
        clear_selected: bool = False,
        raw_data: bool = False,
        build: Callable[[dict[int, dict[str, Any]]], Any] | None = None,
    ) -> Any:
        """Pack the selected rows as ``{layer_id: wire dict}``.

        With ``raw_data`` each ``"data"`` is a ``FetchedRows`` instead of bytes:
        the rows are not copied here, and the caller copies them once, into its
        own buffer (``FetchedRows.copy_into``), before the dict goes on the wire.

        ``layers`` serializes a subset so clients can fetch layer by layer;
        ``req_ids`` (client-visible ids, or full engine ids) restricts the
        payload to those requests' rows, and with ``clear_selected`` the
        emitted rows leave the store, so clients drain request by request
        with a bounded message size. Layers with no selected rows are absent.

        Row order within a layer: requests in the order they were first
        registered with ``request_index``, and each request's rows in append
        order — so a request's rows are contiguous and position-ordered for
        an ordinary generation.

        ``build``, when given, makes what is returned from that dict (the
        worker's reply, its rows copied out), under the lock and before
        ``clear_selected`` removes anything: if it raises, every row stays.
        """
        check_fetch_filters(layers, req_ids)
        with self.lock:
            wanted = self._wanted_layers(layers)
            self._check_servable(req_ids)
            selected = None if req_ids is None else self._indices_for(req_ids)
            if selected:
                self._index_chunks()
            result: dict[int, dict[str, Any]] = {}
            emitted: list[tuple[int, _GatherPlan | None, tuple[int, _Chunk] | None]] = []
            # The last layer planned and its plan: a layer whose chunks match its chunk for chunk
            # (every layer one drain appends) gathers by the same plan, where planning (a Python
            # step per span) would cost most of the fetch.
            planned: tuple[dict[int, _Chunk], _GatherPlan] | None = None
            # Layers whose rows carry the same labels share one encoding: those one append left
            # whole share the labels array itself, those gathered by one plan too, those
            # gathered from several appends an equal one (a stream's layers store the same
            # rows), each compared with the last encoded.
            encoded: tuple[np.ndarray, dict[str, Any]] | None = None
            for layer_id in wanted:
                # A fetch of every request takes a layer held in one chunk, all of it live (as
                # one append of a generate's reductions leaves it), as it is: no spans.
                whole = self._whole_layer(layer_id) if selected is None else None
                if whole is not None:
                    plan = None
                    rows, meta = _whole_rows(whole[1]), whole[1].meta
                else:
                    layer = self.chunks[layer_id]
                    if planned is None or not _same_chunks(planned[0], layer):
                        spans = self._layer_spans(layer_id, selected)
                        if spans is None:
                            continue
                        planned = (layer, self._plan_gather(layer_id, spans))
                    plan = planned[1]
                    rows, meta = plan.rows_in(layer), plan.meta
                if encoded is None or not _same_values(encoded[0], meta):
                    encoded = (meta, encode_capture_labels(meta, self.req_table))
                result[layer_id] = encode_capture_layer(
                    rows.dtype,
                    rows.shape,
                    rows if raw_data else rows.tobytes(),
                    encoded[1],
                    self.layer_names[layer_id],
                )
                emitted.append((layer_id, plan, whole))
            # The reply is built (copied into its file or bytes) before any row leaves: a failure
            # there raises with every row still stored.
            out = result if build is None else build(result)
            if clear_selected:
                touched: set[int] = set()
                for layer_id, plan, whole in emitted:
                    if whole is None:
                        spans = plan.spans_in(self.chunks[layer_id])
                        touched.update(_distinct(spans.req))
                        self._kill(layer_id, spans)
                    else:
                        touched.update(whole[1].reqs.tolist())
                        self._drop_whole_layer(layer_id, *whole)
                self._settle_shared()
                self._reclaim_requests(touched)
            return out

    def _whole_layer(self, layer_id: int) -> tuple[int, _Chunk] | None:
        """``(chunk id, chunk)`` when the layer is one chunk whose rows are all live."""
        layer = self.chunks[layer_id]
        if len(layer) != 1:
            return None
        chunk_id, chunk = next(iter(layer.items()))
        return (chunk_id, chunk) if chunk.live_rows == chunk.rows else None

    def _drop_whole_layer(self, layer_id: int, chunk_id: int, chunk: _Chunk) -> None:
        """Remove a layer that ``_whole_layer`` found whole: ``_kill`` of every span at once."""
        if self._unindexed.pop(chunk_id, None) is None:
            by_request = self._request_chunks
            for index in chunk.reqs.tolist():
                by_request[index].pop(layer_id, None)
        self._live[chunk.reqs] -= chunk.lens  # reqs are distinct
        self._bytes_stored -= chunk.nbytes
        self._forget_layer(layer_id)
        self._unshare(layer_id, chunk_id, chunk)

    def _wanted_layers(self, layers: list[int] | None) -> list[int]:
        if layers is None:
            return sorted(self.chunks)
        return [layer for layer in dict.fromkeys(layers) if layer in self.chunks]

    def _check_servable(self, req_ids: list[str] | None) -> None:
        if self._lost is not None:
            raise RuntimeError(
                f"rows of this stream were lost before they were stored ({self._lost}), so "
                "what it holds is incomplete; clear the stream to go on.")

        def concerned(req_id: str) -> bool:
            return req_ids is None or any(
                match_capture_request_id(req_id, wanted) for wanted in req_ids
            )

        failed = {rid: why for rid, why in self._failed_requests.items() if concerned(rid)}
        if failed:
            raise RuntimeError(
                f"capture contains failed request(s) {list(failed.items())[:5]}; "
                "their rows do not represent valid capture. Fetch with "
                "req_ids excluding them, or clear the stream."
            )
        elided = sorted(rid for rid in self.elided_reqs if concerned(rid))
        if elided:
            raise RuntimeError(
                f"request(s) {elided[:5]}: positions their selection wanted were never "
                "captured (a prefix-cache hit skipped computing them, on admission or on "
                "resuming after preemption, or the stream started after the request), so "
                "this capture is incomplete. Submit capture requests with "
                "SamplingParams(skip_reading_prefix_cache=True) (through a server: a cache_salt "
                "of their own) after starting the stream, fetch with req_ids excluding them, or "
                "clear the stream."
            )

    def _indices_for(self, req_ids: list[str]) -> set[int]:
        return {
            index for req_id in req_ids for index in self._request_aliases.get(req_id, ())
        }

    def clear(self, still_failed: Iterable[str] = (), still_elided: Iterable[str] = ()) -> None:
        """Drop every row, error and counter; keep active requests' indices.

        Active requests keep their labels because the planner already holds
        them for rows still to come; finished ones are released. The failures
        of ``still_failed`` (requests still running, whose rows will not be
        captured) stay, and so do the elisions of ``still_elided`` (requests
        whose open reductions lack positions for good).
        """
        with self.lock:
            still_failed = set(still_failed)  # read once: an iterator would be spent by one test
            kept = {r: why for r, why in self._failed_requests.items() if r in still_failed}
            elided = self.elided_reqs & set(still_elided)
            self.chunks.clear()
            self._shared.clear()
            self._left_on_shared.clear()
            self._unindexed.clear()
            self.layer_names.clear()
            self._layer_rows.clear()
            self._layer_dtypes.clear()
            self._bytes_stored = 0
            for by_layer in self._request_chunks.values():
                by_layer.clear()
            self._live[:] = 0
            self._blocked[:] = False
            self.elided_reqs.clear()
            self._failed_requests.clear()
            self._lost = None
            self._ring_dropped = 0
            self._budget_dropped = 0
            self._warned_budget = False
            self._reclaim_requests(set(self._finished))
            for req_id, why in kept.items():
                self.fail_request(req_id, why)
            for req_id in elided:
                self.mark_elided(req_id)

    def drop_layers(self, layers: list[int]) -> None:
        """Release every row of the given layers (after a layer-wise fetch)."""
        check_fetch_filters(layers, None)
        with self.lock:
            touched: set[int] = set()
            for layer_id in self._wanted_layers(layers):
                spans = self._scan_spans(layer_id, None)
                touched.update(_distinct(spans.req))
                self._kill(layer_id, spans)
            self._settle_shared()
            self._reclaim_requests(touched)

    def status(self) -> dict[str, int]:
        """Storage counters for the status RPC (msgpack-safe ints), and why rows were lost
        (``rows_lost``: None where none were)."""
        with self.lock:
            return {
                "layers_captured": len(self.chunks),
                "tokens_stored": self.tokens_stored,
                "tokens_dropped": self.tokens_dropped,
                "cache_elided_reqs": len(self.elided_reqs),
                "failed_reqs": len(self._failed_requests),
                "rows_lost": self._lost,
                "requests": len(self.req_table),
                "bytes_stored": self._bytes_stored,
            }


def _aliases(req_id: str) -> set[str]:
    """Ids a client may fetch this engine request by: its own and, when it
    carries the engine's uniqueness suffix, the client-visible id."""
    client_id = req_id[:-9]
    if len(req_id) >= 9 and match_capture_request_id(req_id, client_id):
        return {req_id, client_id}
    return {req_id}


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values of a non-empty int array (often all equal), ascending.

    Sort-based: np.unique's first call in a process imports modules (~0.1 s).
    """
    head = int(values[0])
    if (values == head).all():
        return [head]
    ordered = np.sort(values)
    return ordered[_run_starts(ordered)].tolist()


def _same_chunks(planned: dict[int, _Chunk], layer: dict[int, _Chunk]) -> bool:
    """Whether ``layer``'s chunks match ``planned``'s chunk for chunk: the same rows of one dtype
    and width, labels, spans and live spans, so that a gather plan of one is the other's. Chunks
    one drain appends share their label and span arrays, found equal at once."""
    if len(planned) != len(layer):
        return False
    for a, b in zip(planned.values(), layer.values()):
        if (a.tensor.dtype != b.tensor.dtype or a.tensor.shape != b.tensor.shape
                or a.live_rows != b.live_rows or not _same_values(a.meta, b.meta)
                or not _same_values(a.reqs, b.reqs) or not _same_values(a.starts, b.starts)
                or not _same_values(a.lens, b.lens)):
            return False
        # Live flags are each chunk's own; chunks all live hold the same ones.
        if a.live_rows != a.rows and not np.array_equal(a.live, b.live):
            return False
    return True


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two arrays are one, or of one shape and equal."""
    return a is b or (a.shape == b.shape and np.array_equal(a, b))


def _whole_rows(chunk: _Chunk) -> FetchedRows:
    """All of a chunk's rows, in its order (which is wire order)."""
    rows = slice(0, chunk.rows)
    return FetchedRows(chunk.tensor.dtype, chunk.rows, [(chunk.tensor, chunk.raw)],
                       [(0, rows, rows)])


def _run_starts(values: np.ndarray) -> np.ndarray:
    """Indices where a run of equal values starts (``values`` non-empty)."""
    change = np.empty(values.size, dtype=bool)
    change[0] = True
    np.not_equal(values[1:], values[:-1], out=change[1:])
    return np.flatnonzero(change)


def _copy_all(takes: list[tuple[torch.Tensor, np.ndarray | slice, torch.dtype]],
              adopt: bool = False) -> list[torch.Tensor]:
    """``_take(*take)`` for each take: on ``APPEND_THREADS`` threads when they copy at least
    ``_PARALLEL_APPEND`` bytes. Rows arriving in an empty store land in fresh memory, whose
    first-touch page faults cost 1-2 GB/s per thread (torch and numpy copies release the GIL).
    With ``adopt``, a take of all of a contiguous source's rows in its own dtype is the source."""
    global _append_pool
    out: list[torch.Tensor | None] = [
        source if adopt and _whole(source, rows, dtype) else None for source, rows, dtype in takes]
    todo = [i for i, kept in enumerate(out) if kept is None]
    nbytes = sum(_rows(takes[i][1]) * takes[i][0].shape[1] * takes[i][0].element_size()
                 for i in todo)
    if len(todo) < 2 or nbytes < _PARALLEL_APPEND or APPEND_THREADS < 2:
        copies = [_take(*takes[i]) for i in todo]
    else:
        if _append_pool is None:
            _append_pool = concurrent.futures.ThreadPoolExecutor(APPEND_THREADS,
                                                                 "vllm-capture-store")
        try:
            futures = [_append_pool.submit(_take, *takes[i]) for i in todo]
        except RuntimeError:
            # The interpreter is exiting and has shut the pool down (before the session's own
            # exit hook ends the harvest thread): this batch is stored on this thread.
            futures = None
        copies = ([_take(*takes[i]) for i in todo] if futures is None
                  else [f.result() for f in futures])
    for i, copy in zip(todo, copies):
        out[i] = copy
    return out


def _whole(source: torch.Tensor, rows: np.ndarray | slice, dtype: torch.dtype) -> bool:
    """Whether ``rows`` are all of ``source``'s, in order, and it is kept as it is."""
    return (isinstance(rows, slice) and rows.start == 0 and rows.stop == source.shape[0]
            and source.dtype == dtype and source.is_contiguous())


def _rows(rows: np.ndarray | slice) -> int:
    return rows.stop - rows.start if isinstance(rows, slice) else rows.size


def _cut(rows: np.ndarray | slice, first: int, last: int) -> np.ndarray | slice:
    """Rows ``first:last`` of ``rows`` (a slice with explicit bounds, or an index array)."""
    if isinstance(rows, slice):
        return slice(rows.start + first, rows.start + last)
    return rows[first:last]


def _take(source: torch.Tensor, rows: np.ndarray | slice, dtype: torch.dtype) -> torch.Tensor:
    """Copy ``rows`` of 2-D ``source`` into a fresh tensor only the store references.

    A view would keep the drain's whole buffer (and rows the store does not
    keep) alive, and the drain reuses its pinned pages.
    """
    # Slices always come with explicit bounds here.
    count = _rows(rows)
    width = source.shape[1]
    if source.dtype != dtype or count * width * source.element_size() >= _LARGE_COPY:
        # torch casts (numpy has no bfloat16) and copies large blocks with its
        # intra-op threads where it has them.
        if isinstance(rows, slice):
            out = torch.empty((count, width), dtype=dtype)
            out.copy_(source[rows])
            return out
        return source.index_select(0, torch.from_numpy(rows)).to(dtype)
    # torch allocates: freed blocks are reused without page faults, where
    # numpy's allocations of this size were measured to fault afresh.
    out = torch.empty((count, width), dtype=dtype)
    if isinstance(rows, slice):
        _raw(out)[...] = _raw(source)[rows]
    else:
        # mode="clip": rows are in range, and the default mode buffers ``out``.
        np.take(_raw(source), rows, axis=0, out=_raw(out), mode="clip")
    return out


def _raw(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a host tensor (bf16 as its int16 bits), sharing its memory.

    Row copies, gathers and scatters below ``_LARGE_COPY`` go through numpy:
    it moves 2-D rows at memory speed on the calling thread, where torch's
    CPU index_put_ / index_copy_ are several times slower and its intra-op
    thread pool, dispatched for every small copy, stalls when the host's
    cores are busy.
    """
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
