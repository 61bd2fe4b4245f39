"""Row gather (``MODE_ROWS``): planned activation rows -> the ring, at this step's offset, with labels.

Semantics (shared by the Triton device function and the torch reference), for
``r < n = clamp(plan_meta[META_COUNT], 0, min(T, cap))``, ``step = plan_meta[META_STEP]`` and
``offset = plan_meta[META_OFFSET] + step * plan_meta[META_COUNT]``::

    row = plan[PLAN_ROW, r]
    ring[offset + r, :]     = cast(fp32(x[row]) (+ fp32(residual[row])))     # add in fp32, one rounding
    ring_labels[offset + r] = (plan[PLAN_REQ, r], plan[PLAN_POS, r] + step, int32(input_ids[row]))

Nothing is written when ``offset < 0``, and entries with ``offset + r >= ring_rows`` are skipped
(the host never plans past the ring's end; the kernel still stays in bounds). ``n`` is capped by
``T`` because planned rows are distinct rows of this step (so ``count <= T``), and that keeps the
grid a function of ``x.shape[0]`` alone. A planned row outside ``[0, T)`` is a host bug; the kernel
still stays in bounds and writes zeros with token id ``NO_TOKEN`` for it. The token id is also
``NO_TOKEN`` when ``row >= len(input_ids)`` or no ``input_ids`` is given. Ring rows outside
``[offset, offset + n)`` are left as they were: they hold other steps' rows, not drained yet.
"""

from __future__ import annotations

import torch

from . import layout as L
from .common import HAVE_TRITON, from_f32, load_rows_f32, tl, triton

if HAVE_TRITON:
    # Triton only lets @jit code read module globals that are constexpr.
    _LABEL_FIELDS = tl.constexpr(L.LABEL_FIELDS)
    _LABEL_REQ = tl.constexpr(L.LABEL_REQ)
    _LABEL_POS = tl.constexpr(L.LABEL_POS)
    _LABEL_TOKEN = tl.constexpr(L.LABEL_TOKEN)
    _NO_TOKEN = tl.constexpr(L.NO_TOKEN)

    @triton.jit
    def gather_rows_tile(
        x_ptr, res_ptr, ids_ptr, ring_ptr, ring_labels_ptr,
        row, req, pos, spec_ok, spec_x, spec_tok,
        n, offset, T, W, n_ids,
        stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
        pid_r, pid_w,
        HAS_RES: tl.constexpr, UNIT_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
    ):
        """Copy plan entries ``[pid_r*BLOCK_R, +BLOCK_R) & < n`` x columns ``[pid_w*BLOCK_W, +BLOCK_W)``.

        ``row``, ``req`` and ``pos`` are those entries' ``plan[PLAN_ROW]``, ``plan[PLAN_REQ]`` and
        ``plan[PLAN_POS]`` plus the meta's step (the label position), each [BLOCK_R], read by the
        caller before it knew the mode, so that they load alongside it. ``spec_x`` and ``spec_tok``
        are fp32 rows ``r`` of this tile and their token ids, read by the caller alongside the plan
        where ``spec_ok``; an entry whose planned row is ``r`` takes them instead of reading its
        row after the plan. ``n`` (already clamped to the ring's end) and ``offset`` (already
        checked >= 0) come from device memory, so the same compiled kernel and grid serve every
        step of a captured graph. Labels are written once per row, by the ``pid_w == 0`` column
        block.
        """
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = r < n
        row = tl.where(rmask, row, -1)
        row_ok = rmask & (row >= 0) & (row < T)
        row64 = row.to(tl.int64)
        cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        cmask = cols < W
        cols64 = cols.to(tl.int64)
        have = spec_ok & (row == r)
        lmask = (row_ok & ~have)[:, None] & cmask[None, :]
        v = load_rows_f32(x_ptr, res_ptr, row64[:, None], cols64[None, :], lmask,
                          stride_xt, stride_xw, stride_rt, stride_rw, HAS_RES, UNIT_W)
        v = tl.where(have[:, None], spec_x, v)
        dst = offset.to(tl.int64) + r.to(tl.int64)                          # ring row index
        tl.store(ring_ptr + dst[:, None] * W + cols64[None, :],
                 from_f32(v, ring_ptr.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])
        if pid_w == 0:
            tok = tl.load(ids_ptr + row64 * stride_ids, mask=row_ok & (row < n_ids) & ~have,
                          other=_NO_TOKEN)
            tok = tl.where(have, spec_tok, tok)
            lab = ring_labels_ptr + dst * _LABEL_FIELDS
            tl.store(lab + _LABEL_REQ, req, mask=rmask)
            tl.store(lab + _LABEL_POS, pos, mask=rmask)
            tl.store(lab + _LABEL_TOKEN, tok.to(tl.int32), mask=rmask)


