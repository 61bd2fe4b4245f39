"""vllm-capture: CUDA-graph-first activation capture for vLLM.

Public names follow the capture API contract (constants, CaptureMeta, SelectSpec,
deserialize_captured, match_capture_request_id, StreamConfig, StreamStore, CaptureSession), plus
the client helpers (LLM, engine_kwargs, capture, capture_streams, capture_batches, CaptureResult),
the spec's RPCs as client calls (start_capture, stop_capture, fetch_captured, clear_captured,
capture_status), Server (those calls on a running vLLM server) and load_dataset.
"""

from vllm_capture.selection import SelectSpec
from vllm_capture.session.components import ATTENTION_HEADS, COMPONENTS, HIDDEN_STATES, ROUTER_LOGITS
from vllm_capture.session.config import StreamConfig
from vllm_capture.session.session import CaptureSession
from vllm_capture.session.store import StreamStore
from vllm_capture.session.wire import CaptureMeta, deserialize_captured, match_capture_request_id


def __getattr__(name):
    # The client helpers import vLLM pieces lazily; keep `import vllm_capture` light.
    if name in {"LLM", "capture", "capture_streams", "capture_batches", "CaptureResult",
                "start_capture", "stop_capture", "fetch_captured", "clear_captured",
                "capture_status"}:
        from vllm_capture import api

        return getattr(api, name)
    if name == "Server":
        from vllm_capture.server import Server

        return Server
    if name == "engine_kwargs":
        from vllm_capture.engine.config import engine_kwargs

        return engine_kwargs
    if name == "load_dataset":
        from vllm_capture.dataset import load_dataset

        return load_dataset
    raise AttributeError(f"module 'vllm_capture' has no attribute {name!r}")


__all__ = [
    "ATTENTION_HEADS", "COMPONENTS", "HIDDEN_STATES", "ROUTER_LOGITS", "CaptureMeta", "SelectSpec",
    "deserialize_captured", "match_capture_request_id", "StreamConfig", "StreamStore",
    "CaptureSession", "LLM", "engine_kwargs", "capture", "capture_streams", "capture_batches",
    "CaptureResult",
    "start_capture", "stop_capture", "fetch_captured", "clear_captured", "capture_status",
    "Server", "load_dataset",
]
