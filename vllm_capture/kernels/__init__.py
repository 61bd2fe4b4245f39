"""Capture kernels: one launch per call site per step, safe inside CUDA-graph replay.

Per step the host writes a plan per stream into static device buffers (``layout``); inside the
forward, :func:`launch_capture` reads it on the device and either gathers planned rows into the
site's ring (``gather``) or updates per-request last/mean accumulators (``accumulate``).
Without CUDA (or Triton) the torch references implement the same semantics.
"""

from . import layout
from .accumulate import accumulate_reference
from .capture import (
    BLOCK_R,
    BLOCK_T,
    BLOCK_W,
    MEAN_SHORT,
    NUM_WARPS,
    capture_grid,
    capture_reference,
    compile_variants,
    launch_capture,
    warmup,
)
from .common import HAVE_TRITON
from .gather import gather_rows_reference
from .layout import (
    INDEX_DTYPE,
    LABEL_FIELDS,
    LABEL_POS,
    LABEL_REQ,
    LABEL_TOKEN,
    META_COUNT,
    META_FIELDS,
    META_MODE,
    META_OFFSET,
    META_STEP,
    MODE_LAST,
    MODE_MEAN,
    MODE_OFF,
    MODE_ROWS,
    NO_TOKEN,
    PLAN_FIELDS,
    PLAN_POS,
    PLAN_REQ,
    PLAN_ROW,
    PLAN_SEG_COUNT,
    PLAN_SEG_REQ,
    PLAN_SEG_SLOT,
    PLAN_SEG_START,
    SITE_ENABLED,
    SITE_EXECUTIONS,
    SITE_FIELDS,
    STORAGE_DTYPES,
    new_acc_buffers,
    new_plan_buffers,
    new_ring_buffers,
    new_site_buffer,
)

__all__ = [
    "layout", "launch_capture", "warmup", "compile_variants", "capture_reference", "capture_grid",
    "gather_rows_reference", "accumulate_reference", "HAVE_TRITON",
    "BLOCK_R", "BLOCK_W", "BLOCK_T", "MEAN_SHORT", "NUM_WARPS",
    "META_MODE", "META_COUNT", "META_OFFSET", "META_STEP", "META_FIELDS",
    "MODE_OFF", "MODE_ROWS", "MODE_LAST", "MODE_MEAN",
    "PLAN_ROW", "PLAN_REQ", "PLAN_POS", "PLAN_SEG_START", "PLAN_SEG_COUNT", "PLAN_SEG_SLOT",
    "PLAN_SEG_REQ", "PLAN_FIELDS",
    "SITE_EXECUTIONS", "SITE_ENABLED", "SITE_FIELDS",
    "LABEL_REQ", "LABEL_POS", "LABEL_TOKEN", "LABEL_FIELDS", "NO_TOKEN",
    "STORAGE_DTYPES", "INDEX_DTYPE",
    "new_plan_buffers", "new_site_buffer", "new_ring_buffers", "new_acc_buffers",
]
