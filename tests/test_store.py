"""StreamConfig validation and StreamStore budgets, drains, labels and locking."""

import itertools
import logging
import random
import threading
from collections import Counter

import pytest
import torch

import vllm_capture.session.config as config_module
import vllm_capture.session.store as store_module
from vllm_capture.selection import SelectSpec
from vllm_capture.session import (
    StreamConfig,
    StreamStore,
    deserialize_captured,
    resolve_storage_dtype,
)
from vllm_capture.session.store import FetchedRows

WIDTH = 4


@pytest.fixture(autouse=True)
def _quiet_unbounded_warning(monkeypatch):
    monkeypatch.setattr(config_module, "_warned_unbounded", True)


def _rows(index, positions, layer=0, dtype=torch.float32):
    """Rows whose values encode (layer, position), so contents can be checked."""
    positions = list(positions)
    values = torch.tensor(
        [[layer * 1000 + p + c / 10 for c in range(WIDTH)] for p in positions], dtype=torch.float32
    ).reshape(-1, WIDTH)
    meta = torch.tensor([[index, p, 500 + p] for p in positions], dtype=torch.int32).reshape(-1, 3)
    return values.to(dtype), meta


def _interleaved(pairs, layer=0):
    """Rows of several requests in one append, in the given (index, position) order."""
    parts = [_rows(index, [pos], layer) for index, pos in pairs]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _fetch(store, **kwargs):
    tensors, metas = deserialize_captured(store.serialize(**kwargs))
    return {
        layer: list(zip(metas[layer].req_ids, metas[layer].positions.tolist()))
        for layer in tensors
    }, tensors


# ----------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "name, expected",
    [
        ("float32", torch.float32), ("fp32", torch.float32), ("torch.float32", torch.float32),
        ("float16", torch.float16), ("fp16", torch.float16), ("half", torch.float16),
        ("torch.half", torch.float16), ("bfloat16", torch.bfloat16), ("BF16", torch.bfloat16),
        ("torch.bfloat16", torch.bfloat16), (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_resolve_storage_dtype(name, expected):
    assert resolve_storage_dtype(name) is expected


@pytest.mark.parametrize("name", ["int8", "float64", torch.float64, torch.int32, "", None, 16])
def test_resolve_storage_dtype_rejects(name):
    with pytest.raises(ValueError, match="dtype"):
        resolve_storage_dtype(name)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"reduce": "max"}, "reduce"),
        ({"reduce": None}, "reduce"),
        ({"reduce": "last", "select": {"prompt": "all"}}, "select"),
        ({"layers": [0, -1]}, "layers"),
        ({"layers": [0, True]}, "layers"),
        ({"layers": "0"}, "layers"),
        ({"layers": 3}, "layers"),
        ({"layers": [1.0]}, "layers"),
        ({"layers": []}, "layers"),
        ({"budget_rows": -1}, "budget_rows"),
        ({"budget_rows": True}, "budget_rows"),
        ({"budget_rows": 1.5}, "budget_rows"),
        ({"dtype": "int8"}, "dtype"),
        ({"select": {"prompt": "some"}}, "select"),
        ({"select": {"bogus": 1}}, "select"),
        ({"select": {}}, "select"),
        ({"select": ["prompt"]}, "select"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        StreamConfig(**kwargs)


def test_config_canonicalizes_select_and_round_trips():
    config = StreamConfig(
        layers=[3, 1], dtype="bf16", select={"prompt_window": (-2, None)}, budget_rows=0
    )
    assert config.layers == {1, 3}
    assert config.dtype is torch.bfloat16
    assert config.select == SelectSpec(prompt_window=(-2, None)).to_wire()
    assert config.selects_rows
    # A SelectSpec itself (an engine in the client's process passes the caller's object).
    assert StreamConfig(select=SelectSpec(prompt_window=(-2, None))).select == config.select
    summary = config.to_dict()
    assert summary["layers"] == [1, 3] and summary["dtype"] == "bfloat16"
    again = StreamConfig(**summary)
    assert again.to_dict() == summary
    reduced = StreamConfig(reduce="mean", budget_rows=10)
    assert not reduced.selects_rows and reduced.to_dict()["select"] is None


def test_unbounded_config_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_warned_unbounded", False)
    with caplog.at_level(logging.WARNING, logger="vllm_capture"):
        config_module.warn_if_unbounded(StreamConfig())
        config_module.warn_if_unbounded(StreamConfig())
        config_module.warn_if_unbounded(StreamConfig(budget_rows=5))
    warnings = [r for r in caplog.records if "no budget_rows" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].name == "vllm_capture"


def test_bounded_configs_do_not_warn(monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_warned_unbounded", False)
    with caplog.at_level(logging.WARNING, logger="vllm_capture"):
        config_module.warn_if_unbounded(StreamConfig(budget_rows=5))
        config_module.warn_if_unbounded(StreamConfig(select={"generation": "all"}))
        config_module.warn_if_unbounded(StreamConfig(reduce="last"))
    assert not caplog.records


# ----------------------------------------------------------------------- budgets


def test_budget_caps_each_layer_and_counts_drops(caplog):
    store = StreamStore(StreamConfig(budget_rows=5))
    a = store.request_index("a-00000000")
    with caplog.at_level(logging.WARNING, logger="vllm_capture"):
        store.append(0, *_rows(a, range(3)), "l0")
        store.append(0, *_rows(a, range(3, 7)), "l0")
        store.append(1, *_rows(a, range(4), layer=1), "l1")
        store.append(0, *_rows(a, range(7, 9)), "l0")
    assert store.tokens_dropped == 2 + 2
    assert store.tokens_stored == 5
    assert sum("budget" in r.getMessage() for r in caplog.records) == 1
    labels, tensors = _fetch(store)
    assert [p for _, p in labels[0]] == [0, 1, 2, 3, 4]
    assert [p for _, p in labels[1]] == [0, 1, 2, 3]
    assert torch.equal(tensors[0], _rows(a, range(5))[0])


def test_budget_drops_count_each_row_once_when_layers_budgets_part():
    # Fetches that clear some layers and not others leave the layers different room: a row the
    # budget cuts in any layer is missing from the sample, counted once however many layers cut it.
    store = StreamStore(StreamConfig(budget_rows=2))
    a = store.request_index("a")

    def append(positions):
        values, meta = _rows(a, positions)
        store.append_layers({layer: values for layer in (0, 1, 2)}, meta,
                            {layer: f"l{layer}" for layer in (0, 1, 2)})

    append([0, 1])
    store.serialize(layers=[0], clear_selected=True)
    append([2, 3])  # kept in layer 0, cut in layers 1 and 2
    store.serialize(layers=[1, 2], clear_selected=True)
    append([4, 5])  # kept in layers 1 and 2, cut in layer 0
    append([6])  # cut in every layer
    labels, _ = _fetch(store)
    assert {layer: [p for _, p in rows] for layer, rows in labels.items()} == {
        0: [2, 3], 1: [4, 5], 2: [4, 5]}
    assert store.tokens_dropped == 5  # positions 2-6


def test_budget_drops_rows_of_the_tail_across_requests():
    store = StreamStore(StreamConfig(budget_rows=3))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_interleaved([(a, 0), (b, 0), (a, 1), (b, 1), (a, 2)]), "l0")
    labels, _ = _fetch(store, clear_selected=True)
    assert labels[0] == [("a", 0), ("a", 1), ("b", 0)]
    # The fetch took every row, and the drop stays reported (docs/architecture.md, deliberate
    # differences) until the stream is cleared.
    assert store.tokens_stored == 0 and store.tokens_dropped == 2
    store.clear()
    assert store.tokens_dropped == 0


def test_rows_dropped_upstream_count_with_budget_drops():
    store = StreamStore(StreamConfig(budget_rows=1))
    a = store.request_index("a")
    store.count_dropped(3)
    store.count_dropped(0)
    store.append(0, *_rows(a, [0, 1]), "l0")
    assert store.status()["tokens_dropped"] == 4
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="nonnegative"):
            store.count_dropped(bad)
    store.clear()
    assert store.tokens_dropped == 0


