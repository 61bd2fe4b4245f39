"""The client side: build a capture-ready engine, capture prompts, get labelled tensors back."""

from __future__ import annotations

import inspect
import json
import logging
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NoReturn, Sequence

import numpy as np
import torch

from vllm_capture.checks import as_count
from vllm_capture.engine.config import CONFIG_KEY, WORKER_EXTENSION, engine_kwargs
from vllm_capture.host_pages import empty_on_huge_pages
from vllm_capture.selection import SelectSpec
from vllm_capture.server import Server
from vllm_capture.session import shm
from vllm_capture.session.components import ATTENTION_HEADS, COMPONENTS, HIDDEN_STATES
from vllm_capture.session.session import EXTRA_ARGS_KEY
from vllm_capture.session.wire import CaptureMeta, deserialize_captured, match_capture_request_id

logger = logging.getLogger("vllm_capture")


def LLM(model: str, *, capture_components: Sequence[str] = COMPONENTS,
        capture_buffer_bytes: int | None = None, capture_reduce_slots: int | None = None,
        **llm_kwargs):
    """A ``vllm.LLM`` with capture installed (graphs and compilation stay as vLLM sets them)."""
    from vllm import LLM as VllmLLM

    extra = {}
    if capture_buffer_bytes is not None:
        extra["buffer_bytes"] = capture_buffer_bytes
    if capture_reduce_slots is not None:
        extra["reduce_slots"] = capture_reduce_slots
    return VllmLLM(model=model, **engine_kwargs(components=capture_components, **extra,
                                                 **llm_kwargs))


# ---- RPC helpers (one entry per worker; rank 0 carries replicated components) -------------------

_TAGGED = re.compile(r"\[vllm-capture (ValueError|RuntimeError)\] (.*?)(?:', please check the stack trace.*)?$",
                     re.S)


def _rpc(llm, method: str, *args) -> list[dict]:
    """Call a capture RPC on every worker of ``llm`` (a ``vllm.LLM`` or a ``Server``); worker
    errors come back as ValueError/RuntimeError."""
    try:
        replies = llm.collective_rpc(method, args=args)
    except Exception as exc:
        raise_rpc_error(method, exc)
    if inspect.iscoroutine(replies):
        replies.close()  # never awaited: nothing reached the workers
        raise TypeError(f"llm: {type(llm).__name__}.collective_rpc is a coroutine (vLLM's "
                        "AsyncLLM): use vllm_capture.aio's calls, awaited")
    return replies


def raise_rpc_error(method: str, exc: Exception) -> NoReturn:
    """Raise what a failed capture RPC raises: the worker's ValueError or RuntimeError as such
    (vLLM hands the client a bare Exception with the message), else ``exc``."""
    if f"no attribute '{method}'" in str(exc):
        raise RuntimeError(
            f"the engine's workers have no {method}: vllm-capture's worker extension is not "
            f"installed; pass worker_extension_cls={WORKER_EXTENSION!r} and "
            f"additional_config={{'{CONFIG_KEY}': {{...}}}} (vc.LLM and vc.engine_kwargs do; "
            f"for a server, --worker-extension-cls and --additional-config)") from exc
    m = _TAGGED.search(str(exc))
    if m is None:
        raise exc
    raise (ValueError if m.group(1) == "ValueError" else RuntimeError)(m.group(2)) from exc


def _rpc_value(value):
    """``value`` as vLLM's RPC encoder (and JSON, to a ``Server``) carries it: a torch dtype by
    its name, a SelectSpec as its wire dict, numpy ints, ranges and arrays as Python ints and
    lists (the workers check what they are given)."""
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, SelectSpec):
        return value.to_wire()
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple, set, frozenset, range)):
        return [_rpc_value(v) for v in value]
    return value


@dataclass(frozen=True)
class Call:
    """One capture call: the RPC every worker runs, and what its replies (one per worker) make.
    The functions below run it on a ``vllm.LLM`` or a ``Server``; ``vllm_capture.aio``'s await
    it on an ``AsyncLLM``."""

    method: str
    args: tuple
    result: Callable[[list], Any]

    def on(self, llm):
        return self.result(_rpc(llm, self.method, *self.args))


def start_call(stream: str, config: dict) -> Call:
    from vllm_capture.session.config import STREAM_OPTIONS, StreamConfig

    config = {key: _rpc_value(value) for key, value in config.items()}
    if set(config) <= STREAM_OPTIONS:
        # Named here what the RPC's encoder would refuse naming nothing (an int past 2**64,
        # a numpy dtype); the workers check it again, and refuse unknown keys by name.
        StreamConfig(**config)
    return Call("start_capture", (stream, config), lambda replies: _by_rank(replies)[0])


