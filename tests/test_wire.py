"""Wire format: bit-exact round trips, msgpack-safe values, hostile payloads."""

import copy
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_capture.session.wire import (
    CaptureMeta,
    deserialize_captured,
    match_capture_request_id,
    serialize_capture_layer,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _labels(req_idx, positions, token_ids):
    return torch.tensor(list(zip(req_idx, positions, token_ids)), dtype=torch.int32).reshape(-1, 3)


def _bits(tensor):
    """Compare floats by bit pattern so NaN payloads and -0.0 count too."""
    view = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    return tensor.view(view[tensor.dtype])


def _assert_msgpack_safe(value, path="payload"):
    """Only the types msgpack encodes natively, bools excluded (they are not labels)."""
    if isinstance(value, dict):
        for key, item in value.items():
            assert type(key) in (str, int), f"{path} key {key!r}"
            _assert_msgpack_safe(item, f"{path}[{key!r}]")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_msgpack_safe(item, f"{path}[{i}]")
    else:
        assert type(value) in (bytes, str, int), f"{path} is {type(value).__name__}"


def _sample_layer(dtype=torch.float32, rows=5, width=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensor = torch.randn(rows, width, generator=gen).to(dtype)
    req_idx = [(3 * i) % 4 for i in range(rows)]
    meta = _labels(req_idx, list(range(10, 10 + rows)), list(range(100, 100 + rows)))
    table = {0: "a-0123abcd", 1: "b-89abcdef", 2: "c", 3: "d-00000000", 7: "unused"}
    return tensor, meta, table


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_bit_exact_with_every_label(dtype):
    tensor, meta, table = _sample_layer(dtype)
    tensor[0, 0] = float("nan")
    tensor[1, 1] = -0.0
    tensor[2, 2] = float("-inf")
    wire = serialize_capture_layer(tensor, meta, table, "model.layers.3")
    assert wire["dtype"] == str(dtype)
    assert wire["shape"] == [5, 4]
    assert wire["layer_name"] == "model.layers.3"
    assert len(wire["data"]) == tensor.numel() * tensor.element_size()
    tensors, metas = deserialize_captured({3: wire})
    assert list(tensors) == [3]
    out = tensors[3]
    assert out.dtype == dtype and out.shape == tensor.shape
    assert torch.equal(_bits(out), _bits(tensor))
    labels = metas[3]
    assert isinstance(labels, CaptureMeta) and len(labels) == 5
    assert labels.req_ids == [table[int(i)] for i in meta[:, 0]]
    assert labels.positions.dtype == torch.int32 and labels.token_ids.dtype == torch.int32
    assert torch.equal(labels.positions, meta[:, 1])
    assert torch.equal(labels.token_ids, meta[:, 2])


def test_request_table_is_compacted_in_first_appearance_order():
    tensor = torch.zeros(4, 2)
    meta = _labels([9, 2, 9, 5], [0, 1, 2, 3], [0, 0, 0, 0])
    table = {i: f"r{i}" for i in range(12)}
    wire = serialize_capture_layer(tensor, meta, table, "l")
    assert wire["meta"]["req_table"] == ["r9", "r2", "r5"]
    assert np.frombuffer(wire["meta"]["req_idx"], "<i4").tolist() == [0, 1, 0, 2]
    _, metas = deserialize_captured({0: wire})
    assert metas[0].req_ids == ["r9", "r2", "r9", "r5"]


def test_list_request_table_and_synthesized_labels():
    tensor = torch.ones(2, 3, dtype=torch.float16)
    meta = _labels([1, 0], [-1, -1], [-1, -1])
    _, metas = deserialize_captured({0: serialize_capture_layer(tensor, meta, ["x", "y"], "l")})
    assert metas[0].req_ids == ["y", "x"]
    assert metas[0].positions.tolist() == [-1, -1]
    assert metas[0].token_ids.tolist() == [-1, -1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [0, 7])
def test_empty_layer_round_trips(dtype, width):
    wire = serialize_capture_layer(
        torch.empty(0, width, dtype=dtype), torch.empty(0, 3, dtype=torch.int32), {}, "l"
    )
    assert wire["meta"]["req_table"] == []
    tensors, metas = deserialize_captured({5: wire})
    assert tensors[5].shape == (0, width) and tensors[5].dtype == dtype
    assert len(metas[5]) == 0 and metas[5].positions.shape == (0,)


def test_string_layer_keys_become_ints():
    a = serialize_capture_layer(*_sample_layer(seed=1), "a")
    b = serialize_capture_layer(*_sample_layer(torch.bfloat16, seed=2), "b")
    tensors, metas = deserialize_captured({"12": a, 3: b})
    assert sorted(tensors) == [3, 12] and sorted(metas) == [3, 12]
    assert all(type(key) is int for key in tensors)


def test_same_layer_twice_is_rejected():
    wire = serialize_capture_layer(*_sample_layer(), "a")
    with pytest.raises(ValueError, match="twice"):
        deserialize_captured({"4": wire, 4: wire})


@pytest.mark.parametrize("dtype", DTYPES)
def test_wire_values_are_msgpack_safe(dtype):
    wire = serialize_capture_layer(*_sample_layer(dtype), "model.layers.0")
    _assert_msgpack_safe({0: wire})
    _assert_msgpack_safe({0: serialize_capture_layer(
        torch.empty(0, 3, dtype=dtype), torch.empty(0, 3, dtype=torch.int32), {}, "x"
    )})


def test_non_contiguous_input_serializes_its_logical_rows():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensor = base[:, ::2]
    meta = _labels([0] * 4, [0, 1, 2, 3], [0] * 4)
    tensors, _ = deserialize_captured({0: serialize_capture_layer(tensor, meta, ["r"], "l")})
    assert torch.equal(tensors[0], tensor)


@pytest.mark.parametrize(
    "tensor, meta, table, match",
    [
        (torch.zeros(2, 2, dtype=torch.float64), _labels([0, 0], [0, 1], [0, 0]), ["r"], "dtype"),
        (torch.zeros(2), _labels([0, 0], [0, 1], [0, 0]), ["r"], "rows, width"),
        (torch.zeros(2, 2), _labels([0], [0], [0]), ["r"], "int32"),
        (torch.zeros(2, 2), _labels([0, 1], [0, 1], [0, 0]), ["r"], "missing"),
        (torch.zeros(2, 2), _labels([0, -1], [0, 1], [0, 0]), ["r"], "negative"),
        (torch.zeros(1, 2), _labels([0], [0], [0]), [7], "str"),
    ],
)
def test_serialize_refuses_what_it_cannot_encode(tensor, meta, table, match):
    with pytest.raises(ValueError, match=match):
        serialize_capture_layer(tensor, meta, table, "l")


def test_spec_error_texts():
    wire = serialize_capture_layer(*_sample_layer(), "a")
    bad = dict(wire, encoding="npy")
    with pytest.raises(ValueError, match="unknown capture wire encoding 'npy' for layer 0; engine"):
        deserialize_captured({0: bad})
    with pytest.raises(ValueError, match="unknown capture wire dtype 'torch.int8' for layer 0"):
        deserialize_captured({0: dict(wire, dtype="torch.int8")})
    unlabeled = {k: v for k, v in wire.items() if k != "meta"}
    with pytest.raises(ValueError, match="capture layer 0 is missing mandatory row labels"):
        deserialize_captured({0: unlabeled})
    short = dict(wire, meta=dict(wire["meta"], positions=wire["meta"]["positions"][:-4]))
    with pytest.raises(ValueError, match="capture layer 0 has inconsistent row labels"):
        deserialize_captured({0: short})
    out_of_range = dict(
        wire, meta=dict(wire["meta"], req_idx=np.full(5, 99, "<i4").tobytes())
    )
    with pytest.raises(ValueError, match="capture layer 0 has invalid request indices"):
        deserialize_captured({0: out_of_range})


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_copies_read_only_rows_and_views_writable_ones(dtype):
    """msgpack's bytes are copied out (the tensor owns its memory); a writable buffer (the
    private mapping shm.read_reply hands over) is viewed, not copied, and stays writable."""
    tensor, meta, table = _sample_layer(dtype)
    wire = serialize_capture_layer(tensor, meta, table, "l")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about tensors over read-only arrays
        copied, _ = deserialize_captured({0: wire})
        buffer = bytearray(wire["data"])
        viewed, _ = deserialize_captured({0: dict(wire, data=memoryview(buffer))})
    for decoded in (copied, viewed):
        assert decoded[0].dtype == dtype
        assert torch.equal(decoded[0].view(torch.int8), tensor.view(torch.int8))
    copied[0].zero_()  # its own memory: the bytes are untouched
    assert bytes(buffer) == wire["data"]
    viewed[0].zero_()  # a view: the buffer changes
    assert not any(buffer)
    # A writable but misaligned buffer is copied (numpy and torch want aligned rows).
    padded = bytearray(1 + len(wire["data"]))
    padded[1:] = wire["data"]
    odd, _ = deserialize_captured({0: dict(wire, data=memoryview(padded)[1:])})
    assert torch.equal(odd[0].view(torch.int8), tensor.view(torch.int8))
    odd[0].zero_()
    assert bytes(padded[1:]) == wire["data"]


def test_extra_keys_such_as_layout_are_ignored():
    wire = serialize_capture_layer(*_sample_layer(), "a")
    wire["layout"] = {"width": 4, "num_heads": 2, "head_size": 2}
    tensors, _ = deserialize_captured({0: wire})
    assert tensors[0].shape == (5, 4)


# --------------------------------------------------------------------------- fuzz

_TOP_KEYS = ("encoding", "dtype", "shape", "data", "layer_name", "meta")
_META_KEYS = ("req_table", "req_idx", "positions", "token_ids")
_LABEL_BYTES = ("req_idx", "positions", "token_ids")

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.binary(max_size=40),
)
_garbage = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()), inner, max_size=4),
    ),
    max_leaves=12,
)


