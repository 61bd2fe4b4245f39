"""Per-request reductions (``MODE_LAST`` / ``MODE_MEAN``) into fp32 accumulator slots.

Semantics (shared by the Triton device function and the torch reference), for each segment
``s < n = clamp(plan_meta[META_COUNT], 0, min(T, cap))`` with ``start, cnt, slot, req`` read from
``plan[PLAN_SEG_*, s]``. A segment is *valid* iff ``cnt > 0``, ``0 <= start``,
``start + cnt <= T`` and ``0 <= slot < acc_slots``; invalid segments are skipped entirely (they can
only come from a host bug, and skipping keeps every access in bounds)::

    MODE_LAST:  last = start + cnt - 1
                acc[slot, :]                 = fp32(x[last]) (+ fp32(residual[last]))
                acc_labels[slot, LABEL_REQ]  = req
                acc_labels[slot, LABEL_TOKEN]= int32(input_ids[last])   (NO_TOKEN if unreadable)
                acc_labels[slot, LABEL_POS]  untouched (segments carry no position; the host knows it)
                acc_count[slot]             += cnt
    MODE_MEAN:  acc[slot, :]                += sum_{t in [start, start+cnt)} fp32(x[t]) (+ fp32(residual[t]))
                acc_labels[slot, LABEL_REQ]  = req
                acc_count[slot]             += cnt

``n`` is capped by ``T`` because a step has at most one segment per request and at most ``T``
requests; that keeps the grid a function of ``x.shape[0]`` alone. The host zeroes a slot when it
assigns it to a request and divides by ``acc_count`` at finalize; so several steps (chunked
prefill, decode) accumulate into the same slot.

Determinism: in the kernel, each (segment, column block) is summed by one program in an order
fixed by the plan alone (see :func:`accumulate_segments_tile`: short segments sequentially over
rows; long ones in ``BLOCK_T`` interleaved sequential partial sums reduced by a fixed ``tl.sum``
tree), then added to ``acc`` once. No atomics touch ``acc``, and sizes are not specialised, so
eager and CUDA-graph runs (any padded ``T``) of the same compiled variant are bit-identical. The torch reference sums with
``index_put_(accumulate=True)``, deterministic on CPU and CUDA, in its own order (equal to the
kernel within fp32 rounding).

Segments of one step must have distinct slots and cover disjoint rows (one segment per request);
the reference relies on disjointness to map rows to segments without a host sync.
"""

from __future__ import annotations

import torch

from . import layout as L
from .common import HAVE_TRITON, load_rows_f32, max0, sum0, tl, triton
from .gather import _rows_f32, _token_ids