def stop_call(stream: str) -> Call:
    return Call("stop_capture", (stream,), lambda replies: None)


def clear_call(stream: str) -> Call:
    return Call("clear_captured", (stream,), lambda replies: None)


def status_call(stream: str, all_ranks: bool) -> Call:
    return Call("capture_status", (stream,),
                lambda replies: _by_rank(replies) if all_ranks else _by_rank(replies)[0])


def fetch_call(stream: str, clear: bool, layers, req_ids, as_text: bool = False) -> Call:
    """``as_text``: the replies cross JSON (a ``Server``), their bytes as base64 text."""
    return Call("fetch_captured",
                (stream, clear, _rpc_value(layers), _rpc_value(req_ids), shm.client_probe(),
                 as_text),
                lambda replies: join_shards(stream, shm.read_replies(replies)))


def start_capture(llm, stream: str = HIDDEN_STATES, **config) -> dict:
    """Enable ``stream`` on every worker with ``config`` (StreamConfig's arguments: ``layers``,
    ``dtype``, ``reduce``, ``select``, ``budget_rows``); returns rank 0's ``capture_status``."""
    return start_call(stream, config).on(llm)


def stop_capture(llm, stream: str = HIDDEN_STATES) -> None:
    """Disable ``stream`` on every worker, dropping what it holds: fetch its rows first."""
    stop_call(stream).on(llm)


def clear_captured(llm, stream: str = HIDDEN_STATES) -> None:
    """Drop ``stream``'s stored rows and errors on every worker without fetching them."""
    clear_call(stream).on(llm)


def capture_status(llm, stream: str = HIDDEN_STATES, all_ranks: bool = False):
    """Rank 0's status, or every rank's (a list ordered by ``tp_rank``) with ``all_ranks``."""
    return status_call(stream, all_ranks).on(llm)


def _by_rank(replies: list[dict]) -> list[dict]:
    """Status replies in rank order, their layouts and dtypes keyed by int layer id (JSON, from
    a ``Server``, carries the keys as strings)."""
    for reply in replies:
        for key in ("layouts", "dtypes"):
            if isinstance(reply.get(key), dict):
                reply[key] = {int(k): v for k, v in reply[key].items()}
    return sorted(replies, key=lambda r: r.get("tp_rank", 0))


def fetch_captured(llm, stream: str = HIDDEN_STATES, clear: bool = True,
                   layers: list[int] | None = None, req_ids: list[str] | None = None):
    """Fetch and decode: ``(tensors, meta, layouts)`` keyed by layer id (shards joined).

    Workers on this host hand the rows over through ``/dev/shm`` (``session/shm.py``); others
    send them in the RPC reply (as base64 text from a ``Server``). Rows that came through
    ``/dev/shm`` are not copied (unless attention-head shards are joined): the tensors (writable)
    view a private mapping of the reply file, whose memory stays in use until every tensor of
    this fetch, and every view of one, is freed (then the file is reused by a later fetch);
    ``.clone()`` what you keep of a large fetch.
    """
    return fetch_call(stream, clear, layers, req_ids, as_text=isinstance(llm, Server)).on(llm)


def join_shards(stream: str, replies: list[dict]):
    """One result from the per-rank replies of a tensor-parallel engine.

    Hidden states and router logits are replicated on every rank: rank 0's rows are the result.
    Attention heads are sharded by head: rank r holds heads ``[r*H/tp, (r+1)*H/tp)``, so the
    ranks' rows are joined along the feature dimension in rank order, after checking that every
    rank captured the same rows. An incomplete or inconsistent set of shards raises.
    """
    if not replies:
        raise RuntimeError("no worker replied to fetch_captured")
    tp_size = int(replies[0].get("tp_size", 1))
    by_rank: dict[int, dict] = {}
    for reply in replies:
        rank = int(reply.get("tp_rank", 0))
        if int(reply.get("tp_size", 1)) != tp_size:
            raise RuntimeError("capture shards disagree on tp_size")
        if rank in by_rank:
            raise RuntimeError(f"capture shards: rank {rank} replied twice (pipeline parallelism "
                               "is not supported)")
        by_rank[rank] = reply
    missing = sorted(set(range(tp_size)) - set(by_rank))
    if missing:
        raise RuntimeError(f"incomplete capture shards: ranks {missing} of tp_size={tp_size} "
                           "did not reply; refusing to return a partial result")
    decoded = [deserialize_captured(by_rank[r]["layers"]) for r in range(tp_size)]
    layouts_by_rank = [{int(k): dict(v["layout"]) for k, v in by_rank[r]["layers"].items()
                        if v.get("layout")} for r in range(tp_size)]
    tensors, meta = decoded[0]
    layouts = layouts_by_rank[0]
    if stream != ATTENTION_HEADS or tp_size == 1:
        return tensors, meta, layouts
    for r, (t, _) in enumerate(decoded):
        if set(t) != set(tensors):
            raise RuntimeError(f"incomplete capture shards: rank {r} holds rows of layers "
                               f"{sorted(t)}, rank 0 of layers {sorted(tensors)}")
    joined, joined_layouts = {}, {}
    for layer in tensors:
        parts = []
        for r, (t, m) in enumerate(decoded):
            other = m[layer]
            if t[layer].dtype != tensors[layer].dtype:
                raise RuntimeError(f"capture shards of layer {layer} are {tensors[layer].dtype} "
                                   f"on rank 0 and {t[layer].dtype} on rank {r}")
            if (other.req_ids != meta[layer].req_ids
                    or not torch.equal(other.positions, meta[layer].positions)
                    or not torch.equal(other.token_ids, meta[layer].token_ids)):
                raise RuntimeError(f"capture shards of layer {layer} hold different rows on "
                                   f"rank 0 and rank {r}")
            parts.append(t[layer])
        joined[layer] = torch.cat(parts, dim=1)
        shard = [layouts_by_rank[r].get(layer, {}) for r in range(tp_size)]
        if all(shard):
            joined_layouts[layer] = _joined_heads_layout(shard)
    return joined, meta, joined_layouts