def _valid_payload(dtype_index, rows, width, seed):
    tensor, meta, table = _sample_layer(DTYPES[dtype_index], rows, width, seed)
    return {seed % 3: serialize_capture_layer(tensor, meta, table, f"layer{seed}")}


_payloads = st.builds(
    _valid_payload,
    st.integers(0, 2),
    st.integers(1, 6),
    st.integers(1, 5),
    st.integers(0, 1000),
)


def _resize(blob, delta):
    return blob[: len(blob) + delta] if delta < 0 else blob + b"\x00" * delta


@st.composite
def _broken_payloads(draw):
    """A valid payload with one change that makes it invalid by construction."""
    payload = copy.deepcopy(draw(_payloads))
    (layer_id,) = payload
    layer = payload[layer_id]
    rows, width = layer["shape"]
    kind = draw(
        st.sampled_from(
            [
                "drop_top", "drop_meta", "resize_data", "resize_label", "shape",
                "bad_shape", "req_idx", "encoding", "dtype", "data_type",
                "label_type", "name_type", "table", "table_entry", "layer_type",
                "meta_type", "layer_key", "payload_type",
            ]
        )
    )
    if kind == "drop_top":
        del layer[draw(st.sampled_from(_TOP_KEYS))]
    elif kind == "drop_meta":
        del layer["meta"][draw(st.sampled_from(_META_KEYS))]
    elif kind == "resize_data":
        delta = draw(st.integers(-len(layer["data"]), 16).filter(bool))
        layer["data"] = _resize(layer["data"], delta)
    elif kind == "resize_label":
        name = draw(st.sampled_from(_LABEL_BYTES))
        delta = draw(st.integers(-len(layer["meta"][name]), 16).filter(bool))
        layer["meta"][name] = _resize(layer["meta"][name], delta)
    elif kind == "shape":
        new = draw(st.lists(st.integers(0, 12), min_size=2, max_size=2).filter(
            lambda s: s != [rows, width]
        ))
        layer["shape"] = draw(st.sampled_from([new, tuple(new)]))
    elif kind == "bad_shape":
        layer["shape"] = draw(
            st.one_of(
                st.lists(st.integers(0, 12), max_size=5).filter(lambda s: len(s) != 2),
                st.tuples(st.integers(max_value=-1), st.integers(0, 12)),
                st.tuples(st.integers(0, 12), st.booleans()),
                st.tuples(st.floats(), st.integers(0, 12)),
                st.tuples(st.integers(min_value=2**31), st.just(0)),
                _scalars,
            )
        )
    elif kind == "req_idx":
        labels = np.frombuffer(layer["meta"]["req_idx"], "<i4").copy()
        bad = draw(
            st.one_of(
                st.integers(len(layer["meta"]["req_table"]), 2**31 - 1),
                st.integers(-(2**31), -1),
            )
        )
        labels[draw(st.integers(0, rows - 1))] = bad
        layer["meta"]["req_idx"] = labels.tobytes()
    elif kind == "encoding":
        layer["encoding"] = draw(_garbage.filter(lambda v: v != "raw"))
    elif kind == "dtype":
        layer["dtype"] = draw(
            _garbage.filter(
                lambda v: v not in ("torch.float32", "torch.float16", "torch.bfloat16")
            )
        )
    elif kind == "data_type":
        layer["data"] = draw(_garbage.filter(lambda v: not isinstance(v, bytes)))
    elif kind == "label_type":
        name = draw(st.sampled_from(_LABEL_BYTES))
        layer["meta"][name] = draw(_garbage.filter(lambda v: not isinstance(v, bytes)))
    elif kind == "name_type":
        layer["layer_name"] = draw(_garbage.filter(lambda v: not isinstance(v, str)))
    elif kind == "table":
        layer["meta"]["req_table"] = draw(
            _garbage.filter(lambda v: not isinstance(v, (list, tuple)))
        )
    elif kind == "table_entry":
        table = layer["meta"]["req_table"]
        table[draw(st.integers(0, len(table) - 1))] = draw(
            _garbage.filter(lambda v: not isinstance(v, str))
        )
    elif kind == "layer_type":
        payload[layer_id] = draw(_garbage.filter(lambda v: not isinstance(v, dict)))
    elif kind == "meta_type":
        layer["meta"] = draw(_garbage.filter(lambda v: not isinstance(v, dict)))
    elif kind == "layer_key":
        key = draw(
            st.one_of(
                st.integers(max_value=-1),
                st.booleans(),
                st.floats(),
                st.none(),
                st.binary(),
                st.text().filter(lambda s: not (s.isascii() and s.isdigit())),
                st.from_regex(r"\A-[0-9]+\Z"),
            )
        )
        payload = {key: layer}
    else:
        payload = draw(_garbage.filter(lambda v: not isinstance(v, dict)))
    return payload


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_broken_payloads())
def test_broken_payloads_raise_value_error(payload):
    with pytest.raises(ValueError):
        deserialize_captured(payload)