if HAVE_TRITON:
    _PLAN_FIELDS = tl.constexpr(L.PLAN_FIELDS)
    _SEG_START = tl.constexpr(L.PLAN_SEG_START)
    _SEG_COUNT = tl.constexpr(L.PLAN_SEG_COUNT)
    _SEG_SLOT = tl.constexpr(L.PLAN_SEG_SLOT)
    _SEG_REQ = tl.constexpr(L.PLAN_SEG_REQ)
    _LABEL_FIELDS = tl.constexpr(L.LABEL_FIELDS)
    _LABEL_REQ = tl.constexpr(L.LABEL_REQ)
    _LABEL_TOKEN = tl.constexpr(L.LABEL_TOKEN)
    _NO_TOKEN = tl.constexpr(L.NO_TOKEN)

    @triton.jit
    def accumulate_segments_tile(
        x_ptr, res_ptr, ids_ptr, plan_ptr, acc_ptr, acc_labels_ptr, acc_count_ptr,
        start, cnt, slot, req, spec_ok, spec_x, spec_tok,
        n, T, n_acc, W, n_ids,
        stride_xt, stride_xw, stride_rt, stride_rw, stride_ids,
        pid_r, pid_w,
        IS_MEAN: tl.constexpr, HAS_RES: tl.constexpr, UNIT_W: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr, SHORT: tl.constexpr,
    ):
        """Segments ``[pid_r*BLOCK_R, +BLOCK_R) & < n`` x columns ``[pid_w*BLOCK_W, +BLOCK_W)``.

        ``start``, ``cnt``, ``slot`` and ``req`` are those segments' ``plan[PLAN_SEG_*]``
        ([BLOCK_R], read by the caller before it knew the mode, so that they load alongside it).
        ``spec_x`` and ``spec_tok`` are fp32 rows ``s`` of this tile and their token ids, read by
        the caller alongside the plan where ``spec_ok``: a one-row segment at row ``s`` (decode)
        takes them instead of reading its row after the plan.

        ``IS_MEAN`` is a compile-time switch (the capture kernel dispatches on the runtime mode to
        one of two inlined copies). Labels and counts are written by the ``pid_w == 0`` column
        block only; ``acc_count`` uses an atomic add so that it stays exact even if a buggy plan
        repeats a slot.

        MODE_MEAN has two paths, chosen per segment from its row count alone (so the choice, and
        hence the summation order, depends only on the plan, never on ``T`` or timing):

        * ``cnt <= SHORT`` (decode, speculative decode): all such segments of the block advance
          together, one row per segment per iteration, into a [BLOCK_R, BLOCK_W] accumulator:
          a plain sequential sum over the rows, ``acc += ((r0 + r1) + r2) + ...``.
        * ``cnt > SHORT`` (prefill chunks): one segment at a time; rows go ``BLOCK_T`` per
          iteration into a [BLOCK_T, BLOCK_W] accumulator (row ``t`` into lane ``t % BLOCK_T``,
          sequentially), reduced once at the end by ``sum0`` (``tl.sum``: a fixed tree). This keeps
          ``BLOCK_T`` rows of loads in flight per iteration instead of one.
        """
        cols = pid_w * BLOCK_W + tl.arange(0, BLOCK_W)
        cmask = cols < W
        cols64 = cols.to(tl.int64)
        s = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        smask = s < n
        start = tl.where(smask, start, 0)
        cnt = tl.where(smask, cnt, 0)
        slot = tl.where(smask, slot, -1)
        ok = smask & (cnt > 0) & (start >= 0) & (start <= T - cnt) & (slot >= 0) & (slot < n_acc)
        slot64 = slot.to(tl.int64)
        if IS_MEAN:
            short = ok & (cnt <= SHORT)
            n_steps = max0(tl.where(short, cnt, 0))
            if n_steps > 0:
                have = short & spec_ok & (start == s)
                # 0.0 + r0 and r0 + 0.0 are the same bits: the order of the sum is kept.
                total = tl.where(have[:, None], spec_x, 0.0)
                for i in range(0, n_steps):
                    rows64 = (start + i).to(tl.int64)
                    m = (short & (i < cnt) & ~(have & (i == 0)))[:, None] & cmask[None, :]
                    total += load_rows_f32(x_ptr, res_ptr, rows64[:, None], cols64[None, :], m,
                                           stride_xt, stride_xw, stride_rt, stride_rw, HAS_RES, UNIT_W)
                m = short[:, None] & cmask[None, :]
                a_ptrs = acc_ptr + slot64[:, None] * W + cols64[None, :]
                tl.store(a_ptrs, tl.load(a_ptrs, mask=m, other=0.0) + total, mask=m)
                if pid_w == 0:
                    tl.store(acc_labels_ptr + slot64 * _LABEL_FIELDS + _LABEL_REQ, req, mask=short)
                    tl.atomic_add(acc_count_ptr + slot, cnt, mask=short, sem="relaxed")
            n_long = sum0((ok & (cnt > SHORT)).to(tl.int32))
            if n_long > 0:
                for j in range(BLOCK_R):
                    sj = pid_r * BLOCK_R + j
                    if sj < n:
                        st = tl.load(plan_ptr + sj * _PLAN_FIELDS + _SEG_START)
                        ct = tl.load(plan_ptr + sj * _PLAN_FIELDS + _SEG_COUNT)
                        sl = tl.load(plan_ptr + sj * _PLAN_FIELDS + _SEG_SLOT)
                        if (ct > SHORT) & (st >= 0) & (st <= T - ct) & (sl >= 0) & (sl < n_acc):
                            part = tl.full([BLOCK_T, BLOCK_W], 0.0, tl.float32)
                            for t0 in range(0, ct, BLOCK_T):
                                tt = t0 + tl.arange(0, BLOCK_T)
                                rows64 = (st + tt).to(tl.int64)
                                m = (tt < ct)[:, None] & cmask[None, :]
                                part += load_rows_f32(x_ptr, res_ptr, rows64[:, None], cols64[None, :],
                                                      m, stride_xt, stride_xw, stride_rt, stride_rw,
                                                      HAS_RES, UNIT_W)
                            sl64 = sl.to(tl.int64)
                            a_ptrs = acc_ptr + sl64 * W + cols64
                            tl.store(a_ptrs, tl.load(a_ptrs, mask=cmask, other=0.0) + sum0(part),
                                     mask=cmask)
                            if pid_w == 0:
                                rq = tl.load(plan_ptr + sj * _PLAN_FIELDS + _SEG_REQ)
                                tl.store(acc_labels_ptr + sl64 * _LABEL_FIELDS + _LABEL_REQ, rq)
                                tl.atomic_add(acc_count_ptr + sl, ct, sem="relaxed")
        else:
            # One row per segment: BLOCK_R segments as one [BLOCK_R, BLOCK_W] tile.
            last = start + cnt - 1
            last64 = last.to(tl.int64)
            have = ok & spec_ok & (last == s)
            m = ok[:, None] & cmask[None, :]
            v = load_rows_f32(x_ptr, res_ptr, last64[:, None], cols64[None, :],
                              (ok & ~have)[:, None] & cmask[None, :],
                              stride_xt, stride_xw, stride_rt, stride_rw, HAS_RES, UNIT_W)
            v = tl.where(have[:, None], spec_x, v)
            tl.store(acc_ptr + slot64[:, None] * W + cols64[None, :], v, mask=m)
            if pid_w == 0:
                tok = tl.load(ids_ptr + last64 * stride_ids, mask=ok & (last < n_ids) & ~have,
                              other=_NO_TOKEN)
                tok = tl.where(have, spec_tok, tok)
                lab = acc_labels_ptr + slot64 * _LABEL_FIELDS
                tl.store(lab + _LABEL_REQ, req, mask=ok)
                tl.store(lab + _LABEL_TOKEN, tok.to(tl.int32), mask=ok)
                tl.atomic_add(acc_count_ptr + slot, cnt, mask=ok, sem="relaxed")