def _joined_heads_layout(shard: list[dict]) -> dict:
    """The layout of attention heads joined from every rank's shard layout, in rank order."""
    return {
        "width": sum(s["width"] for s in shard),
        "num_heads": sum(s["num_heads"] for s in shard),
        "head_size": shard[0]["head_size"],
        "tp_size": len(shard),
        "heads_per_rank": [s["num_heads"] for s in shard],
    }


# ---- capture() ---------------------------------------------------------------------------------

def _spec(value, name: str) -> SelectSpec | None:
    if value is None or isinstance(value, SelectSpec):
        return value
    if isinstance(value, dict):
        try:
            return SelectSpec.from_wire(value)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}: {exc}") from None
    raise ValueError(f"{name}: expected a SelectSpec, its wire dict, or None; got {type(value).__name__}")


def needs_full_prompt(spec: SelectSpec | None) -> bool:
    """Whether a prefix-cache hit could skip rows that ``spec`` selects.

    A hit never covers the last prompt token, so selections of only the last prompt row, or of
    generated rows only, may keep reading the cache; anything else must recompute the prompt.
    """
    if spec is None:
        return True
    if not spec.covers_prompt:
        return False
    wire = spec.to_wire()
    if wire["prompt"] == "all" or wire["prompt_tokens"] or wire["prompt_window"]:
        return True
    return any(p != -1 for p in (wire["prompt_positions"] or ()))