def test_zero_budget_stores_nothing_and_draining_frees_room():
    store = StreamStore(StreamConfig(budget_rows=0))
    a = store.request_index("a")
    store.append(0, *_rows(a, range(4)), "l0")
    assert store.serialize() == {} and store.tokens_dropped == 4
    store = StreamStore(StreamConfig(budget_rows=2))
    a = store.request_index("a")
    store.append(0, *_rows(a, range(2)), "l0")
    store.serialize(req_ids=["a"], clear_selected=True)
    store.append(0, *_rows(a, range(2, 4)), "l0")
    labels, _ = _fetch(store)
    assert [p for _, p in labels[0]] == [2, 3] and store.tokens_dropped == 0


# ---------------------------------------------------------------- drains & order


def test_drain_one_request_leaves_the_others_untouched():
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b = store.request_index("a-0123abcd"), store.request_index("b-0123abcd")
    store.append(0, *_interleaved([(a, 0), (b, 0), (a, 1), (b, 1)]), "l0")
    store.append(1, *_interleaved([(b, 0), (a, 0)], layer=1), "l1")
    # Requests share an append's chunk; a drain that leaves a chunk at least
    # half live neither copies nor moves the other request's rows.
    b_storage = {
        chunk.tensor.data_ptr() for layer in store.chunks.values() for chunk in layer.values()
        if b in chunk.live_requests()
    }
    assert len(b_storage) == 2
    labels, tensors = _fetch(store, req_ids=["a"], clear_selected=True)
    assert labels == {0: [("a-0123abcd", 0), ("a-0123abcd", 1)], 1: [("a-0123abcd", 0)]}
    assert torch.equal(tensors[0], _rows(a, [0, 1])[0])
    assert {
        chunk.tensor.data_ptr() for layer in store.chunks.values() for chunk in layer.values()
    } == b_storage
    assert store.serialize(req_ids=["a"]) == {}
    labels, tensors = _fetch(store)
    assert labels == {0: [("b-0123abcd", 0), ("b-0123abcd", 1)], 1: [("b-0123abcd", 0)]}
    assert torch.equal(tensors[1], _rows(b, [0], layer=1)[0])


def test_a_clear_that_cannot_compact_leaves_chunks_sparse_and_every_layer_cleared(monkeypatch):
    """Compacting a chunk after a clear only frees memory: without memory for the copy (here the
    second layer's), the chunk stays sparse, and no layer is left half-cleared."""
    store = StreamStore(StreamConfig())
    a, b = store.request_index("a-0123abcd"), store.request_index("b-0123abcd")
    for layer in range(3):
        store.append(layer, *_interleaved([(a, 0), (a, 1), (a, 2), (b, 0)], layer), f"l{layer}")
    real, calls = store_module._take, []

    def take(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real(*args)

    monkeypatch.setattr(store_module, "_take", take)
    labels, _ = _fetch(store, req_ids=["a"], clear_selected=True)
    assert labels == {layer: [("a-0123abcd", q) for q in range(3)] for layer in range(3)}
    assert len(calls) == 3  # each layer's chunk was a quarter live: each tried to compact
    assert _fetch(store, req_ids=["a"]) == ({}, {})
    labels, tensors = _fetch(store)
    assert labels == {layer: [("b-0123abcd", 0)] for layer in range(3)}
    for layer in range(3):
        assert torch.equal(tensors[layer], _rows(b, [0], layer)[0])


def test_rows_are_ordered_by_request_registration_then_append():
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_rows(b, [0, 1]), "l0")
    store.append(0, *_interleaved([(b, 2), (a, 0)]), "l0")
    store.append(0, *_rows(a, [1]), "l0")
    labels, _ = _fetch(store)
    assert labels[0] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
    labels, _ = _fetch(store, req_ids=["b", "a"])
    assert labels[0] == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]


def test_client_ids_select_every_suffixed_engine_id_and_nothing_else():
    store = StreamStore(StreamConfig(budget_rows=100))
    ids = ["r-0123abcd", "r-89abcdef", "r1-0123abcd", "r", "r-0123ABCD"]
    for req_id in ids:
        store.append(0, *_rows(store.request_index(req_id), [0]), "l0")
    selected = lambda **kw: sorted(r for r, _ in _fetch(store, **kw)[0].get(0, []))
    assert selected(req_ids=["r"]) == ["r", "r-0123abcd", "r-89abcdef"]
    assert selected(req_ids=["r-0123abcd"]) == ["r-0123abcd"]
    assert selected(req_ids=["r-0123ABCD"]) == ["r-0123ABCD"]
    assert selected(req_ids=["r1"]) == ["r1-0123abcd"]
    assert selected(req_ids=["r-"]) == []
    assert selected(req_ids=[]) == []


def test_layer_subset_fetch_and_drop_layers():
    store = StreamStore(StreamConfig(budget_rows=100))
    a = store.request_index("a")
    for layer in (0, 1, 2):
        store.append(layer, *_rows(a, [0, 1], layer=layer), f"l{layer}")
    assert list(store.serialize(layers=[2, 0, 2, 9])) == [2, 0]
    store.drop_layers([0, 2, 9])
    assert sorted(store.chunks) == [1] and store.status()["layers_captured"] == 1
    assert list(store.serialize()) == [1]
    with pytest.raises(ValueError, match="layers"):
        store.serialize(layers="1")
    with pytest.raises(ValueError, match="req_ids"):
        store.serialize(req_ids="a")
    with pytest.raises(ValueError, match="req_ids"):
        store.serialize(req_ids=5)
    with pytest.raises(ValueError, match="layers"):
        store.drop_layers(3)


def test_dtype_conversion_on_append():
    store = StreamStore(StreamConfig(dtype="bf16", budget_rows=100))
    a = store.request_index("a")
    values, meta = _rows(a, range(3))
    store.append(0, values, meta, "l0")
    b = store.request_index("b")
    half = torch.randn(2, WIDTH, dtype=torch.float16)
    store.append(0, half, _rows(b, [0, 1])[1], "l0")
    wire = store.serialize()
    assert wire[0]["dtype"] == "torch.bfloat16"
    tensors, _ = deserialize_captured(wire)
    expected = values.to(torch.bfloat16)
    assert torch.equal(tensors[0][:3].view(torch.int16), expected.view(torch.int16))
    assert torch.equal(tensors[0][3:], half.to(torch.bfloat16))
    assert store.status()["bytes_stored"] == 5 * WIDTH * 2 + 5 * 3 * 4


def test_store_copies_so_callers_may_reuse_their_buffers():
    store = StreamStore(StreamConfig(budget_rows=100))
    a = store.request_index("a")
    values, meta = _rows(a, range(3))
    store.append(0, values, meta, "l0")
    values.fill_(-1.0)
    meta.fill_(7)
    _, tensors = _fetch(store)
    assert torch.equal(tensors[0], _rows(a, range(3))[0])


def _adopted(store, layer):
    """The tensors of a layer's chunks (what the store keeps)."""
    return [chunk.tensor for chunk in store.chunks[layer].values()]


def _fill_two_layers(store, adopt):
    a, b = store.request_index("a"), store.request_index("b")
    block = torch.stack([_interleaved([(a, 7), (b, 9)], layer)[0] for layer in (0, 1)])
    meta = _interleaved([(a, 7), (b, 9)])[1]
    store.append_layers({0: block[0], 1: block[1]}, meta, {0: "l0", 1: "l1"}, adopt=adopt)
    return block


