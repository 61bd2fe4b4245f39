"""StreamConfig validation and StreamStore budgets, drains, labels and locking."""

import logging
import threading
from collections import Counter

import pytest
import torch

import vllm_capture.session.config as config_module
from vllm_capture.selection import SelectSpec
from vllm_capture.session import (
    StreamConfig,
    StreamStore,
    deserialize_captured,
    resolve_storage_dtype,
)

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
    summary = config.to_dict()
    assert summary["layers"] == [1, 3] and summary["dtype"] == "bfloat16"
    again = StreamConfig(**summary)
    assert again.to_dict() == summary
    reduced = StreamConfig(reduce="mean", budget_rows=10)
    assert not reduced.selects_rows and reduced.to_dict()["select"] is None


def test_unbounded_config_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_warned_unbounded", False)
    with caplog.at_level(logging.WARNING, logger="vllm_capture"):
        StreamConfig()
        StreamConfig()
        StreamConfig(budget_rows=5)
    warnings = [r for r in caplog.records if "no budget_rows" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].name == "vllm_capture"


def test_bounded_configs_do_not_warn(monkeypatch, caplog):
    monkeypatch.setattr(config_module, "_warned_unbounded", False)
    with caplog.at_level(logging.WARNING, logger="vllm_capture"):
        StreamConfig(budget_rows=5)
        StreamConfig(select={"generation": "all"})
        StreamConfig(reduce="last")
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


def test_budget_drops_rows_of_the_tail_across_requests():
    store = StreamStore(StreamConfig(budget_rows=3))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_interleaved([(a, 0), (b, 0), (a, 1), (b, 1), (a, 2)]), "l0")
    labels, _ = _fetch(store)
    assert labels[0] == [("a", 0), ("a", 1), ("b", 0)]
    assert store.tokens_dropped == 2


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
    b_storage = {
        chunk.tensor.data_ptr() for layer in store.chunks.values() for chunk in layer.values()
        if chunk.request_index == b
    }
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
    store.finish_request("a")
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
    store.finish_request("a")
    store.finish_request("never-seen")
    with pytest.raises(RuntimeError, match="never assigned"):
        store.append(0, *_rows(a, [0]), "l0")
    assert store.request_index("b") == a


def test_clear_keeps_active_indices_and_releases_finished_ones():
    store = StreamStore(StreamConfig(budget_rows=1))
    a, b = store.request_index("a"), store.request_index("b")
    store.append(0, *_interleaved([(a, 0), (b, 0)]), "l0")
    store.finish_request("b")
    store.mark_elided("zz")
    store.clear()
    assert store.status() == {
        "layers_captured": 0, "tokens_stored": 0, "tokens_dropped": 0,
        "cache_elided_reqs": 0, "failed_reqs": 0, "requests": 1, "bytes_stored": 0,
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
                    store.finish_request(name)
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
    for layer in range(4):
        meta = torch.tensor([[idx, p, 7] for p in range(5)], dtype=torch.int32)
        store.append(layer, torch.zeros(5, 2), meta, f"layers.{layer}")
    assert store.tokens_stored == 3
    assert store.tokens_dropped == 2
    store.count_dropped(4)
    assert store.status()["tokens_dropped"] == 6