def _as_index(value, name: str) -> int:
    """An int, from anything that is one (numpy's, a 0-d integer tensor); True and 1.0 are a
    caller's bug, never prompt 1 or position 1."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name}: expected an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {value!r}") from None


@dataclass
class CaptureResult:
    """Captured rows of one ``capture()`` call, grouped per prompt (prompt order)."""

    layers: dict[int, torch.Tensor]
    outputs: list
    layouts: dict[int, dict[str, int]]
    stream: str
    _meta: dict[int, CaptureMeta]
    # prompt i owns rows offsets[i]:offsets[i+1] of every layer.
    offsets: list[int] = field(default_factory=list)

    def meta(self, layer: int) -> CaptureMeta:
        self._check_layer(layer)
        return self._meta[layer]

    def _check_layer(self, layer: int) -> None:
        if layer not in self.layers:
            raise KeyError(f"layer {layer!r} was not captured; captured layers: "
                           f"{sorted(self.layers)}")

    def _check_index(self, i: int) -> int:
        i = _as_index(i, "prompt index")
        if not 0 <= i < len(self.offsets) - 1:
            raise IndexError(f"prompt index {i} out of range for {len(self.offsets) - 1} prompts")
        return i

    def sample(self, i: int) -> dict[int, torch.Tensor]:
        i = self._check_index(i)
        return {layer: t[self.offsets[i]: self.offsets[i + 1]] for layer, t in self.layers.items()}

    def sample_rows(self, i: int, layer: int) -> torch.Tensor:
        i = self._check_index(i)
        self._check_layer(layer)
        return self.layers[layer][self.offsets[i]: self.offsets[i + 1]]

    def sample_positions(self, i: int) -> torch.Tensor:
        i = self._check_index(i)
        first = next(iter(self._meta.values()))
        return first.positions[self.offsets[i]: self.offsets[i + 1]]

    def sample_token_ids(self, i: int) -> torch.Tensor:
        i = self._check_index(i)
        first = next(iter(self._meta.values()))
        return first.token_ids[self.offsets[i]: self.offsets[i + 1]]

    def token(self, i: int, layer: int, pos: int = -1) -> torch.Tensor:
        """Row of prompt ``i`` at absolute position ``pos`` (-1: the prompt's last captured row)."""
        rows = self.sample_rows(i, layer)
        pos = _as_index(pos, "pos")
        if pos == -1:
            if len(rows) == 0:
                raise KeyError(f"prompt {i} has no captured rows")
            return rows[-1]
        hits = (self.sample_positions(i) == pos).nonzero().flatten()
        if len(hits) == 0:
            raise KeyError(f"prompt {i} has no captured row at position {pos}")
        return rows[int(hits[0])]

    # ---- files: memory-mapped .npy + manifest.json, no pickle ----

    def save(self, path: str | Path) -> Path:
        """Write the result to the folder ``path``. Its manifest goes last (atomically), and an
        earlier save's is removed first: a save that fails part-way leaves no result to load,
        never the new rows under the old labels and offsets."""
        from vllm_capture.dataset import write_json_atomic

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "manifest.json").unlink(missing_ok=True)
        manifest = {"format": "vllm-capture-result", "version": 1, "stream": self.stream,
                    "offsets": self.offsets, "layouts": {str(k): v for k, v in self.layouts.items()},
                    "request_ids": [getattr(o, "request_id", None) for o in self.outputs],
                    "layers": {}}
        for layer, t in self.layers.items():
            raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            np.save(path / f"layer_{layer}.npy", raw.numpy())
            m = self._meta[layer]
            np.save(path / f"labels_{layer}.npy",
                    np.stack([m.positions.numpy(), m.token_ids.numpy()], axis=1).astype(np.int32))
            manifest["layers"][str(layer)] = {"dtype": str(t.dtype), "req_ids": m.req_ids}
        write_json_atomic(path / "manifest.json", manifest)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "CaptureResult":
        """Read a folder ``save`` wrote; ValueError if its files disagree on the row count."""
        path = Path(path)
        if not (path / "manifest.json").is_file():
            raise FileNotFoundError(f"{path}: no manifest.json (not a saved CaptureResult, or its "
                                    "save did not finish)")
        manifest = json.loads((path / "manifest.json").read_text())
        if manifest.get("format") != "vllm-capture-result":
            raise ValueError(f"{path}: not a saved CaptureResult (manifest format "
                             f"{manifest.get('format')!r})")
        layers, meta = {}, {}
        for key, info in manifest["layers"].items():
            layer = int(key)
            arr = torch.from_numpy(np.load(path / f"layer_{layer}.npy", mmap_mode="r").copy())
            if info["dtype"] == "torch.bfloat16":
                arr = arr.view(torch.bfloat16)
            labels = np.load(path / f"labels_{layer}.npy")
            counts = {"rows": arr.shape[0], "labels": labels.shape[0],
                      "req_ids": len(info["req_ids"])}
            if manifest["offsets"]:
                counts["offsets[-1]"] = manifest["offsets"][-1]
            if len(set(counts.values())) != 1:
                raise ValueError(f"{path}: layer {layer}: row counts disagree ({counts}); the "
                                 "folder mixes files of different saves")
            layers[layer] = arr
            meta[layer] = CaptureMeta(info["req_ids"], torch.from_numpy(labels[:, 0].copy()),
                                      torch.from_numpy(labels[:, 1].copy()))
        return cls(layers, [], {int(k): v for k, v in manifest["layouts"].items()},
                   manifest["stream"], meta, manifest["offsets"])