def test_adopted_rows_are_kept_as_they_are_and_fetch_like_copies():
    """``adopt``: the finalized reductions' host copies become the chunks themselves when every
    row is kept in order and in its own dtype; the fetch is the same as with copies."""
    adopting, copying = StreamStore(StreamConfig(budget_rows=10)), StreamStore(StreamConfig(budget_rows=10))
    block = _fill_two_layers(adopting, True)
    _fill_two_layers(copying, False)
    assert [t.data_ptr() for layer in (0, 1) for t in _adopted(adopting, layer)] == [
        block[0].data_ptr(), block[1].data_ptr()]
    assert all(t.data_ptr() not in (block[0].data_ptr(), block[1].data_ptr())
               for layer in (0, 1) for t in _adopted(copying, layer))
    got, want = _fetch(adopting), _fetch(copying)
    assert got[0] == want[0] == {0: [("a", 7), ("b", 9)], 1: [("a", 7), ("b", 9)]}
    assert all(torch.equal(got[1][layer], want[1][layer]) for layer in (0, 1))


def test_a_store_holding_adopt_bytes_copies_what_it_is_handed(monkeypatch):
    store = StreamStore(StreamConfig(budget_rows=10))
    monkeypatch.setattr(store_module, "ADOPT_BYTES", 1)
    a = store.request_index("a")
    values, meta = _rows(a, range(3))
    store.append(0, values, meta, "l0")  # the store now holds more than ADOPT_BYTES
    block = _fill_two_layers(store, True)
    kept = {t.data_ptr() for layer in (0, 1) for t in _adopted(store, layer)}
    assert not kept & {block[0].data_ptr(), block[1].data_ptr()}
    assert _fetch(store)[0][1] == [("a", 7), ("b", 9)]


def test_an_empty_store_copies_an_append_larger_than_adopt_bytes(monkeypatch):
    """Adopted rows stay in pinned memory: a first append past ADOPT_BYTES (a whole prefill
    step's drain, GiBs) is copied to pageable memory like any past the bound."""
    store = StreamStore(StreamConfig(budget_rows=10))
    monkeypatch.setattr(store_module, "ADOPT_BYTES", 2 * 2 * WIDTH * 4 - 1)  # under the 2 layers
    block = _fill_two_layers(store, True)
    kept = {t.data_ptr() for layer in (0, 1) for t in _adopted(store, layer)}
    assert not kept & {block[0].data_ptr(), block[1].data_ptr()}
    assert _fetch(store)[0][1] == [("a", 7), ("b", 9)]


@pytest.mark.parametrize("fetch", ["layers", "drop_layers", "req_ids", "all"])
def test_chunks_left_on_a_drains_buffer_are_copied_out_once_they_hold_under_half(fetch,
                                                                                monkeypatch):
    """A drain hands every layer a view of one host buffer. Fetching most layers away must not
    leave the rest holding the whole buffer alive (uncounted: bytes_stored counts the views)."""
    store = StreamStore(StreamConfig())
    rows = [(store.request_index(r), 7) for r in "abc"]
    layers = range(4)
    block = torch.stack([_interleaved(rows, layer)[0] for layer in layers])
    meta = _interleaved(rows)[1]
    store.append_layers({k: block[k] for k in layers}, meta, {k: f"l{k}" for k in layers},
                        adopt=True)
    want = _fetch(store)[1]
    buffer = block.untyped_storage().data_ptr()

    def on_buffer():
        return [layer for layer in store.chunks for t in _adopted(store, layer)
                if t.untyped_storage().data_ptr() == buffer]

    def take(some):
        if fetch == "layers":
            _fetch(store, layers=some, clear_selected=True)
        else:
            store.drop_layers(some)

    if fetch == "all":  # the chunks go together: none is copied out first
        copies = []
        monkeypatch.setattr(store_module._Chunk, "set_rows",
                            lambda chunk, *args: copies.append(chunk))
        _fetch(store, clear_selected=True)
        assert copies == [] and store.chunks == {} and store.bytes_stored == 0
        return
    if fetch == "req_ids":  # most of every layer's rows: each chunk compacts into its own copy
        _fetch(store, req_ids=["a", "b"], clear_selected=True)
        assert on_buffer() == []
    else:
        take([0, 1])  # half the buffer left: it stays
        assert on_buffer() == [2, 3]
        take([2])  # a quarter: copied out
        assert on_buffer() == []
    got = _fetch(store)
    assert all(torch.equal(got[1][layer], want[layer][-got[1][layer].shape[0]:])
               for layer in got[1])
    assert store.bytes_stored == sum(t.nbytes + c.meta.nbytes for layer in store.chunks
                                     for c in store.chunks[layer].values() for t in [c.tensor])


@pytest.mark.parametrize("why", ["reordered", "cast", "budget", "failed request"])
def test_adopt_still_copies_rows_it_cannot_keep_as_they_are(why):
    store = StreamStore(StreamConfig(budget_rows=1 if why == "budget" else 10,
                                     dtype="bfloat16" if why == "cast" else None))
    a, b = store.request_index("a"), store.request_index("b")
    if why == "failed request":
        store.fail_request("a", "test")
    # Rows of b before a: the store groups them by registration, so it must reorder.
    pairs = [(b, 9), (a, 7)] if why == "reordered" else [(a, 7), (b, 9)]
    values, meta = _interleaved(pairs)
    store.append_layers({0: values}, meta, {0: "l0"}, adopt=True)
    kept = _adopted(store, 0)
    assert len(kept) == 1 and kept[0].data_ptr() != values.data_ptr()
    want = {"reordered": [("a", 7), ("b", 9)], "cast": [("a", 7), ("b", 9)],
            "budget": [("a", 7)], "failed request": [("b", 9)]}[why]
    got = _fetch(store, req_ids=["b"] if why == "failed request" else None)
    assert got[0][0] == want
    expect = _rows(0, [p for _, p in want])[0]  # values encode (layer, position) alone
    assert torch.equal(got[1][0], expect.to(got[1][0].dtype))


def test_layers_with_one_set_of_labels_share_their_encoded_labels_and_others_keep_theirs():
    store = StreamStore(StreamConfig(budget_rows=10))
    a, b = store.request_index("a"), store.request_index("b")
    values, meta = _interleaved([(a, 1), (b, 1)])
    store.append_layers({0: values, 1: values}, meta, {0: "l0", 1: "l1"})
    # Layers 2 and 3 span two appends: their labels are gathered into a fresh array each, equal
    # to each other. Layer 4 spans the same appends with one row fewer: labels of its own.
    for pairs, extra in (([(a, 2)], []), ([(b, 3)], [(a, 3)])):
        values, meta = _interleaved(pairs)
        store.append_layers({2: values, 3: values}, meta, {2: "l2", 3: "l3"})
        values, meta = _interleaved(extra or pairs)
        store.append(4, values, meta, "l4")
    wire = store.serialize()
    assert wire[0]["meta"] is wire[1]["meta"] and wire[2]["meta"] is not wire[0]["meta"]
    assert wire[3]["meta"] is wire[2]["meta"] and wire[4]["meta"] is not wire[2]["meta"]
    _, metas = deserialize_captured(wire)
    labels = [list(zip(metas[layer].req_ids, metas[layer].positions.tolist()))
              for layer in range(5)]
    assert labels == ([[("a", 1), ("b", 1)]] * 2 + [[("a", 2), ("b", 3)]] * 2
                      + [[("a", 2), ("a", 3)]])


ROW_BYTES = WIDTH * 4 + 3 * 4  # float32 values plus int32 labels


