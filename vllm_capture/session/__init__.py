"""Worker-side capture session pieces: stream names, config, store, wire format."""

from vllm_capture.session.components import (
    ATTENTION_HEADS,
    COMPONENTS,
    HIDDEN_STATES,
    ROUTER_LOGITS,
)
from vllm_capture.session.config import StreamConfig, resolve_storage_dtype
from vllm_capture.session.store import StreamStore
from vllm_capture.session.wire import (
    CaptureMeta,
    deserialize_captured,
    match_capture_request_id,
    serialize_capture_layer,
)

__all__ = [
    "ATTENTION_HEADS",
    "COMPONENTS",
    "HIDDEN_STATES",
    "ROUTER_LOGITS",
    "CaptureMeta",
    "StreamConfig",
    "StreamStore",
    "deserialize_captured",
    "match_capture_request_id",
    "resolve_storage_dtype",
    "serialize_capture_layer",
]