def group_rows(tensors: dict[int, torch.Tensor], meta: dict[int, CaptureMeta],
               request_ids: list[str], ends: list[int] | None = None,
               ) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta], list[int]]:
    """Reorder every layer's rows into prompt order (rows of a prompt by position).

    ``ends[i]``: prompt ``i``'s rows at that position or later are left out (see ``capture``).
    Raises on rows that belong to no prompt (stale labels), rows claimed twice, and layers whose
    row labels differ (every layer of a stream must carry the same rows).
    """
    grouped_t, grouped_m, offsets = {}, {}, [0]
    client_index = {client: i for i, client in enumerate(request_ids)}
    decided: dict[str, int] = {}  # the layers' labels are the same ones
    ends = None if ends is None else np.asarray(ends, dtype=np.int64)
    reference = None  # the first layer's labels in prompt order: (owner, position, token id)
    previous = None  # the last layer's labels as fetched, its order and its grouped labels
    for layer in sorted(tensors):
        m = meta[layer]
        if previous is not None and _same_labels(m, previous[0]):
            # A layer's labels are the other layers' (one site's travel for all): no sort and
            # no label to compare again. Its own copies: a caller may change one layer's.
            _, idx, req_ids, positions, token_ids = previous
            grouped = CaptureMeta(list(req_ids), positions.clone(), token_ids.clone())
        else:
            owner = _owners(m.req_ids, client_index, layer, decided)
            if (owner < 0).any():
                stale = sorted({m.req_ids[j] for j in np.flatnonzero(owner < 0)})[:5]
                raise RuntimeError(f"layer {layer}: rows of requests that are not part of this "
                                   f"capture: {stale}")
            at = m.positions.numpy()
            order = np.lexsort((np.arange(len(m)), at, owner))
            if ends is not None:
                order = order[at[order] < ends[owner[order]]]
            labels = (owner[order], at[order], m.token_ids.numpy()[order])
            if reference is None:
                reference = labels
                counts = np.bincount(labels[0], minlength=len(request_ids))
                offsets = [0] + np.cumsum(counts).tolist()
            elif not all(np.array_equal(a, b) for a, b in zip(labels, reference)):
                raise RuntimeError(f"layer {layer}: row labels differ from the other layers'")
            idx = torch.from_numpy(order)
            req_ids = [m.req_ids[j] for j in order.tolist()]
            positions, token_ids = m.positions[idx], m.token_ids[idx]
            previous = (m, idx, req_ids, positions, token_ids)
            grouped = CaptureMeta(req_ids, positions, token_ids)
        # Always a copy, in prompt order already or not: a view would keep the fetch's
        # /dev/shm file from the pool for as long as a caller holds the rows (an extract buffers
        # a shard's batches). index_select copies whole rows; indexing (t[idx]) copies element
        # by element, 4x slower on CPU for a [256, 2048] bfloat16 layer. Into huge pages: most
        # of a copy into fresh memory was its page faults (host_pages).
        t = tensors[layer]
        grouped_t[layer] = torch.index_select(
            t, 0, idx, out=empty_on_huge_pages((len(idx), *t.shape[1:]), t.dtype))
        grouped_m[layer] = grouped
    if reference is None:
        offsets = [0] * (len(request_ids) + 1)
    return grouped_t, grouped_m, offsets


def _same_labels(a: CaptureMeta, b: CaptureMeta) -> bool:
    return (a is b or a.req_ids == b.req_ids) and torch.equal(a.positions, b.positions) \
        and torch.equal(a.token_ids, b.token_ids)


def _owners(labels: list[str], client_index: dict[str, int], layer: int,
            decided: dict[str, int]) -> np.ndarray:
    """Index in ``client_index`` of the request each row label belongs to (-1: none).

    A label matches the client id it equals and the one it extends by the engine's ``-{8 hex}``
    suffix (``match_capture_request_id``), so each distinct label is decided once, by two
    lookups, and kept in ``decided`` for the other layers: rows are many, their distinct labels
    one per request (16 layers of 256 requests: 4,096 decisions, 12 ms, before ``decided``).
    """
    for label in dict.fromkeys(labels):
        if label in decided:
            continue
        hits = [client_index[c] for c in (label, label[:-9]) if c in client_index
                and match_capture_request_id(label, c)]
        if len(hits) > 1:
            raise RuntimeError(f"layer {layer}: rows match more than one request id")
        decided[label] = hits[0] if hits else -1
    return np.fromiter(map(decided.__getitem__, labels), dtype=np.int64, count=len(labels))


def _prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):  # list() would make each character or key a prompt
        raise ValueError(f"prompts: expected a list of prompts, got one {type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts: empty")
    return prompts


def _select_list(per_prompt_selects, count: int) -> list:
    """``per_prompt_selects`` as a list of one entry per prompt (read once: it may be an
    iterator)."""
    if isinstance(per_prompt_selects, (str, dict, SelectSpec)):
        raise ValueError(f"per_prompt_selects: expected one entry per prompt (a SelectSpec, its "
                         f"wire dict or None), got one {type(per_prompt_selects).__name__}")
    try:
        selects = list(per_prompt_selects)
    except TypeError:
        raise ValueError(f"per_prompt_selects: expected one entry per prompt, got "
                         f"{per_prompt_selects!r}") from None
    if len(selects) != count:
        raise ValueError(f"per_prompt_selects: {len(selects)} entries for {count} prompts")
    return selects


def _check_generates(llm) -> None:
    if isinstance(llm, Server):
        raise TypeError(f"llm: capture() generates through vllm.LLM, not {llm!r}; around a "
                        "server's own requests call start_capture and fetch_captured")