def _assert_consistent(store):
    """Internal bookkeeping agrees with the chunks (inspects private state)."""
    live_by_request: Counter = Counter()
    spans = set()
    for layer_id, layer in store.chunks.items():
        layer_rows = 0
        for chunk_id, chunk in layer.items():
            live = int(chunk.lens[chunk.live].sum())
            assert chunk.live_rows == live > 0 and 2 * live >= chunk.rows
            assert chunk.rows == chunk.tensor.shape[0] == chunk.meta.shape[0]
            layer_rows += live
            for slot in range(chunk.reqs.size):
                if chunk.live[slot]:
                    req, start, length = (int(chunk.reqs[slot]), int(chunk.starts[slot]),
                                          int(chunk.lens[slot]))
                    live_by_request[req] += length
                    spans.add((req, layer_id, chunk_id, (slot, start, length)))
                    assert (chunk.meta[start:start + length, 0] == req).all()
        assert store._layer_rows[layer_id] == layer_rows
    assert store.status()["bytes_stored"] == sum(
        chunk.nbytes for layer in store.chunks.values() for chunk in layer.values()
    )
    for index in store.req_table:
        assert store._live[index] == live_by_request[index]
    store._index_chunks()
    indexed = {
        (req, layer_id, chunk_id, entry)
        for req, by_layer in store._request_chunks.items()
        for layer_id, held in by_layer.items()
        for chunk_id, entry in held.items()
    }
    assert indexed == spans


def test_compaction_releases_drained_rows_of_chunks_a_long_request_shares():
    store = StreamStore(StreamConfig(budget_rows=1000))
    long = store.request_index("long-0123abcd")
    short = [store.request_index(f"s{i}-0123abcd") for i in range(7)]
    steps, layers = 6, 2
    for step in range(steps):
        pairs = [(index, step) for index in short] + [(long, step)]
        for layer in range(layers):
            store.append(layer, *_interleaved(pairs, layer=layer), f"l{layer}")
    assert sum(len(layer) for layer in store.chunks.values()) == steps * layers
    assert store.status()["bytes_stored"] == steps * layers * 8 * ROW_BYTES
    for i in range(7):
        labels, _ = _fetch(store, req_ids=[f"s{i}"], clear_selected=True)
        assert labels[1] == [(f"s{i}-0123abcd", step) for step in range(steps)]
        _assert_consistent(store)
        live_rows = store.tokens_stored * layers
        assert store.status()["bytes_stored"] <= 2 * live_rows * ROW_BYTES
    # Every chunk survives, compacted down to the long request's row.
    chunks = [chunk for layer in store.chunks.values() for chunk in layer.values()]
    assert len(chunks) == steps * layers and all(chunk.rows == 1 for chunk in chunks)
    assert store.status()["bytes_stored"] == steps * layers * ROW_BYTES
    labels, tensors = _fetch(store, req_ids=["long"], clear_selected=True)
    assert labels[0] == [("long-0123abcd", step) for step in range(steps)]
    assert torch.equal(tensors[1], _rows(long, range(steps), layer=1)[0])
    assert store.chunks == {} and store.status()["bytes_stored"] == 0


def test_drain_requests_one_by_one_from_shared_chunks():
    store = StreamStore(StreamConfig(budget_rows=1000))
    ids = ["a-0123abcd", "b-0123abcd", "c-0123abcd"]
    a, b, c = (store.request_index(req_id) for req_id in ids)
    # Batch order differs from registration order; a prefill chunk holds runs.
    prefill = [(c, p) for p in range(3)] + [(a, p) for p in range(4)] + [(b, p) for p in range(2)]
    decode = [[(b, 2 + s), (c, 3 + s), (a, 4 + s)] for s in range(3)]
    for layer in (0, 1):
        store.append(layer, *_interleaved(prefill, layer=layer), f"l{layer}")
        for pairs in decode:
            store.append(layer, *_interleaved(pairs, layer=layer), f"l{layer}")
    assert [len(layer) for layer in store.chunks.values()] == [4, 4]

    labels, tensors = _fetch(store, req_ids=["b"], clear_selected=True)
    assert labels == {layer: [(ids[1], p) for p in range(5)] for layer in (0, 1)}
    assert torch.equal(tensors[1], _rows(b, range(5), layer=1)[0])
    _assert_consistent(store)
    assert store.tokens_stored == 13

    labels, tensors = _fetch(store)
    assert labels[0] == [(ids[0], p) for p in range(7)] + [(ids[2], p) for p in range(6)]
    assert torch.equal(tensors[0], torch.cat([_rows(a, range(7))[0], _rows(c, range(6))[0]]))

    labels, tensors = _fetch(store, req_ids=["c"], layers=[1], clear_selected=True)
    assert labels == {1: [(ids[2], p) for p in range(6)]}
    assert torch.equal(tensors[1], _rows(c, range(6), layer=1)[0])
    _assert_consistent(store)
    labels, _ = _fetch(store, req_ids=["a", "c"], clear_selected=True)
    assert labels == {
        0: [(ids[0], p) for p in range(7)] + [(ids[2], p) for p in range(6)],
        1: [(ids[0], p) for p in range(7)],
    }
    assert store.chunks == {} and store.status()["bytes_stored"] == 0
    assert store.tokens_stored == 0 and store.status()["requests"] == 3


@pytest.mark.parametrize("drain", ["by_request", "whole_layers"])
def test_index_recycles_only_once_drains_over_many_chunks_empty_it(drain):
    store = StreamStore(StreamConfig(budget_rows=10_000))
    a, b = store.request_index("a"), store.request_index("b")
    steps, layers = 20, 3
    for step in range(steps):
        for layer in range(layers):
            store.append(layer, *_interleaved([(b, step), (a, step)], layer=layer), f"l{layer}")
    store.finish_requests(["a"])
    if drain == "by_request":
        select = {"req_ids": ["a"]}
    else:  # whole layers: a and b leave together
        select = {}
        store.finish_requests(["b"])
    for layer in (2, 0):
        labels, _ = _fetch(store, layers=[layer], clear_selected=True, **select)
        assert labels[layer][:steps] == [("a", step) for step in range(steps)]
        assert store.request_index(f"x{layer}") not in (a, b)  # a still has rows in layer 1
        _assert_consistent(store)
    store.serialize(layers=[1], clear_selected=True, **select)
    reused = store.request_index("c")
    assert reused == a
    _assert_consistent(store)
    store.append(0, *_rows(reused, [0]), "l0")
    assert _fetch(store, req_ids=["c"])[0] == {0: [("c", 0)]}
    if drain == "by_request":
        labels, tensors = _fetch(store, req_ids=["b"])
        assert labels == {layer: [("b", step) for step in range(steps)] for layer in range(layers)}
        assert torch.equal(tensors[2], _rows(b, range(steps), layer=2)[0])
    else:
        assert store.request_index("d") == b


def test_fetch_many_requests_from_many_shared_chunks_in_registration_order():
    store = StreamStore(StreamConfig(budget_rows=1000))
    names = [f"r{i}-0123abcd" for i in range(12)]
    indices = [store.request_index(name) for name in names]
    rng = random.Random(7)
    for step in range(4):
        order = rng.sample(range(12), 12)
        store.append(0, *_interleaved([(indices[i], step) for i in order]), "l0")
    picked = [names[i] for i in (11, 0, 3, 4, 5, 6, 7, 8, 9, 10)]
    labels, tensors = _fetch(store, req_ids=[name[:-9] for name in picked])
    want = [(name, step) for name in sorted(picked, key=names.index) for step in range(4)]
    assert labels[0] == want
    assert tensors[0][:, 0].tolist() == [float(step) for _, step in want]
    labels, _ = _fetch(store, req_ids=[name[:-9] for name in picked], clear_selected=True)
    assert labels[0] == want
    _assert_consistent(store)
    labels, tensors = _fetch(store)
    assert labels[0] == [(names[i], step) for i in (1, 2) for step in range(4)]


def _multi_step_chunks(requests=12, steps_per_chunk=5, chunks=4):
    """A decode-like layer: each chunk holds several steps of every request (spans of
    ``steps_per_chunk`` rows), the requests' rows of a step in shuffled order."""
    store = StreamStore(StreamConfig(budget_rows=10_000))
    indices = [store.request_index(f"r{i}") for i in range(requests)]
    rng = random.Random(3)
    for c in range(chunks):
        pairs = [(indices[i], c * steps_per_chunk + s) for s in range(steps_per_chunk)
                 for i in rng.sample(range(requests), requests)]
        store.append(0, *_interleaved(pairs), "l0")
    return store


