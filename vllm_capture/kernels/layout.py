"""Device buffer layout shared by the host (capture_graph/) and the capture kernel.

Every buffer below is allocated once, before CUDA-graph capture, and never reallocated: a captured
graph bakes in raw device addresses, so the host can only change what the kernel does by writing new
*values* into these buffers (non-blocking H2D copies, stream-ordered before the forward). All index
buffers are int32 and contiguous (``plan`` is a transposed view of contiguous storage).

Per stream (one stream = one selection feeding one or more sites):

``plan_meta`` int32 ``[META_FIELDS]``
    ``[META_MODE]``  one of ``MODE_OFF`` / ``MODE_ROWS`` / ``MODE_LAST`` / ``MODE_MEAN``;
    ``[META_COUNT]`` number of planned rows (``MODE_ROWS``) or segments (``MODE_LAST``/``MODE_MEAN``);
    ``[META_OFFSET]`` first ring row this step's rows go to (``MODE_ROWS`` only): steps pack
                     their rows one after another, so the host drains many steps in one copy;
    ``[META_STEP]``  steps since the plan was written (``MODE_ROWS`` only, 0 with a fresh plan):
                     the step's rows go to ring rows ``OFFSET + STEP * COUNT + r`` with positions
                     ``plan[PLAN_POS, r] + STEP``. A decode step that repeats the last one (the
                     same rows, every position one further) sets this one value instead of
                     copying a plan.

``plan`` int32 ``[PLAN_FIELDS, cap]``, stored entry-major (strides ``(1, PLAN_FIELDS)``: the
    fields of one entry are adjacent), so a step's plan is one contiguous prefix of
    ``PLAN_FIELDS * count`` int32 and the host uploads only that.
    ``MODE_ROWS``: ``plan[PLAN_ROW, r]`` activation row, ``plan[PLAN_REQ, r]`` req_idx label,
    ``plan[PLAN_POS, r]`` position label (``plan[3]`` unused).
    ``MODE_LAST``/``MODE_MEAN``: ``plan[PLAN_SEG_START, s]`` first row, ``plan[PLAN_SEG_COUNT, s]``
    row count, ``plan[PLAN_SEG_SLOT, s]`` accumulator slot, ``plan[PLAN_SEG_REQ, s]`` req_idx label.

Per site (one site = one (component, layer) call site):

``site`` int32 ``[SITE_FIELDS]``
    ``[SITE_EXECUTIONS]`` incremented by exactly 1 on every launch (the device-side replay counter);
    ``[SITE_ENABLED]``    0 = the launch only counts.

``ring`` ``[ring_rows, W]`` (fp32/fp16/bf16), ``ring_labels`` int32 ``[ring_rows, LABEL_FIELDS]``.

``acc`` fp32 ``[acc_slots, W]``, ``acc_labels`` int32 ``[acc_slots, LABEL_FIELDS]``,
``acc_count`` int32 ``[acc_slots]``.

Labels are ``(req_idx, position, token_id)`` at ``LABEL_REQ`` / ``LABEL_POS`` / ``LABEL_TOKEN``.
"""

from __future__ import annotations

import torch

# plan_meta fields
META_MODE = 0
META_COUNT = 1
META_OFFSET = 2
META_STEP = 3
META_FIELDS = 4

# modes
MODE_OFF = 0
MODE_ROWS = 1
MODE_LAST = 2
MODE_MEAN = 3

# plan rows, MODE_ROWS
PLAN_ROW = 0
PLAN_REQ = 1
PLAN_POS = 2
# plan rows, MODE_LAST / MODE_MEAN
PLAN_SEG_START = 0
PLAN_SEG_COUNT = 1
PLAN_SEG_SLOT = 2
PLAN_SEG_REQ = 3
PLAN_FIELDS = 4

# site fields
SITE_EXECUTIONS = 0
SITE_ENABLED = 1
SITE_FIELDS = 2

# label columns (ring_labels[..., k], acc_labels[:, k])
LABEL_REQ = 0
LABEL_POS = 1
LABEL_TOKEN = 2
LABEL_FIELDS = 3

#: token-id label written when the row's input id cannot be read (row or id buffer out of range,
#: or no ``input_ids`` passed).
NO_TOKEN = -1

#: storage dtypes the ring may have (the accumulator is always fp32).
STORAGE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

INDEX_DTYPE = torch.int32


def new_plan_buffers(cap: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(plan_meta [META_FIELDS], plan [PLAN_FIELDS, cap])`` for one stream (mode off)."""
    return (torch.zeros(META_FIELDS, dtype=INDEX_DTYPE, device=device),
            plan_view(torch.zeros(cap * PLAN_FIELDS, dtype=INDEX_DTYPE, device=device)))


def plan_view(storage):
    """The ``[PLAN_FIELDS, cap]`` view of entry-major plan storage (a flat tensor or array)."""
    return storage.reshape(-1, PLAN_FIELDS).T


def new_site_buffer(device: torch.device | str, enabled: bool = True) -> torch.Tensor:
    """``site`` int32 ``[SITE_FIELDS]`` with executions 0."""
    site = torch.zeros(SITE_FIELDS, dtype=INDEX_DTYPE, device=device)
    site[SITE_ENABLED] = int(enabled)
    return site


def new_ring_buffers(rows: int, width: int, dtype: torch.dtype,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ring [rows, width], ring_labels [rows, LABEL_FIELDS])``; rows may be 0."""
    if dtype not in STORAGE_DTYPES:
        raise ValueError(f"ring dtype must be one of {STORAGE_DTYPES}, got {dtype}")
    return (torch.zeros(rows, width, dtype=dtype, device=device),
            torch.zeros(rows, LABEL_FIELDS, dtype=INDEX_DTYPE, device=device))


def new_acc_buffers(acc_slots: int, width: int, device: torch.device | str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(acc fp32 [acc_slots, width], acc_labels [acc_slots, LABEL_FIELDS], acc_count [acc_slots])``."""
    return (torch.zeros(acc_slots, width, dtype=torch.float32, device=device),
            torch.zeros(acc_slots, LABEL_FIELDS, dtype=INDEX_DTYPE, device=device),
            torch.zeros(acc_slots, dtype=INDEX_DTYPE, device=device))