def capture(llm, prompts: Sequence, *, stream: str = HIDDEN_STATES, max_tokens: int | None = None,
            layers: list[int] | None = None, dtype: str | None = None,
            select: SelectSpec | dict | None = None,
            per_prompt_selects: Sequence[SelectSpec | dict | None] | None = None,
            budget_rows: int | None = None, sampling_params=None, use_tqdm: bool = False,
            **sampling_kwargs) -> CaptureResult:
    """Generate ``prompts`` and return the captured rows, grouped per prompt.

    ``max_tokens`` (1 by default) and ``sampling_kwargs`` build greedy ``SamplingParams``; pass
    ``sampling_params`` instead of them for any other. Raises if any row was dropped (budget or
    buffer capacity), if a request failed or its prompt rows were skipped by the prefix cache, and
    always stops the stream.
    """
    return _run(llm, _check(llm, prompts, stream, max_tokens, layers, dtype, select,
                            per_prompt_selects, budget_rows, sampling_params, use_tqdm,
                            sampling_kwargs))


_CAPTURE_SIGNATURE = inspect.signature(capture)


def _check_call(llm, prompts, **kwargs) -> _Checked:
    """``_check`` of a call with ``capture()``'s arguments, its defaults filled in."""
    bound = _CAPTURE_SIGNATURE.bind(llm, prompts, **kwargs)
    bound.apply_defaults()
    return _check(**bound.arguments)  # capture()'s parameters, by name


@dataclass
class _Checked:
    """A capture's arguments, checked: each prompt with its own SamplingParams, and the stream's
    configuration as ``start_capture`` takes it."""

    stream: str
    prompts: list
    params: list
    config: dict[str, Any]
    use_tqdm: bool

    def part(self, start: int, stop: int) -> "_Checked":
        return _Checked(self.stream, self.prompts[start:stop], self.params[start:stop],
                        self.config, self.use_tqdm)


def _check(llm, prompts, stream, max_tokens, layers, dtype, select, per_prompt_selects,
           budget_rows, sampling_params, use_tqdm, sampling_kwargs) -> _Checked:
    """Every check ``capture()`` makes before it starts the stream, the workers' checks of the
    stream's configuration included (the layers the model has are checked by its workers)."""
    from vllm import SamplingParams

    from vllm_capture.session.config import StreamConfig

    _check_generates(llm)
    if stream not in COMPONENTS:
        raise ValueError(f"stream: unknown {stream!r}; choose one of {list(COMPONENTS)}")
    prompts = _prompt_list(prompts)
    spec = _spec(select, "select")
    if per_prompt_selects is not None:
        per_prompt = [_spec(s, f"per_prompt_selects[{i}]")
                      for i, s in enumerate(_select_list(per_prompt_selects, len(prompts)))]
    else:
        per_prompt = [None] * len(prompts)
    caller_params = sampling_params is not None
    if max_tokens is not None:
        max_tokens = as_count("max_tokens", max_tokens)  # vLLM takes a float or bool as given
    if sampling_params is None:
        sampling_kwargs.setdefault("temperature", 0.0)
        sampling_params = SamplingParams(max_tokens=1 if max_tokens is None else max_tokens,
                                         **sampling_kwargs)
    elif not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params: expected one vllm.SamplingParams, got "
                         f"{type(sampling_params).__name__}")
    elif max_tokens is not None or sampling_kwargs:
        given = sorted(sampling_kwargs) + (["max_tokens"] if max_tokens is not None else [])
        raise ValueError(f"pass either sampling_params or sampling keywords, not both ({given})")
    if sampling_params.n != 1:
        raise ValueError("sampling_params.n: capture supports n=1 only")
    if (sampling_params.extra_args or {}).get(EXTRA_ARGS_KEY) is not None:
        raise ValueError(f"{'sampling_params.extra_args' if caller_params else 'extra_args'}"
                         f"[{EXTRA_ARGS_KEY!r}]: capture() sets each prompt's selection itself; "
                         f"pass select= or per_prompt_selects= instead")
    params = []
    reachable: set[SelectSpec] = set()  # a batch's prompts mostly share their selection
    token_limit = sampling_params.max_tokens
    # Prompts without a selection of their own share one copy of the parameters, as vLLM's
    # prompts share one SamplingParams given for all (it copies each request's): a copy a
    # prompt took 18 us, 4.6 ms for a batch of 256.
    shared = None
    for i, own in enumerate(per_prompt):
        effective = own if own is not None else spec
        if effective is not None and token_limit is not None and effective not in reachable:
            empty = effective.selects_nothing_at(token_limit)
            if empty is not None:
                where = "select" if own is None else f"per_prompt_selects[{i}]"
                raise ValueError(f"{where}: {empty}; the selection would capture nothing")
            reachable.add(effective)
        if own is None and shared is not None:
            params.append(shared)
            continue
        p = sampling_params.clone()
        if own is not None:
            p.extra_args = {**(p.extra_args or {}), EXTRA_ARGS_KEY: {stream: own.to_wire()}}
        if needs_full_prompt(effective):
            p.skip_reading_prefix_cache = True
        if own is None:
            shared = p
        params.append(p)
    config: dict[str, Any] = {"layers": _rpc_value(layers), "dtype": dtype,
                              "select": spec.to_wire() if spec is not None else None,
                              "budget_rows": _rpc_value(budget_rows)}
    StreamConfig(**config)
    if capture_status(llm, stream)["enabled"]:
        # Starting it afresh would drop what it holds, uncounted.
        raise RuntimeError(f"stream {stream!r} is already on (start_capture): capture() starts and "
                           f"stops it itself; fetch_captured and stop_capture it first")
    return _Checked(stream, prompts, params, config, use_tqdm)