@pytest.mark.parametrize("req_ids", [None, ["r11", "r0", "r3", "r4", "r5", "r6", "r7", "r8",
                                            "r9", "r10"]])
def test_scattered_and_span_by_span_gathers_fetch_the_same_rows(monkeypatch, req_ids):
    """The two ways a fetch gathers a layer (span by span, or each chunk at once) give the same
    rows and labels, in registration then append order."""
    results, real = [], StreamStore._scatter
    for threshold in (0, 1 << 30):  # never scatter; scatter whenever spans are many per chunk
        monkeypatch.setattr(store_module, "_SCATTER_SPAN_BYTES", threshold)
        seen = []
        monkeypatch.setattr(StreamStore, "_scatter",
                            staticmethod(lambda *a: seen.append(1) or real(*a)))
        labels, tensors = _fetch(_multi_step_chunks(), req_ids=req_ids)
        results.append((labels, tensors, bool(seen)))
    (labels, tensors, scattered_first), (labels2, tensors2, scattered) = results
    assert not scattered_first and scattered
    names = req_ids or [f"r{i}" for i in range(12)]
    order = sorted(names, key=lambda n: int(n[1:]))
    assert labels[0] == labels2[0] == [(n, p) for n in order for p in range(20)]
    assert torch.equal(tensors[0], tensors2[0])
    assert tensors[0][:, 0].tolist() == [float(p) for _ in order for p in range(20)]


@pytest.mark.parametrize("requests", [3, 12])  # spans copied one by one; chunks scattered
def test_layers_whose_chunks_match_share_one_gather_plan_and_others_plan_their_own(
        monkeypatch, requests):
    """A fetch plans a layer's gather once for the layers after it whose chunks match it chunk
    for chunk, and anew for a layer whose chunks differ (in labels, live rows, count, dtype or
    width): every layer gets the rows a model of the appends expects, as a fetch of it alone
    does."""
    store = StreamStore(StreamConfig(budget_rows=1000))
    names = [f"r{i}" for i in range(requests)]
    indices = [store.request_index(name) for name in names]
    # Appended together, one append_layers a drain: 0-2, 4, 7 and 11-12 as they are, 3 in
    # bfloat16, 5 twice as wide, 8 and 9 losing r0's and r2's rows below (as many), 10 in the
    # first two drains alone. Appended on its own: 6, the same rows per request at other
    # positions.
    together = [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]
    model: dict[int, list[tuple[int, int]]] = {layer: [] for layer in range(13)}
    rng = random.Random(5)
    for drain in range(3):
        pairs = [(index, 2 * drain + step) for step in range(2)
                 for index in rng.sample(indices, requests)]
        layers = [layer for layer in together if drain < 2 or layer != 10]
        rows = {layer: _interleaved(pairs, layer)[0] for layer in layers}
        rows[3] = rows[3].to(torch.bfloat16)
        rows[5] = torch.cat((rows[5], rows[5]), dim=1)
        store.append_layers(rows, _interleaved(pairs)[1], {layer: f"l{layer}" for layer in layers})
        shifted = [(index, position + 100) for index, position in pairs]
        store.append(6, *_interleaved(shifted, layer=6), "l6")
        for layer in layers:
            model[layer] += pairs
        model[6] += shifted
    for layer, name in ((8, "r0"), (9, "r2")):
        store.serialize(layers=[layer], req_ids=[name], clear_selected=True)
        model[layer] = [pair for pair in model[layer] if names[pair[0]] != name]
        # The dead rows stay in their chunks (none is under half live): only live flags tell
        # 8 from 7 (and from 9).
        assert [chunk.live_rows for chunk in store.chunks[layer].values()] == [2 * requests - 2] * 3

    def expected(layer, picked=None):
        rows = sorted((pair for pair in model[layer] if picked is None or names[pair[0]] in picked),
                      key=lambda pair: pair[0])  # registration order, then append order
        values = torch.cat([_rows(index, [position], layer)[0] for index, position in rows])
        if layer == 5:
            values = torch.cat((values, values), dim=1)
        return ([(names[index], position) for index, position in rows],
                values.to(torch.bfloat16 if layer == 3 else torch.float32))

    planned, scattered = [], []
    plan_gather, scatter = StreamStore._plan_gather, StreamStore._scatter
    monkeypatch.setattr(StreamStore, "_plan_gather", lambda self, layer_id, spans: (
        planned.append(layer_id) or plan_gather(self, layer_id, spans)))
    monkeypatch.setattr(StreamStore, "_scatter",
                        staticmethod(lambda *args: scattered.append(1) or scatter(*args)))

    def check_fetch(must_plan, picked=None, clear=False):
        req_ids = None if picked is None else list(picked)
        alone = {layer: _fetch(store, layers=[layer], req_ids=req_ids)[0][layer]
                 for layer in store.chunks}
        planned.clear()
        labels, tensors = _fetch(store, req_ids=req_ids, clear_selected=clear)
        assert planned == must_plan
        for layer in range(13):
            want_labels, want_values = expected(layer, picked)
            assert labels[layer] == alone[layer] == want_labels
            assert tensors[layer].dtype == want_values.dtype
            assert torch.equal(tensors[layer], want_values)

    differ = [0, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # each layer unlike the one before it
    check_fetch(differ)
    assert bool(scattered) == (requests > 8)
    # Every request but r1, in no particular order: the chunks keep r1's rows alone, compacted.
    picked = names[:1] + names[:1:-1]
    check_fetch(differ, picked, clear=True)
    for layer in model:
        model[layer] = [pair for pair in model[layer] if pair[0] == indices[1]]
    _assert_consistent(store)
    # Compacted apart, each layer's chunks hold equal arrays of their own: 8 and 9 match 7.
    check_fetch([0, 3, 4, 5, 6, 7, 10, 11])
    store.serialize(clear_selected=True)
    assert store.chunks == {} and store.status()["bytes_stored"] == 0


def test_large_blocks_copy_through_torch_with_the_same_results():
    """Blocks of 2 MiB and more take torch's copies instead of numpy's."""
    store = StreamStore(StreamConfig(budget_rows=10_000))
    a, b = store.request_index("a"), store.request_index("b")
    width, rows = 4096, 160  # 160 float32 rows of 16 KiB: 2.5 MiB
    values = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    in_order = torch.tensor([[a, p, 0] for p in range(rows)], dtype=torch.int32)
    store.append(0, values, in_order, "l0")  # one run of rows: a block copy
    shuffled = torch.tensor(
        [[b if p % 2 else a, p, 0] for p in range(rows)], dtype=torch.int32
    )
    store.append(1, values, shuffled, "l1")  # grouped by request: a row gather
    labels, tensors = _fetch(store)
    assert labels[0] == [("a", p) for p in range(rows)]
    assert torch.equal(tensors[0], values)
    evens = [("a", p) for p in range(0, rows, 2)]
    odds = [("b", p) for p in range(1, rows, 2)]
    assert labels[1] == evens + odds
    assert torch.equal(tensors[1], torch.cat([values[0::2], values[1::2]]))
    store.append(1, values, shuffled, "l1")  # a second chunk: fetches concatenate
    labels, tensors = _fetch(store, layers=[1], clear_selected=True)
    assert labels[1] == evens * 2 + odds * 2
    assert torch.equal(tensors[1], torch.cat([values[0::2]] * 2 + [values[1::2]] * 2))
    _assert_consistent(store)


def test_failed_request_rows_leave_shared_chunks():
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b, c = (store.request_index(r) for r in ("a", "b", "c"))
    for step in range(3):
        store.append(0, *_interleaved([(c, step), (a, step), (b, step)]), "l0")
    store.fail_request("a", "boom")
    store.mark_elided("b")
    _assert_consistent(store)
    assert store.status()["bytes_stored"] == 3 * ROW_BYTES  # compacted to c's rows
    store.append(0, *_interleaved([(a, 3), (c, 3), (b, 3)]), "l0")
    labels, tensors = _fetch(store, req_ids=["c"])
    assert labels == {0: [("c", step) for step in range(4)]}
    assert torch.equal(tensors[0], _rows(c, range(4))[0])


def test_append_refuses_rows_of_another_width_than_the_layer_holds():
    store = StreamStore(StreamConfig(budget_rows=100))
    a = store.request_index("a")
    store.append(0, *_rows(a, [0]), "l0")
    with pytest.raises(RuntimeError, match="wide"):
        store.append(0, torch.zeros(1, WIDTH + 1), _rows(a, [1])[1], "l0")
    store.append(1, torch.zeros(1, WIDTH + 1), _rows(a, [1])[1], "l1")
    assert store.tokens_stored == 1


def test_mixed_input_dtypes_without_a_storage_dtype_promote_on_fetch():
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_rows(a, [0, 1], dtype=torch.bfloat16), "l0")
    store.append(0, *_rows(b, [0], dtype=torch.float16), "l0")
    labels, tensors = _fetch(store)
    assert labels[0] == [("a", 0), ("a", 1), ("b", 0)]
    assert tensors[0].dtype == torch.float32
    expected = torch.cat([_rows(a, [0, 1], dtype=torch.bfloat16)[0].float(),
                          _rows(b, [0], dtype=torch.float16)[0].float()])
    assert torch.equal(tensors[0], expected)
    _fetch(store, req_ids=["a"], clear_selected=True)
    assert _fetch(store)[1][0].dtype == torch.float16


