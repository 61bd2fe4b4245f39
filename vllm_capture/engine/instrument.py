"""Find the capture points of a loaded vLLM model by structure and instrument them.

Instrumentation swaps the class of each target module instance for a subclass whose ``forward``
also calls ``torch.ops.vllm_capture.capture``. Swapping the class (instead of wrapping the module)
keeps parameter names, so weight loading and reloading still work, and Dynamo traces the subclass
like ordinary model code. It runs at model load, before the first forward compiles the model.

Capture points:
- hidden_states: the decoder layer's output; where the layer returns ``(hidden, residual)`` the row
  is ``hidden + residual`` (the residual stream the next layer reads).
- attention_heads: the input of ``self_attn.o_proj``: concatenated per-head outputs, head-major.
- router_logits: the output of the MoE gate (also when vLLM calls it inside its fused-MoE op).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES, ROUTER_LOGITS

SITE_BUFFER = "_vllm_capture_site"
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)$")


@dataclass
class Target:
    component: str
    layer_id: int
    name: str
    module: nn.Module
    width: int
    dtype: torch.dtype
    layout: dict[str, int]


def _decoder_layers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """Decoder layers of the target model: children of a ``layers`` ModuleList with attention."""
    found = []
    for name, module in model.named_modules():
        m = _LAYER_INDEX.search(name)
        if m is None or type(module).__name__ == "PPMissingLayer":
            continue
        if "draft" in name or "mtp" in name:
            continue  # speculative drafters reuse decoder classes; only the target is captured
        if hasattr(module, "self_attn") or hasattr(module, "attn"):
            found.append((int(m.group(1)), name, module))
    return sorted(found, key=lambda t: t[0])


def _router_gate(layer: nn.Module) -> nn.Module | None:
    for block_name in ("mlp", "block_sparse_moe", "moe", "feed_forward"):
        block = getattr(layer, block_name, None)
        gate = getattr(block, "gate", None) if block is not None else None
        if gate is not None and hasattr(gate, "output_size") and hasattr(block, "experts"):
            return gate
    return None


def find_targets(model: nn.Module, hidden_size: int, dtype: torch.dtype) -> list[Target]:
    targets: list[Target] = []
    for layer_id, name, layer in _decoder_layers(model):
        targets.append(Target(HIDDEN_STATES, layer_id, name, layer, hidden_size, dtype,
                              {"width": hidden_size}))
        attn = getattr(layer, "self_attn", None)
        o_proj = getattr(attn, "o_proj", None) if attn is not None else None
        num_heads = getattr(attn, "num_heads", None)
        head_dim = getattr(attn, "head_dim", None)
        if o_proj is not None and hasattr(o_proj, "input_size_per_partition") and num_heads:
            width = int(o_proj.input_size_per_partition)
            if head_dim is None or num_heads * head_dim != width:
                head_dim = width // num_heads
            targets.append(Target(ATTENTION_HEADS, layer_id, f"{name}.self_attn.o_proj", o_proj,
                                  width, dtype, {"width": width, "num_heads": int(num_heads),
                                                 "head_size": int(head_dim)}))
        gate = _router_gate(layer)
        if gate is not None:
            width = int(getattr(gate, "output_size_per_partition", gate.output_size))
            gate_dtype = getattr(gate, "out_dtype", None) or dtype
            targets.append(Target(ROUTER_LOGITS, layer_id, f"{name}.gate", gate, width, gate_dtype,
                                  {"width": width}))
    return targets


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _captured_subclass(cls: type, component: str) -> type:
    key = (cls, component)
    if key in _SUBCLASSES:
        return _SUBCLASSES[key]

    if component == HIDDEN_STATES:
        def forward(self, *args, **kwargs):
            out = super(sub, self).forward(*args, **kwargs)
            if isinstance(out, tuple) and len(out) == 2 and out[1] is not None:
                torch.ops.vllm_capture.capture(out[0], out[1], getattr(self, SITE_BUFFER))
            else:
                hidden = out[0] if isinstance(out, tuple) else out
                torch.ops.vllm_capture.capture(hidden, None, getattr(self, SITE_BUFFER))
            return out
    elif component == ATTENTION_HEADS:
        def forward(self, input_, *args, **kwargs):
            torch.ops.vllm_capture.capture(input_, None, getattr(self, SITE_BUFFER))
            return super(sub, self).forward(input_, *args, **kwargs)
    else:
        def forward(self, *args, **kwargs):
            out = super(sub, self).forward(*args, **kwargs)
            logits = out[0] if isinstance(out, tuple) else out
            torch.ops.vllm_capture.capture(logits, None, getattr(self, SITE_BUFFER))
            return out

    sub = type(f"Captured{cls.__name__}", (cls,), {"forward": forward, "__module__": __name__})
    _SUBCLASSES[key] = sub
    return sub


def instrument(targets: list[Target], add_site) -> None:
    """Give every target its site tensor (from ``add_site``) and swap in the capturing class."""
    for t in targets:
        counter = add_site(t.component, t.layer_id, t.name, t.width, t.dtype)
        t.module.register_buffer(SITE_BUFFER, counter, persistent=False)
        t.module.__class__ = _captured_subclass(type(t.module), t.component)