def _run(llm, checked: _Checked) -> CaptureResult:
    return _run_streams(llm, [checked])[0]


def _run_streams(llm, checks: list[_Checked]) -> list[CaptureResult]:
    """One generate of the prompts (the same in every check) with each check's stream on: the
    streams' rows are of the same sequences."""
    first = checks[0]
    # Joined once for each set of the streams' parameter objects, which most prompts share.
    params, joined = [], {}
    for ps in zip(*(c.params for c in checks)):
        key = tuple(map(id, ps))  # the objects stay alive in ``checks``
        if key not in joined:
            joined[key] = _joined_params(ps)
        params.append(joined[key])
    engine = getattr(llm, "llm_engine", None)
    # vLLM's generate() returns every request that finishes while it runs, these too (an
    # interrupted generate() leaves its requests queued; so does enqueue()): their outputs would
    # take the places of this call's prompts. (This engine's count: has_unfinished_requests()
    # is a collective over data-parallel ranks.)
    unfinished = engine.get_num_unfinished_requests() if engine is not None else 0
    if unfinished:
        raise RuntimeError(f"llm holds {unfinished} unfinished request(s) (an interrupted "
                           "generate() or enqueue()): finish them (llm.wait_for_completion()) "
                           "before capturing")
    started, fetched = [], []
    try:
        for c in checks:
            started.append(c.stream)  # stopped below even where its start failed on some ranks
            start_capture(llm, c.stream, **c.config)
        outputs = llm.generate(first.prompts, params, use_tqdm=first.use_tqdm)
        if len(outputs) != len(first.prompts):
            raise RuntimeError(f"generate() returned {len(outputs)} outputs for "
                               f"{len(first.prompts)} prompts; the rows cannot be attributed")
        for c in checks:
            tensors, meta, layouts = fetch_captured(llm, c.stream, clear=False)
            status = capture_status(llm, c.stream)
            if status.get("tokens_dropped"):
                raise RuntimeError(
                    f"capture of {c.stream} dropped {status['tokens_dropped']} row(s) "
                    "(budget_rows or the device buffer's rows per step); the result would be "
                    "incomplete. Raise budget_rows or capture_buffer_bytes, capture fewer rows, "
                    "or use capture_batches().")
            fetched.append((tensors, meta, layouts, status))
    except BaseException as exc:
        # The error in flight (a Ctrl-C, dropped rows) is the one to report, not a stop's.
        try:
            _stop_streams(llm, started)
        except Exception as stop_error:  # noqa: BLE001
            logger.warning("vllm-capture: stopping the streams after %r failed too: %r", exc,
                           stop_error)
        raise
    _stop_streams(llm, started)
    request_ids = [o.request_id for o in outputs]
    # A request's rows are its prompt and every generated token but the last. A stop string is
    # found outside the engine core, which feeds the token that completed it (or a few more)
    # before it hears the request stopped; those rows are not part of the returned sequence.
    ends = [len(o.prompt_token_ids) + len(o.outputs[0].token_ids) - 1 for o in outputs]
    results = []
    for c, (tensors, meta, layouts, status) in zip(checks, fetched):
        grouped, grouped_meta, offsets = group_rows(tensors, meta, request_ids, ends)
        _add_empty_layers(llm, c.stream, c.config["layers"], c.config["dtype"], status, grouped,
                          grouped_meta, layouts)
        results.append(CaptureResult(grouped, outputs, layouts, c.stream, grouped_meta, offsets))
    return results