@pytest.mark.parametrize("seed", range(8))
def test_store_matches_a_reference_model_under_random_operations(seed):
    """Random appends, drains, finishes, failures and layer drops against a plain model."""
    rng = random.Random(seed)
    budget = rng.choice([None, 60, 400])
    store = StreamStore(StreamConfig(budget_rows=budget))
    layers = [0, 1, 2]
    model: dict[int, list[tuple[str, int, float]]] = {layer: [] for layer in layers}
    rank: dict[str, int] = {}
    index_of: dict[str, int] = {}
    active: list[str] = []
    finished: set[str] = set()
    failed: set[str] = set()
    next_pos: Counter = Counter()
    dropped = 0
    values = itertools.count()
    names = itertools.count()

    def expected(req_ids=None, wanted=layers):
        out = {}
        for layer in wanted:
            rows = [r for r in model[layer] if req_ids is None or r[0] in req_ids]
            if rows:
                out[layer] = sorted(rows, key=lambda r: rank[r[0]])
        return out

    def check(payload, want):
        tensors, metas = deserialize_captured(payload)
        assert sorted(tensors) == sorted(want)
        for layer, rows in want.items():
            assert list(zip(metas[layer].req_ids, metas[layer].positions.tolist())) == [
                (r[0], r[1]) for r in rows
            ]
            assert tensors[layer][:, 0].tolist() == [r[2] for r in rows]
            assert tensors[layer][:, 1].tolist() == [r[2] + 0.5 for r in rows]

    def remove(req_ids, wanted=layers):
        for layer in wanted:
            model[layer] = [r for r in model[layer] if r[0] not in req_ids]

    for _ in range(160):
        op = rng.random()
        servable = [r for r in rank if r not in failed]
        if op < 0.12 or not active:
            req_id = f"q{next(names)}-0123abcd"
            index_of[req_id] = store.request_index(req_id)
            rank[req_id] = len(index_of)
            active.append(req_id)
        elif op < 0.55:
            batch = []
            for req_id in rng.sample(active, min(len(active), rng.randint(1, 12))):
                for _ in range(rng.choice([1, 1, 1, 3])):
                    batch.append((req_id, next_pos[req_id]))
                    next_pos[req_id] += 1
            # The session appends a drain's layers together; each layer's values differ.
            appended = rng.sample(layers, rng.randint(1, 3))
            meta = torch.tensor(
                [[index_of[r], p, 0] for r, p in batch], dtype=torch.int32
            ).reshape(-1, 3)
            tensors, cut = {}, 0
            for layer in appended:
                vals = [float(next(values)) for _ in batch]
                tensors[layer] = torch.tensor([[v, v + 0.5] + [0.0] * (WIDTH - 2) for v in vals])
                keep = [(r, p, v) for (r, p), v in zip(batch, vals) if r not in failed]
                room = len(keep) if budget is None else max(0, budget - len(model[layer]))
                cut = max(cut, len(keep) - room)  # the batch's rows missing from some layer
                model[layer].extend(keep[:room])
            dropped += cut
            store.append_layers(tensors, meta, {layer: f"l{layer}" for layer in appended})
        elif op < 0.72 and servable:
            picked = rng.sample(servable, min(len(servable), rng.choice([1, 1, 2, 5])))
            wanted = rng.choice([layers, [rng.choice(layers)]])
            clear = rng.random() < 0.8
            check(
                store.serialize(
                    layers=wanted, req_ids=[r[:-9] for r in picked], clear_selected=clear
                ),
                expected(set(picked), wanted),
            )
            if clear:
                remove(set(picked), wanted)
        elif op < 0.78:
            clear = rng.random() < 0.5
            if failed:
                with pytest.raises(RuntimeError):
                    store.serialize(clear_selected=clear)
            else:
                check(store.serialize(clear_selected=clear), expected())
                if clear:
                    remove(set(rank))
        elif op < 0.88:
            req_id = active.pop(rng.randrange(len(active)))
            store.finish_requests([req_id])
            finished.add(req_id)
        elif op < 0.93 and servable:
            req_id = rng.choice(servable)
            if rng.random() < 0.5:
                store.fail_request(req_id, "lost")
            else:
                store.mark_elided(req_id)
            failed.add(req_id)
            remove({req_id})
        elif op < 0.97:
            gone = rng.sample(layers, rng.randint(1, 2))
            store.drop_layers(gone)
            for layer in gone:
                model[layer] = []
        else:
            store.clear()
            failed.clear()
            dropped = 0
            remove(set(rank))
            for req_id in finished:
                rank.pop(req_id, None)
            finished.clear()

        _assert_consistent(store)
        held = {r[0] for rows in model.values() for r in rows}
        live_rows = sum(len(rows) for rows in model.values())
        status = store.status()
        assert status["tokens_stored"] == max(len(rows) for rows in model.values())
        assert status["tokens_dropped"] == dropped
        assert status["bytes_stored"] <= 2 * live_rows * ROW_BYTES
        assert status["requests"] == len([r for r in rank if r not in finished or r in held])
    if not failed:
        check(store.serialize(clear_selected=True), expected())
        assert store.status()["bytes_stored"] == 0


# ------------------------------------------------------------ failed and elided


@pytest.mark.parametrize("kind", ["failed", "elided"])
def test_failed_and_elided_requests_block_fetches_that_include_them(kind):
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b = store.request_index("a-0123abcd"), store.request_index("b-0123abcd")
    store.append(0, *_interleaved([(a, 0), (b, 0)]), "l0")
    if kind == "failed":
        store.fail_request("a-0123abcd", "steer vector rejected")
        guidance = "failed request.*steer vector rejected.*req_ids excluding them, or clear"
    else:
        store.mark_elided("a-0123abcd")
        guidance = "skip_reading_prefix_cache=True.*req_ids excluding them, or\\s+clear"
    store.append(0, *_rows(a, [1]), "l0")  # late rows of a lost request are discarded
    for kwargs in ({}, {"req_ids": ["a"]}, {"req_ids": ["b", "a-0123abcd"]}):
        with pytest.raises(RuntimeError, match=guidance):
            store.serialize(**kwargs)
    labels, _ = _fetch(store, req_ids=["b"], clear_selected=True)
    assert labels == {0: [("b-0123abcd", 0)]}
    status = store.status()
    assert status["tokens_stored"] == 0 and status["tokens_dropped"] == 0
    assert status["failed_reqs" if kind == "failed" else "cache_elided_reqs"] == 1
    store.clear()
    assert store.serialize() == {}
    store.append(0, *_rows(a, [2]), "l0")
    assert _fetch(store)[0] == {0: [("a-0123abcd", 2)]}


