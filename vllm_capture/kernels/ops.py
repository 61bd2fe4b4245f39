"""The custom op that every instrumented call site calls: ``torch.ops.vllm_capture.capture``
(and ``torch.ops.vllm_capture.join``, where hidden-state kernels are forked: capture_graph/forked.py).

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
_join_handler: SiteHandler | None = None
_LIB: torch.library.Library | None = None


def set_site_handler(handler: SiteHandler | None, join: SiteHandler | None = None) -> None:
    """Route op calls to ``handler`` (the worker's CaptureGraphState) and join calls to ``join``;
    None makes the op a no-op."""
    global _handler, _join_handler
    _handler, _join_handler = handler, join


def _capture(x: torch.Tensor, residual: Optional[torch.Tensor], site: torch.Tensor) -> None:
    if _handler is not None:
        _handler(x, residual, site)


def _capture_fake(x: torch.Tensor, residual: Optional[torch.Tensor], site: torch.Tensor) -> None:
    return None


def _join(site: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
          after: torch.Tensor) -> None:
    """``vllm_capture::join``: the next layer's end waits for a kernel forked at ``site``.
    ``x`` and ``residual`` are what that kernel reads (kept alive until here); ``after`` is the
    next layer's output (so the join comes after that layer's work)."""
    if _join_handler is not None:
        _join_handler(x, residual, site)


def _join_fake(site: torch.Tensor, x: torch.Tensor, residual: Optional[torch.Tensor],
               after: torch.Tensor) -> None:
    return None


def register_op() -> None:
    """Register ``vllm_capture::capture`` and ``::join`` once per process (before any model is
    traced)."""
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
    direct_register_custom_op(
        "join",
        _join,
        mutates_args=["site"],
        fake_impl=_join_fake,
        target_lib=_LIB,
    )