def _stop_streams(llm, streams: list[str]) -> None:
    """Stop every stream of ``streams``, each even where another's stop raised; then raise the
    first error. A stop that raised on a harvest error left its stream on (the error is reported
    once), so it is tried again."""
    errors = []
    for stream in streams:
        try:
            stop_capture(llm, stream)
        except Exception as exc:  # noqa: BLE001 - raised below, after every stream was tried
            errors.append((stream, exc))
    for stream, _ in errors:
        try:
            stop_capture(llm, stream)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
    if errors:
        raise errors[0][1]


def _joined_params(params: tuple) -> Any:
    """One request's SamplingParams for several streams: their selections and prefix-cache
    policy joined (each stream's own ``capture()`` checks made them)."""
    if len(params) == 1:
        return params[0]
    joined = params[0].clone()
    selects: dict = {}
    for p in params:
        selects.update((p.extra_args or {}).get(EXTRA_ARGS_KEY, {}))
    if selects:
        joined.extra_args = {**(joined.extra_args or {}), EXTRA_ARGS_KEY: selects}
    joined.skip_reading_prefix_cache = any(p.skip_reading_prefix_cache for p in params)
    return joined


def capture_streams(llm, prompts: Sequence, layers: Mapping[str, list[int] | None],
                    **kwargs) -> dict[str, CaptureResult]:
    """``capture()`` of several streams from one generate: ``layers`` maps each stream to its
    layers (None: all), and ``kwargs`` are ``capture()``'s others, the same for every stream.
    Their rows are of the same sequences, which separate ``capture()`` calls do not promise
    beyond the prompt (another run may decode other tokens)."""
    if not isinstance(layers, Mapping) or not layers:
        raise ValueError(f"layers: name at least one stream, as {{stream: its layers or None}}; "
                         f"got {layers!r}")
    if "stream" in kwargs:
        raise TypeError("stream: capture_streams takes its streams as the keys of layers")
    prompts = _prompt_list(prompts)  # read once, for every stream's check
    if kwargs.get("per_prompt_selects") is not None:
        kwargs["per_prompt_selects"] = _select_list(kwargs["per_prompt_selects"], len(prompts))
    checks = []
    for stream, stream_layers in layers.items():
        try:
            checks.append(_check_call(llm, prompts, stream=stream, layers=stream_layers, **kwargs))
        except ValueError as exc:
            message = str(exc)
            if not message.startswith(("stream:", "layers")):
                raise
            raise ValueError(f"layers[{stream!r}]: {message.removeprefix('stream: ')}") from exc
    return dict(zip(layers, _run_streams(llm, checks)))


def _add_empty_layers(llm, stream: str, layers: list[int] | None, dtype: str | None,
                      status: dict, grouped: dict, grouped_meta: dict, layouts: dict) -> None:
    """Give every captured layer that no selected row reached a ``[0, width]`` tensor and its
    layout, so that a result (and each of ``capture_batches``') holds every layer asked for.
    Every layer of a stream holds the same rows, so these are all its layers, or none."""
    from vllm_capture.session.config import resolve_storage_dtype

    known = status["layouts"]
    missing = [layer for layer in (sorted(known) if layers is None else dict.fromkeys(layers))
               if layer in known and layer not in grouped]
    if not missing:
        return
    # The stream's dtype, else each layer's as its worker stores it (older workers: the model's).
    dtypes = status.get("dtypes") or {}
    ranks = [status]
    if stream == ATTENTION_HEADS and int(status.get("tp_size", 1)) > 1:
        ranks = capture_status(llm, stream, all_ranks=True)
    for layer in missing:
        if len(ranks) > 1:
            layout = _joined_heads_layout([r["layouts"][layer] for r in ranks])
        else:
            layout = dict(known[layer])
        name = dtype or dtypes.get(layer)
        empty_dtype = llm.model_config.dtype if name is None else resolve_storage_dtype(name)
        grouped[layer] = torch.empty((0, layout["width"]), dtype=empty_dtype)
        grouped_meta[layer] = CaptureMeta([], torch.empty(0, dtype=torch.int32),
                                          torch.empty(0, dtype=torch.int32))
        layouts[layer] = layout


def capture_batches(llm, prompts: Sequence, *, batch_size: int = 32,
                    **kwargs) -> Iterator[CaptureResult]:
    """``capture()`` over consecutive batches: memory stays bounded by one batch's rows.

    ``kwargs`` are ``capture()``'s. Every argument is checked here, before the first batch runs
    (the layers the model has when the first batch starts the stream, before it generates)."""
    batch_size = as_count("batch_size", batch_size)
    return _batches(llm, _check_call(llm, prompts, **kwargs), batch_size)


def _batches(llm, checked: _Checked, batch_size: int) -> Iterator[CaptureResult]:
    for start in range(0, len(checked.prompts), batch_size):
        yield _run(llm, checked.part(start, start + batch_size))
