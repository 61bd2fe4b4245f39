"""Wire format of captured rows: one msgpack-safe dict per layer.

Layer values ride as the raw bytes of their stored dtype (bf16 as int16 bits,
since numpy has no bfloat16), so the wire volume equals the stored volume and
no float32 upcast happens on the worker. Row labels ride beside them as
little-endian int32 columns plus a request-id table. Only bytes, str, int,
list and dict appear, so the payload survives msgpack (vLLM's RPC codec)
without custom hooks. Through JSON (a server's ``/collective_rpc``), bytes ride
as base64 text: :func:`bytes_as_text` and :func:`bytes_from_text`.

The decoder treats the payload as untrusted input: it comes from another
process, possibly another version. Anything malformed raises ``ValueError``
with the layer it concerns, because a silently misaligned label is worse for
a user than a failed fetch.
"""

import base64
import binascii
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

_WIRE_DTYPES: dict[str, torch.dtype] = {
    "torch.float32": torch.float32,
    "torch.float16": torch.float16,
    "torch.bfloat16": torch.bfloat16,
}
_WIRE_NAMES = {dtype: name for name, dtype in _WIRE_DTYPES.items()}
# The storage dtypes the wire can carry; config and store refuse others early.
WIRE_TORCH_DTYPES = frozenset(_WIRE_NAMES)
# How each dtype's rows ride: explicit little-endian so the bytes mean the same on every host.
WIRE_RAW_DTYPES = {
    torch.float32: np.dtype("<f4"),
    torch.float16: np.dtype("<f2"),
    torch.bfloat16: np.dtype("<i2"),
}
_LABEL = np.dtype("<i4")
_LABEL_COLUMNS = ("req_idx", "positions", "token_ids")
_HEX = frozenset("0123456789abcdef")
_BYTES = (bytes, bytearray, memoryview)
# Decimal digits in a string layer key; longer keys are not layer ids.
_MAX_LAYER_KEY_DIGITS = 9
# Row labels are int32, so no honest dimension reaches 2**31; the bound also
# keeps absurd shapes of empty tensors away from numpy's size checks.
_MAX_DIM = 2**31


class CaptureMeta:
    """Row labels for one captured layer.

    Attributes:
        req_ids: engine-internal request id string per row (the client-visible
            id plus an 8-hex uniqueness suffix; match with
            :func:`match_capture_request_id`).
        positions: absolute sequence position per row (int32; -1 for
            synthesized rows such as 'mean' reductions).
        token_ids: input token id per row (int32; -1 for synthesized rows).
    """

    def __init__(
        self,
        req_ids: list[str],
        positions: torch.Tensor,
        token_ids: torch.Tensor,
    ):
        self.req_ids = req_ids
        self.positions = positions
        self.token_ids = token_ids

    def __len__(self) -> int:
        return len(self.req_ids)


def match_capture_request_id(label_req_id: str, request_id: str) -> bool:
    """Whether a captured row's label belongs to a client request.

    Rows are labelled with the engine-internal request id, which is the
    client-visible id plus an 8-hex-char uniqueness suffix
    (``{request_id}-{8 hex}``) — or identical to it when suffixing is
    disabled. Anything looser (a bare prefix match) would attribute the rows
    of request "12-..." to request "1".
    """
    if label_req_id == request_id:
        return True
    return (
        label_req_id.startswith(request_id + "-")
        and len(label_req_id) == len(request_id) + 9
        and all(c in _HEX for c in label_req_id[-8:])
    )


# The one key of the JSON object that stands for a bytes value (``bytes_as_text``).
TEXT_BYTES_KEY = "__vllm_capture_base64__"


