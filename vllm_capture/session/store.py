"""Bounded CPU storage for one capture stream, with per-request row labels.

Rows reach the store already on the host (the capture graph's drain copied
them off the device); the store owns budgets, the request-label registry and
serialization. Every stored row carries int32 labels ``(req_idx, position,
token_id)`` where ``req_idx`` indexes ``req_table`` — so clients never
re-derive sample alignment, and malformed labels are refused before any row
enters.

Rows are kept in per-request chunks: draining one request releases exactly
its memory and never copies or pins another request's rows.
"""

import collections
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_capture.session.config import StreamConfig
from vllm_capture.session.wire import (
    WIRE_TORCH_DTYPES,
    match_capture_request_id,
    serialize_capture_layer,
)

logger = logging.getLogger("vllm_capture")

# Containers accepted for ``layers`` / ``req_ids``; a bare str would iterate
# as characters and silently select nothing.
_ID_LISTS = (list, tuple, set, frozenset)


@dataclass(frozen=True)
class _StoredChunk:
    tensor: torch.Tensor
    meta: torch.Tensor
    request_index: int


class StreamStore:
    """Bounded, chunk-appending CPU store for one capture stream.

    Request labels are small ints so the device-side planner can write them
    into int32 columns; ``request_index`` hands them out and recycles them.
    An index returns to the pool only when its request has finished AND none
    of its rows remain, so a recycled index can never make old rows look like
    they belong to a new request. The session must call ``finish_request``
    only after every row of that request has been appended (after the drain
    of its last step): rows that arrive for a released index would otherwise
    be refused, or, once it is reused, attributed to its new owner.

    Every public method holds ``lock`` (reentrant, so a caller that already
    holds it to group calls does not deadlock).
    """

    def __init__(self, config: StreamConfig):
        self.config = config
        # layer -> chunk id -> chunk; chunk ids grow monotonically, so a
        # layer's dict is in append order.
        self.chunks: dict[int, dict[int, _StoredChunk]] = {}
        self._next_chunk = 0
        # request index -> layer -> chunk ids (dict as an ordered set).
        self._request_chunks: dict[int, dict[int, dict[int, None]]] = {}
        self.layer_names: dict[int, str] = {}
        self.req_table: dict[int, str] = {}
        self._req_index: dict[str, int] = {}
        # Client-visible id (and the full engine id) -> request indices.
        self._request_aliases: dict[str, set[int]] = {}
        # Registration order; serialize() orders requests by it.
        self._first_seen: dict[int, int] = {}
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
        # Rows held per layer: the budget caps each layer at budget_rows,
        # and draining frees room, so it bounds memory, not run length.
        self._layer_rows: dict[int, int] = {}
        self._bytes_stored = 0
        # Rows cut before the store (device ring) and, per layer, by the budget. A row the budget
        # cuts is cut in every layer of the stream, so it counts once: the largest layer count.
        self._ring_dropped = 0
        self._budget_dropped: dict[int, int] = {}
        self._warned_budget = False
        self.lock = threading.RLock()

    @property
    def tokens_stored(self) -> int:
        """Rows held by the fullest layer: every layer sees the same tokens."""
        with self.lock:
            return max(self._layer_rows.values(), default=0)

    # ------------------------------------------------------------------ requests

    def request_index(self, req_id: str) -> int:
        """Label index for an engine-internal request id, allocated on first use.

        Asking again for a finished request that still has rows revives it
        instead of allocating a second index for the same id.
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
            self.req_table[index] = req_id
            self._req_index[req_id] = index
            self._request_chunks[index] = {}
            self._first_seen[index] = self._registrations
            self._registrations += 1
            for alias in _aliases(req_id):
                self._request_aliases.setdefault(alias, set()).add(index)
            return index

    def finish_request(self, req_id: str) -> None:
        """Let the request's index be recycled once its rows are drained."""
        with self.lock:
            index = self._req_index.get(req_id)
            if index is None:
                return
            self._finished.add(index)
            self._reclaim_requests({index})

    def fail_request(self, req_id: str, reason: str) -> None:
        """Record that a request's capture is invalid.

        Its rows can never be fetched (serialize raises for it), so they are
        released now and later ones are discarded on arrival rather than
        holding memory until the stream is cleared.
        """
        with self.lock:
            self._failed_requests[req_id] = str(reason)
            self._discard_request_rows(req_id)

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
        for layer_id, chunk_ids in list(self._request_chunks[index].items()):
            for chunk_id in list(chunk_ids):
                self._remove_chunk(layer_id, chunk_id)
        self._reclaim_requests({index})

    def _reclaim_requests(self, indices: set[int]) -> None:
        """Release finished requests among ``indices`` that hold no rows."""
        for index in indices:
            if index in self._finished and not self._request_chunks.get(index):
                self._release_request(index)

    def _release_request(self, index: int) -> None:
        req_id = self.req_table.pop(index)
        del self._req_index[req_id]
        del self._request_chunks[index]
        del self._first_seen[index]
        self._finished.discard(index)
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
        """Store one layer's drained host rows, split per request.

        ``meta`` is int32 ``[rows, 3]`` (req_idx, position, token_id) with
        req_idx from ``request_index``. The store copies what it keeps, so the
        caller may reuse its (pinned) buffers as soon as this returns. Rows of
        failed or cache-elided requests are discarded; rows past the layer's
        budget are dropped (the first rows in row order are kept) and counted
        in ``tokens_dropped``.
        """
        with self.lock:
            self._check_rows(layer_id, tensor, meta, layer_name)
            if tensor.shape[0] == 0:
                return
            tensor = tensor.detach()
            meta = meta.detach()
            req_idx = meta[:, 0].numpy()
            unique = np.unique(req_idx).tolist()
            unknown = [index for index in unique if index not in self.req_table]
            if unknown:
                raise RuntimeError(
                    f"capture layer {layer_id} rows carry request indices "
                    f"{unknown[:5]} that this stream never assigned (or already "
                    "released); labels must come from request_index()"
                )
            servable = [i for i in unique if not self._unservable(self.req_table[i])]
            if len(servable) == len(unique):
                rows = np.arange(req_idx.size)
            else:
                rows = np.flatnonzero(np.isin(req_idx, servable))
            rows = rows[: self._limit_rows(layer_id, rows.size)]
            if rows.size == 0:
                return
            dtype = tensor.dtype if self.config.dtype is None else self.config.dtype
            # Stable sort: each request's rows keep their batch order.
            by_request = rows[np.argsort(req_idx[rows], kind="stable")]
            labels = req_idx[by_request]
            starts = np.flatnonzero(np.diff(labels, prepend=labels[0] - 1))
            for group in np.split(by_request, starts[1:]):
                self._add_chunk(
                    layer_id,
                    int(req_idx[group[0]]),
                    _take_rows(tensor, group, dtype),
                    _take_rows(meta, group, torch.int32),
                )
            self.layer_names[layer_id] = layer_name

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

    def count_dropped(self, count: int) -> None:
        """Count rows lost before they reached the store (a full device ring).

        They share ``tokens_dropped`` with budget drops because a client
        cares that its sample is incomplete, not where it was cut; the
        caller reports the cause.
        """
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(f"dropped row count must be a nonnegative int, got {count!r}")
        with self.lock:
            self._ring_dropped += count

    @property
    def tokens_dropped(self) -> int:
        """Selected rows (sequence tokens) that were not stored, each counted once."""
        return self._ring_dropped + max(self._budget_dropped.values(), default=0)

    def _limit_rows(self, layer_id: int, count: int) -> int:
        budget = self.config.budget_rows
        if budget is None:
            return count
        keep = min(count, max(0, budget - self._layer_rows.get(layer_id, 0)))
        if keep < count:
            self._budget_dropped[layer_id] = self._budget_dropped.get(layer_id, 0) + count - keep
            if not self._warned_budget:
                self._warned_budget = True
                logger.warning(
                    "Capture row budget (%d rows per layer) reached; further "
                    "rows are dropped and counted in tokens_dropped.",
                    budget,
                )
        return keep

    def _add_chunk(
        self, layer_id: int, index: int, tensor: torch.Tensor, meta: torch.Tensor
    ) -> None:
        chunk_id = self._next_chunk
        self._next_chunk += 1
        self.chunks.setdefault(layer_id, {})[chunk_id] = _StoredChunk(tensor, meta, index)
        self._request_chunks[index].setdefault(layer_id, {})[chunk_id] = None
        self._layer_rows[layer_id] = self._layer_rows.get(layer_id, 0) + tensor.shape[0]
        self._bytes_stored += _nbytes(tensor) + _nbytes(meta)

    def _remove_chunk(self, layer_id: int, chunk_id: int) -> int:
        chunk = self.chunks[layer_id].pop(chunk_id)
        self._layer_rows[layer_id] -= chunk.tensor.shape[0]
        self._bytes_stored -= _nbytes(chunk.tensor) + _nbytes(chunk.meta)
        if not self.chunks[layer_id]:
            del self.chunks[layer_id]
            del self._layer_rows[layer_id]
            del self.layer_names[layer_id]
        by_layer = self._request_chunks[chunk.request_index]
        del by_layer[layer_id][chunk_id]
        if not by_layer[layer_id]:
            del by_layer[layer_id]
        return chunk.request_index

    # ------------------------------------------------------------------- fetches

    def serialize(
        self,
        layers: list[int] | None = None,
        req_ids: list[str] | None = None,
        clear_selected: bool = False,
    ) -> dict[int, dict[str, Any]]:
        """Pack the selected rows as ``{layer_id: wire dict}``.

        ``layers`` serializes a subset so clients can fetch layer by layer;
        ``req_ids`` (client-visible ids, or full engine ids) restricts the
        payload to those requests' rows, and with ``clear_selected`` the
        emitted rows leave the store, so clients drain request by request
        with a bounded message size. Layers with no selected rows are absent.

        Row order within a layer: requests in the order they were first
        registered with ``request_index``, and each request's rows in append
        order — so a request's rows are contiguous and position-ordered for
        an ordinary generation.
        """
        with self.lock:
            if req_ids is not None and (
                not isinstance(req_ids, _ID_LISTS)
                or not all(isinstance(req_id, str) for req_id in req_ids)
            ):
                raise ValueError(f"req_ids must be a list of request id strings, got {req_ids!r}")
            wanted = self._wanted_layers(layers)
            self._check_servable(req_ids)
            selected = None if req_ids is None else self._indices_for(req_ids)
            result: dict[int, dict[str, Any]] = {}
            emitted: list[tuple[int, int]] = []
            for layer_id in wanted:
                picked = self._picked_chunks(layer_id, selected)
                if not picked:
                    continue
                result[layer_id] = serialize_capture_layer(
                    _concat([chunk.tensor for _, chunk in picked]),
                    _concat([chunk.meta for _, chunk in picked]),
                    self.req_table,
                    self.layer_names[layer_id],
                )
                emitted.extend((layer_id, chunk_id) for chunk_id, _ in picked)
            if clear_selected:
                touched = {self._remove_chunk(*key) for key in emitted}
                self._reclaim_requests(touched)
            return result

    def _wanted_layers(self, layers: list[int] | None) -> list[int]:
        if layers is None:
            return sorted(self.chunks)
        if not isinstance(layers, _ID_LISTS) or not all(
            isinstance(layer, int) and not isinstance(layer, bool) for layer in layers
        ):
            raise ValueError(f"layers must be a list of layer ids, got {layers!r}")
        return [layer for layer in dict.fromkeys(layers) if layer in self.chunks]

    def _check_servable(self, req_ids: list[str] | None) -> None:
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
                "prefix-cache hits skipped recomputation of the prompt "
                f"head for request(s) {elided[:5]}; their early "
                "rows were never computed, so this capture is "
                "incomplete. Submit capture requests with "
                "SamplingParams(skip_reading_prefix_cache=True), "
                "fetch with req_ids excluding them, or "
                "clear the stream."
            )

    def _indices_for(self, req_ids: list[str]) -> set[int]:
        return {
            index for req_id in req_ids for index in self._request_aliases.get(req_id, ())
        }

    def _picked_chunks(
        self, layer_id: int, selected: set[int] | None
    ) -> list[tuple[int, _StoredChunk]]:
        layer = self.chunks[layer_id]
        if selected is None:
            candidates = list(layer.items())
        else:
            candidates = [
                (chunk_id, layer[chunk_id])
                for index in selected
                for chunk_id in self._request_chunks[index].get(layer_id, ())
            ]
        first_seen = self._first_seen
        return sorted(
            candidates, key=lambda item: (first_seen[item[1].request_index], item[0])
        )

    def clear(self) -> None:
        """Drop every row, error and counter; keep active requests' indices.

        Active requests keep their labels because the planner already holds
        them for rows still to come; finished ones are released.
        """
        with self.lock:
            self.chunks.clear()
            self.layer_names.clear()
            self._layer_rows.clear()
            self._bytes_stored = 0
            for by_layer in self._request_chunks.values():
                by_layer.clear()
            self.elided_reqs.clear()
            self._failed_requests.clear()
            self._ring_dropped = 0
            self._budget_dropped.clear()
            self._warned_budget = False
            self._reclaim_requests(set(self._finished))

    def drop_layers(self, layers: list[int]) -> None:
        """Release every row of the given layers (after a layer-wise fetch)."""
        with self.lock:
            touched = set()
            for layer_id in self._wanted_layers(layers):
                for chunk_id in list(self.chunks[layer_id]):
                    touched.add(self._remove_chunk(layer_id, chunk_id))
            self._reclaim_requests(touched)

    def status(self) -> dict[str, int]:
        """Storage counters for the status RPC (msgpack-safe ints)."""
        with self.lock:
            return {
                "layers_captured": len(self.chunks),
                "tokens_stored": self.tokens_stored,
                "tokens_dropped": self.tokens_dropped,
                "cache_elided_reqs": len(self.elided_reqs),
                "failed_reqs": len(self._failed_requests),
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


def _take_rows(source: torch.Tensor, rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Copy ``rows`` of ``source`` into a tensor only the store references.

    A view would keep the drain's whole buffer (and other requests' rows)
    alive, and the drain reuses its pinned pages.
    """
    start, stop = int(rows[0]), int(rows[-1]) + 1
    if stop - start == rows.size:
        out = torch.empty((rows.size, source.shape[1]), dtype=dtype)
        out.copy_(source[start:stop])
        return out
    return source.index_select(0, torch.from_numpy(rows)).to(dtype)


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