def _scatter_unique(dst: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor, values: torch.Tensor) -> None:
    """``dst[idx[i]] = values[i]`` for ``ok[i]``, without a host sync and without racing writes.

    Valid indices are distinct (one segment per slot). Invalid entries must still go somewhere in a
    mask-only formulation; they are redirected to the first valid entry's index *with that entry's
    value*, so every write to an index carries the same value. With no valid entry, all entries
    rewrite ``dst[idx[0]]`` with its own value.
    """
    shape = (-1,) + (1,) * (values.dim() - 1)
    first = ok.to(torch.int32).argmax().view(1)  # 1-D index: t[0-d tensor] would sync (.item())
    final = torch.where(ok.view(shape), values.to(dst.dtype), dst[idx])
    dst.index_put_((torch.where(ok, idx, idx[first]),),
                   torch.where(ok.view(shape), final, final[first]))


def accumulate_reference(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    input_ids: torch.Tensor | None,
    plan_meta: torch.Tensor,
    plan: torch.Tensor,
    acc: torch.Tensor,
    acc_labels: torch.Tensor,
    acc_count: torch.Tensor,
    *,
    enabled: bool | torch.Tensor = True,
    allow_sync: bool | None = None,
) -> None:
    """Torch version of ``MODE_LAST`` / ``MODE_MEAN`` (any device); a no-op for other modes.

    ``allow_sync`` as in :func:`gather_rows_reference`: without it both reductions are evaluated
    as device-side masked updates (the mode itself is only known on the device), so the function is
    capturable; with it (CPU) it reads the mode and count on the host and does only what is needed.
    """
    if allow_sync is None:
        allow_sync = x.device.type == "cpu"
    T = x.shape[0]
    cap = plan.shape[1]
    n_acc = acc.shape[0]
    n_max = min(T, cap)
    if n_acc == 0 or n_max == 0:
        return
    mode = plan_meta[L.META_MODE]
    count = plan_meta[L.META_COUNT]
    is_last = (mode == L.MODE_LAST) & enabled
    is_mean = (mode == L.MODE_MEAN) & enabled
    do_last = do_mean = True
    if allow_sync:
        do_last, do_mean = bool(is_last), bool(is_mean)
        n_max = min(n_max, max(0, int(count)))
        if n_max == 0 or not (do_last or do_mean):
            return
    device = x.device
    s = torch.arange(n_max, device=device)
    start = plan[L.PLAN_SEG_START, :n_max].to(torch.int64)
    cnt = plan[L.PLAN_SEG_COUNT, :n_max].to(torch.int64)
    slot = plan[L.PLAN_SEG_SLOT, :n_max].to(torch.int64)
    req = plan[L.PLAN_SEG_REQ, :n_max]
    ok = (s < count) & (cnt > 0) & (start >= 0) & (start + cnt <= T) & (slot >= 0) & (slot < n_acc)
    slot_c = slot.clamp(0, n_acc - 1)

    if do_last:
        ok_l = ok & is_last
        last = (start + cnt - 1).clamp(0, T - 1)
        _scatter_unique(acc, slot_c, ok_l, _rows_f32(x, residual, last))
        _scatter_unique(acc_labels[:, L.LABEL_REQ], slot_c, ok_l, req)
        _scatter_unique(acc_labels[:, L.LABEL_TOKEN], slot_c, ok_l, _token_ids(input_ids, last, ok_l))
        acc_count.index_add_(0, slot_c, torch.where(ok_l, cnt, 0).to(acc_count.dtype))

    if do_mean:
        ok_m = ok & is_mean
        # Row -> 1-based segment id via +id/-id boundary marks and a prefix sum (rows of one step's
        # segments are disjoint); 0 = row in no valid segment. All on the device.
        seg_id = torch.where(ok_m, s + 1, 0)
        marks = torch.zeros(T + 1, dtype=torch.int64, device=device)
        marks.index_add_(0, start.clamp(0, T), seg_id)
        marks.index_add_(0, (start + cnt).clamp(0, T), -seg_id)
        row_seg = marks.cumsum(0)[:T]
        row_seg = torch.where((row_seg >= 0) & (row_seg <= n_max), row_seg, 0)
        v = x.to(torch.float32)
        if residual is not None:
            v = v + residual.to(torch.float32)
        sums = torch.zeros(n_max + 1, x.shape[1], dtype=torch.float32, device=device)
        # index_put_(accumulate=True) is deterministic on CUDA (sort-based), unlike index_add_.
        sums.index_put_((row_seg,), v, accumulate=True)
        acc.index_put_((slot_c,), torch.where(ok_m[:, None], sums[1:], 0.0), accumulate=True)
        _scatter_unique(acc_labels[:, L.LABEL_REQ], slot_c, ok_m, req)
        acc_count.index_add_(0, slot_c, torch.where(ok_m, cnt, 0).to(acc_count.dtype))