def bytes_as_text(value: Any) -> Any:
    """``value`` (dicts, lists and scalars) with every bytes-like value as
    ``{TEXT_BYTES_KEY: base64 text}``: what JSON can carry. A fresh copy."""
    if isinstance(value, _BYTES):
        return {TEXT_BYTES_KEY: base64.b64encode(value).decode("ascii")}
    if isinstance(value, Mapping):
        return {k: bytes_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [bytes_as_text(v) for v in value]
    return value


def bytes_from_text(value: Any) -> Any:
    """The inverse of :func:`bytes_as_text`; malformed base64 raises ``ValueError``."""
    if isinstance(value, Mapping):
        if set(value) == {TEXT_BYTES_KEY}:
            text = value[TEXT_BYTES_KEY]
            if not isinstance(text, str):
                raise ValueError(f"{TEXT_BYTES_KEY}: expected base64 text, got {type(text).__name__}")
            try:
                return base64.b64decode(text, validate=True)
            except binascii.Error as exc:
                raise ValueError(f"{TEXT_BYTES_KEY}: not base64 ({exc})") from None
        return {k: bytes_from_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [bytes_from_text(v) for v in value]
    return value


def serialize_capture_layer(
    tensor: torch.Tensor,
    meta: torch.Tensor,
    req_table: Mapping[int, str] | list[str],
    layer_name: str,
) -> dict[str, Any]:
    """Pack one layer's rows and labels into the wire dict.

    ``meta`` is int32 ``[rows, 3]`` (req_idx, position, token_id) where
    req_idx indexes ``req_table``. The emitted table holds only the requests
    these rows use, renumbered by first appearance: the store's table grows
    with every request it has seen, and shipping it whole with every layer
    would make small per-request fetches pay for the whole run.
    """
    if tensor.dtype not in _WIRE_NAMES:
        raise ValueError(
            f"capture rows of dtype {tensor.dtype} have no wire encoding; "
            "store float32, float16 or bfloat16"
        )
    if tensor.ndim != 2:
        raise ValueError(
            f"capture rows must be [rows, width], got shape {tuple(tensor.shape)}"
        )
    rows, width = tensor.shape
    if meta.dtype != torch.int32 or tuple(meta.shape) != (rows, 3):
        raise ValueError(
            f"capture labels must be int32 [{rows}, 3], got {meta.dtype} "
            f"{tuple(meta.shape)}"
        )
    host = tensor.detach().cpu().contiguous()
    if host.dtype == torch.bfloat16:
        host = host.view(torch.int16)
    data = host.numpy().astype(WIRE_RAW_DTYPES[tensor.dtype], copy=False).tobytes()
    return encode_capture_layer(
        tensor.dtype, (rows, width), data,
        encode_capture_labels(meta.detach().cpu().numpy(), req_table), layer_name
    )


def encode_capture_labels(
    labels: np.ndarray, req_table: Mapping[int, str] | list[str]
) -> dict[str, Any]:
    """The wire form of int32 ``[rows, 3]`` labels (see :func:`serialize_capture_layer`): the
    ``"meta"`` of a layer's wire dict. Layers with the same labels may share one (every layer of
    a reduction does), as nothing writes to it."""
    table, req_idx = _compact_requests(labels[:, 0], req_table)
    return {
        "req_table": table,
        "req_idx": req_idx.tobytes(),
        "positions": np.ascontiguousarray(labels[:, 1], dtype=_LABEL).tobytes(),
        "token_ids": np.ascontiguousarray(labels[:, 2], dtype=_LABEL).tobytes(),
    }


def encode_capture_layer(
    dtype: torch.dtype,
    shape: tuple[int, int],
    data: Any,
    meta: dict[str, Any],
    layer_name: str,
) -> dict[str, Any]:
    """The wire dict of one layer whose rows are already encoded: ``data`` holds the
    ``shape`` rows of ``dtype`` in the raw layout of ``WIRE_RAW_DTYPES`` (bytes, or an object
    the caller turns into bytes before sending: ``StreamStore.serialize(raw_data=True)``),
    ``meta`` their labels (:func:`encode_capture_labels`)."""
    return {
        "encoding": "raw",
        "dtype": _WIRE_NAMES[dtype],
        "shape": [int(shape[0]), int(shape[1])],
        "data": data,
        "layer_name": str(layer_name),
        "meta": meta,
    }


def _compact_requests(
    req_idx: np.ndarray, req_table: Mapping[int, str] | list[str]
) -> tuple[list[str], np.ndarray]:
    if req_idx.size == 0:
        return [], np.empty(0, dtype=_LABEL)
    used, first, inverse = np.unique(req_idx, return_index=True, return_inverse=True)
    if used[0] < 0:
        raise ValueError(f"capture labels hold negative request index {int(used[0])}")
    order = np.argsort(first, kind="stable")
    try:
        table = [req_table[int(used[i])] for i in order]
    except (KeyError, IndexError):
        raise ValueError(
            "capture labels reference a request index missing from the request table"
        ) from None
    if not all(isinstance(req_id, str) for req_id in table):
        raise ValueError("capture request table entries must be str")
    rank = np.empty(order.size, dtype=_LABEL)
    rank[order] = np.arange(order.size, dtype=_LABEL)
    return table, rank[inverse.reshape(-1)]


def deserialize_captured(
    serialized_data: dict[int, dict[str, Any]],
) -> tuple[dict[int, torch.Tensor], dict[int, CaptureMeta]]:
    """Rebuild per-layer tensors AND their row labels.

    Returns ``(tensors, meta)`` keyed by int layer id (msgpack may have turned
    the keys into decimal strings); ``meta[layer]`` labels each row of
    ``tensors[layer]`` with (request id, absolute position, token id).
    Rows in a read-only buffer (bytes, as msgpack decodes them) are copied
    out; rows in a writable buffer are not: the tensor views that buffer
    (``shm.read_reply`` hands over a private, copy-on-write mapping of the
    reply's shared-memory file this way).
    Incomplete or older unlabeled payloads raise ``ValueError`` instead of
    silently losing sample alignment. Keys other than the wire keys (such as
    the session's ``layout``) are left to the caller.
    """
    if not isinstance(serialized_data, Mapping):
        raise ValueError(
            "capture payload must be a dict of layers, got "
            f"{type(serialized_data).__name__}"
        )
    tensors: dict[int, torch.Tensor] = {}
    meta: dict[int, CaptureMeta] = {}
    for key, info in serialized_data.items():
        layer_id = _layer_id(key)
        if layer_id in tensors:
            raise ValueError(f"capture layer {layer_id} appears twice in the payload")
        tensors[layer_id], meta[layer_id] = _decode_layer(layer_id, info)
    return tensors, meta


def _layer_id(key: Any) -> int:
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if (
        isinstance(key, str)
        and 0 < len(key) <= _MAX_LAYER_KEY_DIGITS
        and key.isascii()
        and key.isdigit()
    ):
        return int(key)
    raise ValueError(f"capture layer id {key!r} is not a nonnegative int")


def _decode_layer(layer_id: int, info: Any) -> tuple[torch.Tensor, CaptureMeta]:
    if not isinstance(info, Mapping):
        raise ValueError(
            f"capture layer {layer_id} entry must be a dict, got {type(info).__name__}"
        )
    encoding = info.get("encoding")
    if not isinstance(encoding, str) or encoding != "raw":
        raise ValueError(
            f"unknown capture wire encoding {encoding!r} for layer "
            f"{layer_id}; engine and client versions do not match"
        )
    wire_dtype = info.get("dtype")
    if not isinstance(wire_dtype, str) or wire_dtype not in _WIRE_DTYPES:
        raise ValueError(
            f"unknown capture wire dtype {wire_dtype!r} for layer {layer_id}"
        )
    dtype = _WIRE_DTYPES[wire_dtype]
    shape = info.get("shape")
    if not (
        isinstance(shape, (list, tuple))
        and len(shape) == 2
        and all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < _MAX_DIM
            for d in shape
        )
    ):
        raise ValueError(
            f"capture layer {layer_id} shape must be [rows, width] of "
            f"nonnegative ints below 2**31, got {shape!r}"
        )
    rows, width = shape
    data = info.get("data")
    if not isinstance(data, _BYTES):
        raise ValueError(
            f"capture layer {layer_id} data must be bytes, got {type(data).__name__}"
        )
    raw = WIRE_RAW_DTYPES[dtype]
    if len(data) != rows * width * raw.itemsize:
        raise ValueError(
            f"capture layer {layer_id} carries {len(data)} data bytes; shape "
            f"[{rows}, {width}] of {wire_dtype} needs {rows * width * raw.itemsize}"
        )
    if not isinstance(info.get("layer_name"), str):
        raise ValueError(f"capture layer {layer_id} is missing its layer_name")
    labels = _decode_labels(layer_id, info.get("meta"), rows)
    array = np.frombuffer(data, dtype=raw).reshape(rows, width)
    if not (array.flags.writeable and array.flags.aligned):
        array = array.copy()  # bytes (msgpack's): the tensor gets memory of its own
    tensor = torch.from_numpy(array)
    if dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor, labels


def _decode_labels(layer_id: int, m: Any, rows: int) -> CaptureMeta:
    if m is None:
        raise ValueError(f"capture layer {layer_id} is missing mandatory row labels")
    if not isinstance(m, Mapping):
        raise ValueError(
            f"capture layer {layer_id} row labels must be a dict, got {type(m).__name__}"
        )
    table = m.get("req_table")
    if not isinstance(table, (list, tuple)) or not all(
        isinstance(req_id, str) for req_id in table
    ):
        raise ValueError(
            f"capture layer {layer_id} req_table must be a list of request id strings"
        )
    columns = {}
    for name in _LABEL_COLUMNS:
        raw = m.get(name)
        if not isinstance(raw, _BYTES) or len(raw) != rows * _LABEL.itemsize:
            got = f"{len(raw)} bytes" if isinstance(raw, _BYTES) else type(raw).__name__
            raise ValueError(
                f"capture layer {layer_id} has inconsistent row labels "
                f"({name}: {got} for {rows} rows)"
            )
        columns[name] = np.frombuffer(raw, dtype=_LABEL)
    req_idx = columns["req_idx"]
    if rows and (req_idx.min() < 0 or req_idx.max() >= len(table)):
        raise ValueError(f"capture layer {layer_id} has invalid request indices")
    return CaptureMeta(
        req_ids=[table[i] for i in req_idx.tolist()],
        positions=torch.from_numpy(columns["positions"].copy()),
        token_ids=torch.from_numpy(columns["token_ids"].copy()),
    )
