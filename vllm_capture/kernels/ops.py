"""The custom op that every instrumented call site calls: ``torch.ops.vllm_capture.capture``.

Why a custom op: Dynamo traces the call into vLLM's compiled graph and Inductor keeps it (it mutates
``site``), so under CUDA graphs the kernels it launched at capture time are replayed on every step,
while its Python body runs only when the graph is captured (and on eager / compiled-no-graph steps).

``site`` is a tiny per-(component, layer) int32 tensor registered as a buffer on the instrumented
module. Passing it as a tensor (not a Python int) keeps the compiled pieces of every layer identical,
so vLLM reuses one piecewise artifact across layers; its ``data_ptr()`` tells the Python body which
site is running, without reading device memory.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

SiteHandler = Callable[[torch.Tensor, Optional[torch.Tensor], torch.Tensor], None]

_handler: SiteHandler | None = None
_LIB: torch.library.Library | None = None


def set_site_handler(handler: SiteHandler | None) -> None:
    """Route op calls to ``handler`` (the worker's CaptureGraphState); None makes the op a no-op."""
    global _handler
    _handler = handler


def _capture(x: torch.Tensor, residual: Optional[torch.Tensor], site: torch.Tensor) -> None:
    if _handler is not None:
        _handler(x, residual, site)


def _capture_fake(x: torch.Tensor, residual: Optional[torch.Tensor], site: torch.Tensor) -> None:
    return None


def register_op() -> None:
    """Register ``vllm_capture::capture`` once per process (before any model is traced)."""
    global _LIB
    if _LIB is not None or hasattr(torch.ops.vllm_capture, "capture"):
        return
    from vllm.utils.torch_utils import direct_register_custom_op

    _LIB = torch.library.Library("vllm_capture", "FRAGMENT")
    direct_register_custom_op(
        "capture",
        _capture,
        mutates_args=["site"],
        fake_impl=_capture_fake,
        target_lib=_LIB,
        tags=(torch.Tag.needs_fixed_stride_order,),
    )