@st.composite
def _mangled_payloads(draw):
    """Garbage dropped into any field: the decoder may accept it only if valid."""
    payload = copy.deepcopy(draw(_payloads))
    (layer_id,) = payload
    layer = payload[layer_id]
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["top", "meta"]))
        meta = layer.get("meta")
        holder = meta if target == "meta" and isinstance(meta, dict) else layer
        key = draw(st.sampled_from(_TOP_KEYS if holder is layer else _META_KEYS))
        holder[key] = draw(_garbage)
    return payload


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_mangled_payloads(), _garbage))
def test_garbage_anywhere_raises_value_error_or_decodes_consistently(payload):
    try:
        tensors, metas = deserialize_captured(payload)
    except ValueError:
        return
    assert tensors.keys() == metas.keys()
    for layer_id, tensor in tensors.items():
        assert len(metas[layer_id]) == tensor.shape[0]


# ------------------------------------------------------------ request id matching


@pytest.mark.parametrize(
    "label, client_id",
    [
        ("req-1", "req-1"),
        ("req-1-0123abcd", "req-1"),
        ("12-deadbeef", "12"),
        ("-00000000", ""),
        ("a-b-ffffffff", "a-b"),
    ],
)
def test_matching_ids(label, client_id):
    assert match_capture_request_id(label, client_id)


@pytest.mark.parametrize(
    "label, client_id",
    [
        ("req-1-0123abc", "req-1"),  # 7 hex
        ("req-1-0123abcde", "req-1"),  # 9 hex
        ("req-1-0123ABCD", "req-1"),  # uppercase hex
        ("req-1-0123abcg", "req-1"),  # non-hex
        ("12-abcdef01", "1"),  # prefix of another id
        ("1-abcdef01", "12"),
        ("req-10123abcd", "req-"),  # no dash between id and suffix
        ("req0123abcd", "req"),  # missing dash
        ("req-1_0123abcd", "req-1"),  # wrong separator
        ("req-1", "req-1-0123abcd"),  # reversed
        ("req-2", "req-1"),
    ],
)
def test_near_misses_do_not_match(label, client_id):
    assert not match_capture_request_id(label, client_id)