def _token_ids(input_ids: torch.Tensor | None, rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """int32 token id of each row (``NO_TOKEN`` where ``~ok`` or out of the id buffer); no sync."""
    if input_ids is None or input_ids.shape[0] == 0:
        return torch.full_like(rows, L.NO_TOKEN, dtype=torch.int32)
    n_ids = input_ids.shape[0]
    ok = ok & (rows < n_ids)
    tok = input_ids[rows.clamp(0, n_ids - 1)].to(torch.int32)
    return torch.where(ok, tok, torch.full_like(tok, L.NO_TOKEN))


def _rows_f32(x: torch.Tensor, residual: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``x[rows] (+ residual[rows])``; ``rows`` must be in range."""
    v = x[rows].to(torch.float32)
    if residual is not None:
        v = v + residual[rows].to(torch.float32)
    return v


def gather_rows_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    plan_meta: torch.Tensor,
    plan: torch.Tensor,
    ring: torch.Tensor,
    ring_labels: torch.Tensor,
    *,
    enabled: bool | torch.Tensor = True,
    allow_sync: bool | None = None,
) -> None:
    """Torch version of the ``MODE_ROWS`` gather (any device); a no-op unless the mode is ROWS.

    ``enabled`` may be a 0-d bool tensor (``site[SITE_ENABLED] != 0``) so the caller needs no sync.
    With ``allow_sync=False`` (the default off CPU) nothing reads device values on the host: every
    decision is a device-side mask over the static ``min(T, cap, ring_rows)`` entries, so it is safe
    under CUDA-graph capture. With ``allow_sync=True`` (default on CPU, where a "sync" is free) it
    returns early when idle and only touches ``count`` entries.
    """
    if allow_sync is None:
        allow_sync = x.device.type == "cpu"
    T = x.shape[0]
    cap = plan.shape[1]
    ring_rows = ring.shape[0]
    n_max = min(T, cap, ring_rows)
    if n_max == 0:
        return
    mode = plan_meta[L.META_MODE]
    count = plan_meta[L.META_COUNT]
    step = plan_meta[L.META_STEP]
    offset = plan_meta[L.META_OFFSET] + step * count
    active = (mode == L.MODE_ROWS) & (offset >= 0) & enabled
    if allow_sync:
        if not bool(active):
            return
        n_max = min(n_max, max(0, int(count)), ring_rows - int(offset))
        if n_max <= 0:
            return
    device = x.device
    r = torch.arange(n_max, device=device)
    end = offset.to(torch.int64) + r
    live = active & (r < count) & (end < ring_rows)                          # [n]
    # n_max <= ring_rows consecutive ends are distinct mod ring_rows, so no two entries (live or
    # dead) share a ring row; a dead entry rewrites the value it read, which keeps the update a
    # device-side select.
    dst = torch.remainder(end, ring_rows)
    rows = plan[L.PLAN_ROW, :n_max].to(torch.int64)
    row_ok = (rows >= 0) & (rows < T)
    rows_c = rows.clamp(0, T - 1)
    v = _rows_f32(x, residual, rows_c).masked_fill(~row_ok[:, None], 0.0)
    ring.index_put_((dst,), torch.where(live[:, None], v.to(ring.dtype), ring[dst]))
    labels = torch.stack((plan[L.PLAN_REQ, :n_max], plan[L.PLAN_POS, :n_max] + step,
                          _token_ids(input_ids, rows_c, row_ok)), dim=1).to(torch.int32)
    ring_labels.index_put_((dst,), torch.where(live[:, None], labels, ring_labels[dst]))