# ----------------------------------------------------------- request registry


def test_finished_and_drained_index_is_recycled():
    store = StreamStore(StreamConfig(budget_rows=100))
    a, b = store.request_index("a"), store.request_index("b")
    assert (a, b) == (0, 1) and store.request_index("a") == a
    store.append(0, *_rows(a, [0, 1]), "l0")
    store.finish_requests(["a"])
    assert store.request_index("c") == 2  # a's rows remain: index 0 is held
    store.serialize(req_ids=["b"], clear_selected=True)
    assert store.request_index("d") == 3
    labels, _ = _fetch(store, req_ids=["a"], clear_selected=True)
    assert labels == {0: [("a", 0), ("a", 1)]}
    e = store.request_index("e")
    assert e == a
    store.append(0, *_rows(e, [5]), "l0")
    assert _fetch(store)[0] == {0: [("e", 5)]}
    assert store.status()["requests"] == 4  # b, c, d, e


def test_unfinished_request_keeps_its_index_after_draining():
    store = StreamStore(StreamConfig(budget_rows=100))
    a = store.request_index("a")
    store.append(0, *_rows(a, [0]), "l0")
    store.serialize(clear_selected=True)
    assert store.request_index("b") == 1
    store.append(0, *_rows(a, [1]), "l0")
    assert _fetch(store)[0] == {0: [("a", 1)]}


def test_finish_without_rows_recycles_at_once_and_released_index_is_refused():
    store = StreamStore(StreamConfig(budget_rows=100))
    a = store.request_index("a")
    store.finish_requests(["a"])
    store.finish_requests(["never-seen"])
    with pytest.raises(RuntimeError, match="never assigned"):
        store.append(0, *_rows(a, [0]), "l0")
    assert store.request_index("b") == a


def test_clear_keeps_active_indices_and_releases_finished_ones():
    store = StreamStore(StreamConfig(budget_rows=1))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_interleaved([(a, 0), (b, 0)]), "l0")
    store.finish_requests(["b"])
    store.mark_elided("zz")
    store.mark_lost("a harvest failed")
    store.clear()
    assert store.status() == {
        "layers_captured": 0, "tokens_stored": 0, "tokens_dropped": 0,
        "cache_elided_reqs": 0, "failed_reqs": 0, "rows_lost": None, "requests": 1,
        "bytes_stored": 0,
    }
    assert store.request_index("a") == a and store.request_index("c") == b
    store.append(0, *_rows(a, [1]), "l0")
    assert _fetch(store)[0] == {0: [("a", 1)]}


def _labels(rows, dtype=torch.int32, columns=3):
    return torch.zeros(rows, columns, dtype=dtype)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0, torch.zeros(2, WIDTH), _labels(2, torch.int64), "l"), r"int32 \[rows, 3\]"),
        ((0, torch.zeros(2, WIDTH), _labels(2, columns=2), "l"), r"int32 \[rows, 3\]"),
        ((0, torch.zeros(3, WIDTH), _labels(2), "l"), r"meta rows \(2\) != data rows \(3\)"),
        ((0, torch.zeros(2), _labels(2), "l"), "2-D"),
        ((0, torch.zeros(2, WIDTH, dtype=torch.float64), _labels(2), "l"), "dtype"),
        ((0, torch.zeros(2, WIDTH, dtype=torch.int32), _labels(2), "l"), "dtype"),
        ((-1, torch.zeros(2, WIDTH), _labels(2), "l"), "nonnegative"),
        ((0, torch.zeros(2, WIDTH), _labels(2), None), "layer_name"),
        ((0, torch.zeros(1, WIDTH), torch.tensor([[3, 0, 0]], dtype=torch.int32), "l"),
         "never assigned"),
        ((0, torch.zeros(1, WIDTH), torch.tensor([[-1, 0, 0]], dtype=torch.int32), "l"),
         "never assigned"),
    ],
)
def test_append_rejects_malformed_rows(args, match):
    store = StreamStore(StreamConfig(budget_rows=100))
    store.request_index("a")
    with pytest.raises(RuntimeError, match=match):
        store.append(*args)
    assert store.status()["tokens_stored"] == 0


def test_append_rejects_layers_outside_the_config():
    store = StreamStore(StreamConfig(layers=[1, 2], budget_rows=100))
    a = store.request_index("a")
    with pytest.raises(RuntimeError, match="not one of this stream's layers"):
        store.append(0, *_rows(a, [0]), "l0")
    store.append(2, *_rows(a, [0]), "l2")
    assert list(store.serialize()) == [2]


def test_empty_append_and_status_are_msgpack_safe():
    store = StreamStore(StreamConfig(budget_rows=100))
    store.request_index("a")
    store.append(0, torch.zeros(0, WIDTH), torch.zeros(0, 3, dtype=torch.int32), "l0")
    status = store.status()
    assert status.pop("rows_lost") is None  # a str where rows were lost
    assert all(type(k) is str and type(v) is int for k, v in status.items())
    assert status["layers_captured"] == 0 and store.serialize() == {}


# ------------------------------------------------------------------ concurrency


def test_concurrent_appends_and_drains_return_every_row_exactly_once():
    store = StreamStore(StreamConfig())
    layers, requests_per_thread, steps, appenders = 3, 4, 25, 4
    stop = threading.Event()
    seen: Counter = Counter()
    errors: list[BaseException] = []
    seen_lock = threading.Lock()

    def record(payload):
        tensors, metas = deserialize_captured(payload)
        with seen_lock:
            for layer, tensor in tensors.items():
                labels = metas[layer]
                assert len(labels) == tensor.shape[0]
                for req_id, pos, value in zip(
                    labels.req_ids, labels.positions.tolist(), tensor[:, 0].tolist()
                ):
                    assert value == layer * 1000 + pos  # values travel with their labels
                    seen[(req_id, layer, pos)] += 1

    def appender(worker):
        try:
            for round_ in range(2):  # second round reuses recycled indices
                names = [f"w{worker}r{round_}q{i}-0000000{i}" for i in range(requests_per_thread)]
                indices = [store.request_index(name) for name in names]
                for step in range(steps):
                    pairs = [(index, step) for index in indices]
                    for layer in range(layers):
                        store.append(layer, *_interleaved(pairs, layer=layer), f"l{layer}")
                for name in names:
                    store.finish_requests([name])
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    def drainer(worker):
        try:
            turn = 0
            while not stop.is_set():
                turn += 1
                if worker == 0:
                    record(store.serialize(clear_selected=True))
                else:
                    target = f"w{turn % appenders}r{turn % 2}q{turn % requests_per_thread}"
                    record(store.serialize(
                        req_ids=[target], layers=[turn % layers], clear_selected=True
                    ))
                store.status()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    producers = [threading.Thread(target=appender, args=(w,)) for w in range(appenders)]
    consumers = [threading.Thread(target=drainer, args=(w,)) for w in range(3)]
    for thread in producers + consumers:
        thread.start()
    for thread in producers:
        thread.join()
    stop.set()
    for thread in consumers:
        thread.join()
    record(store.serialize(clear_selected=True))
    assert not errors, errors
    expected = appenders * 2 * requests_per_thread * steps * layers
    assert sum(seen.values()) == expected and set(seen.values()) == {1}
    assert store.status()["requests"] == 0 and store.status()["bytes_stored"] == 0


