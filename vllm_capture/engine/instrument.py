"""Find the capture points of a loaded vLLM model by structure and instrument them.

Instrumentation swaps the class of each target module instance for a subclass whose ``forward``
also calls ``torch.ops.vllm_capture.capture``. Swapping the class (instead of wrapping the module)
keeps parameter names, so weight loading and reloading still work, and Dynamo traces the subclass
like ordinary model code. It runs at model load, before the first forward compiles the model.

Capture points:
- hidden_states: the decoder layer's output; where the layer returns ``(hidden, residual)`` the row
  is ``hidden + residual`` (the residual stream the next layer reads). The layer also stores it
  for ``last`` streams with traced torch ops (``capture_graph/last_rows.py``).
- attention_heads: the input of ``self_attn.o_proj``: concatenated per-head outputs, head-major.
- router_logits: the output of the MoE gate (also when vLLM calls it inside its fused-MoE op).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from vllm_capture.capture_graph.last_rows import store_last_rows
from vllm_capture.capture_graph.state import CaptureGraphState
from vllm_capture.kernels.layout import STORAGE_DTYPES
from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES, ROUTER_LOGITS

SITE_BUFFER = "_vllm_capture_site"
LAST_ROWS_BUFFER = "_vllm_capture_last_rows"
LAST_DEST_BUFFER = "_vllm_capture_last_dest"
LAST_ROW_PLAN = "_vllm_capture_last_row_plan"
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


def _language_model(model: nn.Module) -> tuple[str, nn.Module]:
    """``(its name, module)``: the text decoder of a multimodal model (vLLM's
    ``get_language_model``; a vision or audio tower has ``layers.N`` with attention too), else
    the model."""
    get = getattr(model, "get_language_model", None)
    language_model = get() if callable(get) else None
    if isinstance(language_model, nn.Module) and language_model is not model:
        for name, module in model.named_modules():
            if module is language_model:
                return name + ".", module
    return "", model


def _decoder_layers(model: nn.Module) -> list[tuple[int, str, nn.Module]]:
    """Decoder layers of the target model: every child of a ``layers`` ModuleList of which at
    least one child has attention (a hybrid model's Mamba or linear-attention layers included)."""
    prefix, language_model = _language_model(model)
    stacks: dict[str, list[tuple[int, str, nn.Module]]] = {}
    with_attention: set[str] = set()
    for name, module in language_model.named_modules():
        m = _LAYER_INDEX.search(name)
        if m is None or type(module).__name__ == "PPMissingLayer":
            continue
        if "draft" in name or "mtp" in name:
            continue  # speculative drafters reuse decoder classes; only the target is captured
        stack = name[: m.start()]
        stacks.setdefault(stack, []).append((int(m.group(1)), prefix + name, module))
        if hasattr(module, "self_attn") or hasattr(module, "attn"):
            with_attention.add(stack)
    found = [layer for stack, layers in stacks.items() if stack in with_attention
             for layer in layers]
    return sorted(found, key=lambda t: t[0])


ROUTER_BLOCKS = ("mlp", "block_sparse_moe", "moe", "feed_forward")
ROUTER_NAMES = ("gate", "router")  # GPT-OSS and Llama 4 call theirs ``router``


def _router_gate(layer: nn.Module) -> tuple[str, nn.Module, int] | None:
    """``(name in the layer, module, experts)`` of the layer's MoE router: a linear layer (vLLM's,
    or torch's as in GLM-4-MoE) beside the block's ``experts``."""
    for block_name in ROUTER_BLOCKS:
        block = getattr(layer, block_name, None)
        if block is None or not hasattr(block, "experts"):
            continue
        for gate_name in ROUTER_NAMES:
            gate = getattr(block, gate_name, None)
            width = getattr(gate, "output_size_per_partition",
                            getattr(gate, "output_size", getattr(gate, "out_features", None)))
            if isinstance(gate, nn.Module) and width:
                return f"{block_name}.{gate_name}", gate, int(width)
    return None


def _heads_layout(attn: nn.Module, width: int) -> dict[str, int] | None:
    """This rank's heads of the ``o_proj`` input ``width``: its head size from the attention
    module (``v_head_dim`` where values have their own, as in MLA), the count from the width,
    since ``num_heads`` is the total in some attention classes and this rank's in others."""
    head_dim = getattr(attn, "v_head_dim", None) or getattr(attn, "head_dim", None)
    if not head_dim or width % int(head_dim):
        local = next((getattr(attn, a) for a in ("num_local_heads", "num_heads_per_partition",
                                                 "num_heads") if getattr(attn, a, None)), None)
        if not local or width % int(local):
            return None
        head_dim = width // int(local)
    return {"width": width, "num_heads": width // int(head_dim), "head_size": int(head_dim)}


# Where find_targets looks, for the message of a component a model has none of.
WHERE_SITES_ARE = {
    HIDDEN_STATES: "children of a `layers` list with attention",
    ATTENTION_HEADS: "self_attn.o_proj of a decoder layer",
    ROUTER_LOGITS: (f"a linear {' or '.join(ROUTER_NAMES)} beside `experts` in a decoder "
                    f"layer's {', '.join(ROUTER_BLOCKS)}"),
}


def find_targets(model: nn.Module, hidden_size: int, dtype: torch.dtype) -> list[Target]:
    targets: list[Target] = []
    for layer_id, name, layer in _decoder_layers(model):
        targets.append(Target(HIDDEN_STATES, layer_id, name, layer, hidden_size, dtype,
                              {"width": hidden_size}))
        attn = getattr(layer, "self_attn", None)
        o_proj = getattr(attn, "o_proj", None) if attn is not None else None
        if o_proj is not None and hasattr(o_proj, "input_size_per_partition"):
            layout = _heads_layout(attn, int(o_proj.input_size_per_partition))
            if layout is not None:
                targets.append(Target(ATTENTION_HEADS, layer_id, f"{name}.self_attn.o_proj",
                                      o_proj, layout["width"], dtype, layout))
        router = _router_gate(layer)
        if router is not None:
            gate_name, gate, width = router
            # An unquantized linear returns its weight's dtype, which may be wider than the
            # model's (GLM-4-MoE's nn.Linear, Ernie-4.5-MoE's float32 ReplicatedLinear); a
            # quantized one's weight is in another dtype, and it returns the model's.
            weight = getattr(gate, "weight", None)
            gate_dtype = getattr(gate, "out_dtype", None) or (
                weight.dtype if isinstance(weight, torch.Tensor)
                and weight.dtype in STORAGE_DTYPES else dtype)
            targets.append(Target(ROUTER_LOGITS, layer_id, f"{name}.{gate_name}", gate, width,
                                  gate_dtype, {"width": width}))
    seen: dict[tuple[str, int], str] = {}
    for t in targets:
        other = seen.setdefault((t.component, t.layer_id), t.name)
        if other != t.name:
            raise ValueError(f"vllm-capture: {t.component} layer {t.layer_id} found twice, at "
                             f"{other} and {t.name}: this model has two layer stacks "
                             "(an encoder and a decoder?), which capture cannot tell apart")
    return targets


_SUBCLASSES: dict[tuple[type, str], type] = {}


def _captured_subclass(cls: type, component: str) -> type:
    key = (cls, component)
    if key in _SUBCLASSES:
        return _SUBCLASSES[key]

    if component == HIDDEN_STATES:
        def forward(self, *args, **kwargs):
            out = super(sub, self).forward(*args, **kwargs)
            hidden = out[0] if isinstance(out, tuple) else out
            # vLLM's layers return (hidden, residual), some with more after them (HunYuan's
            # kv states): the residual stream is their sum.
            residual = out[1] if isinstance(out, tuple) and len(out) >= 2 else None
            if not isinstance(residual, torch.Tensor):
                residual = None
            if hidden.dim() != 2:
                raise ValueError(
                    f"vllm-capture: {cls.__name__} returns hidden states shaped "
                    f"{tuple(hidden.shape)}, not [tokens, hidden size]; this model's "
                    f"{HIDDEN_STATES} cannot be captured: leave the component out "
                    f"(capture_components)")
            torch.ops.vllm_capture.capture(hidden, residual, getattr(self, SITE_BUFFER))
            # Traced, the stores always run (fused into the next layer's kernels); eager, only
            # while a stream reads them.
            if torch.compiler.is_compiling() or getattr(self, LAST_ROW_PLAN).active:
                store_last_rows(getattr(self, LAST_ROWS_BUFFER), getattr(self, LAST_DEST_BUFFER),
                                hidden, residual)
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


def instrument(targets: list[Target], state: CaptureGraphState) -> None:
    """Give every target its site in ``state``, its tensors as buffers (inputs of the compiled
    pieces, which the layers then share), and swap in the capturing class."""
    for t in targets:
        counter = state.add_site(t.component, t.layer_id, t.name, t.width, t.dtype,
                                 last_rows=t.component == HIDDEN_STATES)
        t.module.register_buffer(SITE_BUFFER, counter, persistent=False)
        site = state.sites[counter.data_ptr()]
        if site.last_rows is not None:
            plan = state.last_row_plans[t.component]
            t.module.register_buffer(LAST_ROWS_BUFFER, site.last_rows, persistent=False)
            t.module.register_buffer(LAST_DEST_BUFFER, plan.dest, persistent=False)
            setattr(t.module, LAST_ROW_PLAN, plan)
        t.module.__class__ = _captured_subclass(type(t.module), t.component)