def test_budget_drop_counts_each_row_once_across_layers():
    """A row the budget cuts is cut in every layer; tokens_dropped counts sequence rows."""
    store = StreamStore(StreamConfig(budget_rows=3))
    idx = store.request_index("r-0123abcd")
    meta = torch.tensor([[idx, p, 7] for p in range(5)], dtype=torch.int32)
    store.append_layers({layer: torch.zeros(5, 2) for layer in range(4)}, meta,
                        {layer: f"layers.{layer}" for layer in range(4)})
    assert store.tokens_stored == 3
    assert store.tokens_dropped == 2
    store.count_dropped(4)
    assert store.status()["tokens_dropped"] == 6


# --------------------------------------------------------- raw_data: rows copied by the caller


@pytest.mark.parametrize("fetch", [{}, {"req_ids": ["b"]}, {"layers": [1]}])
@pytest.mark.parametrize("large_copy", [None, 0], ids=["numpy-copies", "torch-copies"])
def test_raw_data_fetch_hands_out_rows_to_copy_once(monkeypatch, fetch, large_copy):
    """serialize(raw_data=True) sizes the rows without copying them; copying them into a
    buffer (the worker's shared-memory file), or into bytes, gives the bytes path's payload."""
    if large_copy is not None:
        monkeypatch.setattr(store_module, "_LARGE_COPY", large_copy)

    def make():
        store = StreamStore(StreamConfig())
        a, b = store.request_index("a"), store.request_index("b")
        store.append_layers({0: _rows(a, [0, 1, 2])[0], 1: _rows(a, [0, 1, 2], 1)[0]},
                            _rows(a, [0, 1, 2])[1], {0: "l0", 1: "l1"})
        for p in range(3, 15):  # decode steps of both requests, fp16 into fp32 layer 1
            values, meta = _interleaved([(b, p), (a, p)])
            store.append_layers({0: values, 1: values.to(torch.float16)}, meta,
                                {0: "l0", 1: "l1"})
        return store

    want = make().serialize(**fetch)
    got = make().serialize(raw_data=True, clear_selected=True, **fetch)
    assert sorted(got) == sorted(want)
    for layer, info in got.items():
        rows = info.pop("data")
        expected = want[layer].pop("data")
        assert info == want[layer]  # everything but the rows is already final
        assert isinstance(rows, FetchedRows) and rows.nbytes == len(expected)
        buffer = bytearray(rows.nbytes)
        rows.copy_into(buffer)
        assert bytes(buffer) == expected == rows.tobytes()
        assert rows.tensor().shape == rows.shape == tuple(info["shape"])
        with pytest.raises(ValueError, match=r"writable \d+-byte buffer, got a \d+-byte one"):
            rows.copy_into(bytearray(rows.nbytes + 4))
        with pytest.raises(ValueError, match="read-only"):
            rows.copy_into(bytes(rows.nbytes))


@pytest.mark.parametrize("large_copy", [None, 0], ids=["numpy-copies", "torch-copies"])
@pytest.mark.parametrize("drained", ["step-by-step", "scattered"])
def test_rows_copied_in_parts_give_the_whole_copy(monkeypatch, large_copy, drained):
    """Parts of ``copy_into`` (what threads of the shared-memory write share) that cover every
    row, cut anywhere, even inside a piece, fill the buffer exactly as one whole copy does."""
    if large_copy is not None:
        monkeypatch.setattr(store_module, "_LARGE_COPY", large_copy)
    # Decode steps of a few requests drained one by one (a row range per span), or of many
    # drained four at a time (a scatter per chunk), after a prefill of 3 rows each.
    count, per_drain = (3, 1) if drained == "step-by-step" else (12, 4)
    store = StreamStore(StreamConfig())
    requests = [store.request_index(f"r{i}") for i in range(count)]
    store.append_layers({0: torch.randn(3 * count, WIDTH)},
                        torch.tensor([[r, p, 1] for r in requests for p in range(3)],
                                     dtype=torch.int32), {0: "l0"})
    for first in range(3, 23, per_drain):
        meta = torch.tensor([[r, p, 1] for p in range(first, first + per_drain)
                             for r in reversed(requests)], dtype=torch.int32)
        store.append_layers({0: torch.randn(len(meta), WIDTH)}, meta, {0: "l0"})
    rows = store.serialize(raw_data=True)[0]["data"]
    scattered = any(not isinstance(to, slice) for _, _, to in rows._pieces)
    assert scattered == (drained == "scattered")
    whole = bytearray(rows.nbytes)
    rows.copy_into(whole)
    total = rows.shape[0]
    for cuts in ([], [1], [total // 2], [5, 6, 40, total - 1], list(range(7, total, 7))):
        bounds = [0, *cuts, total]
        parts = bytearray(b"\xab" * rows.nbytes)
        for start, stop in reversed(list(zip(bounds, bounds[1:]))):
            rows.copy_into(parts, part=(start, stop))
        assert parts == whole, cuts


def test_raw_data_rows_of_one_whole_chunk_are_not_copied_until_asked():
    store = StreamStore(StreamConfig())
    a = store.request_index("a")
    store.append(0, *_rows(a, [0, 1]), "l0")
    rows = store.serialize(raw_data=True)[0]["data"]
    (chunk,) = store.chunks[0].values()
    assert rows.tensor() is chunk.tensor  # what the bytes path has always encoded directly


# ------------------------------------------------------------- parallel appends


@pytest.mark.parametrize("storage", [None, "float16"])
def test_a_large_append_copies_its_layers_on_threads_to_the_same_rows(monkeypatch, storage):
    """Rows into fresh memory cost first-touch page faults, so large appends copy their layers on
    APPEND_THREADS threads; the stored rows must be those of the one-thread copy, layer by layer."""
    g = torch.Generator().manual_seed(7)
    layers, requests, steps, width = 6, 5, 40, 1024
    meta = torch.tensor([[r, s, 11 * r + s] for s in range(steps)
                         for r in reversed(range(requests))], dtype=torch.int32)
    values = {layer: torch.randn(len(meta), width, generator=g).to(torch.bfloat16)
              for layer in range(layers)}
    names = {layer: f"model.layers.{layer}" for layer in range(layers)}
    monkeypatch.setattr(store_module, "APPEND_THREADS", 3)  # whatever this machine's CPUs
    monkeypatch.setattr(store_module, "_append_pool", None)
    threads = []
    real_take = store_module._take
    monkeypatch.setattr(store_module, "_take", lambda *args: threads.append(
        threading.current_thread().name) or real_take(*args))
    fetched = []
    for parallel_bytes in (1, 1 << 40):  # every append on threads, then none
        monkeypatch.setattr(store_module, "_PARALLEL_APPEND", parallel_bytes)
        store = StreamStore(StreamConfig(dtype=storage))
        for r in range(requests):
            assert store.request_index(f"req{r}-0123abcd") == r
        store.append_layers(values, meta, names)
        fetched.append(_fetch(store))
    assert any(name.startswith("vllm-capture-store") for name in threads[:layers])
    assert all(name == threading.current_thread().name for name in threads[layers:])
    (labels_a, tensors_a), (labels_b, tensors_b) = fetched
    assert labels_a == labels_b and sorted(tensors_a) == list(range(layers))
    for layer in range(layers):
        assert tensors_a[layer].dtype == tensors_b[layer].dtype
        assert tensors_a[layer].view(torch.uint8).equal(tensors_b[layer].view(torch.uint8))


def test_clear_keeps_the_failures_of_requests_still_running():
    """Given as any iterable (a generator is read once)."""
    store = StreamStore(StreamConfig(budget_rows=10))
    for req_id in "abc":
        store.fail_request(req_id, f"{req_id} failed")
    store.clear(still_failed=(r for r in ["b", "a"]))
    assert store.status()["failed_reqs"] == 2
    with pytest.raises(RuntimeError, match="'a', 'a failed'"):
        store.serialize()
