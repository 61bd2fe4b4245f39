"""Capture kernel vs torch reference vs an independent brute-force loop (CPU, Triton interpreter).

The Triton kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (``use_triton=True``); the torch
reference runs both in its CPU form (host reads allowed) and in its sync-free form (the one that
would run under CUDA-graph capture without Triton). All are checked against ``brute`` below, a
plain Python loop written from the layout description. Equality is bitwise wherever the math is
exact (gather, casts, last); sums (mean) are compared within fp32 tolerance.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere in this process

import importlib
import inspect
import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _import_kernels():
    """Import vllm_capture.kernels with interpreted @triton.jit functions.

    triton.jit decides compiled vs interpreted when a function is *defined*, so if another test
    module imported the kernels before this one set TRITON_INTERPRET, reload them.
    """
    import vllm_capture.kernels as K

    if K.HAVE_TRITON:
        from triton.runtime.interpreter import InterpretedFunction

        from vllm_capture.kernels import capture

        if not isinstance(capture.capture_site_kernel, InterpretedFunction):
            for name in ("common", "gather", "accumulate", "capture"):
                importlib.reload(sys.modules[f"vllm_capture.kernels.{name}"])
            K = importlib.reload(K)
    return K


K = _import_kernels()
L = K.layout

pytestmark = [
    # Triton-interpreter internals (numpy deprecations, fp16 overflow to inf in a cast we test on
    # purpose); not ours.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.*"),
    pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning"),
]

needs_triton = pytest.mark.skipif(not K.HAVE_TRITON, reason="triton not installed")

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


# ----------------------------------------------------------------------------------------------
# independent brute force
# ----------------------------------------------------------------------------------------------

def brute(x, residual, input_ids, plan_meta, plan, site, ring, ring_labels, acc, acc_labels, acc_count):
    """Row-by-row, segment-by-segment reading of the layout spec (mutates the buffers)."""
    site[0] += 1
    if int(site[1]) == 0:
        return
    mode, count, offset, step = [int(v) for v in plan_meta]
    T, W = x.shape
    cap = plan.shape[1]

    def value(row):
        v = x[row].to(torch.float32)
        if residual is not None:
            v = v + residual[row].to(torch.float32)
        return v

    def token(row):
        if input_ids is None or not 0 <= row < input_ids.shape[0]:
            return -1
        return int(input_ids[row])

    if mode == 1:
        offset += step * count  # a repeated step: its rows follow the last one's
        if offset < 0:
            return
        for r in range(max(0, min(count, cap, T))):
            if offset + r >= ring.shape[0]:
                break
            row = int(plan[0, r])
            if 0 <= row < T:
                v, tok = value(row), token(row)
            else:
                v, tok = torch.zeros(W), -1
            ring[offset + r] = v.to(ring.dtype)
            ring_labels[offset + r, 0] = int(plan[1, r])
            ring_labels[offset + r, 1] = int(plan[2, r]) + step
            ring_labels[offset + r, 2] = tok
    elif mode in (2, 3):
        for s in range(max(0, min(count, cap, T))):
            start, cnt, aslot, req = (int(v) for v in plan[:, s])
            if cnt <= 0 or start < 0 or start + cnt > T or not 0 <= aslot < acc.shape[0]:
                continue
            if mode == 2:
                last = start + cnt - 1
                acc[aslot] = value(last)
                acc_labels[aslot, 2] = token(last)
            else:
                total = torch.zeros(W, dtype=torch.float32)
                for t in range(start, start + cnt):
                    total = total + value(t)
                acc[aslot] = acc[aslot] + total
            acc_labels[aslot, 0] = req
            acc_count[aslot] += cnt


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

BUFS = ("plan_meta", "plan", "site", "ring", "ring_labels", "acc", "acc_labels", "acc_count")


def make_x(g, T, W, dtype, layout, fill_nan_rows=()):
    """[T, W] activations in the requested memory layout (values exact in ``dtype``)."""
    if layout == "contig":
        x = torch.randn(T, W, generator=g).to(dtype)
    elif layout == "transposed":  # strides (1, T)
        x = torch.randn(W, T, generator=g).to(dtype).t()
    elif layout == "sliced":  # row stride 2*(W+3), column offset 1: unaligned, non-contiguous
        base = torch.randn(2 * T, W + 3, generator=g).to(dtype)
        x = base[::2, 1:W + 1]
    else:
        raise ValueError(layout)
    for row in fill_nan_rows:  # rows that must never be read
        x[row] = float("nan")
    assert x.shape == (T, W)
    return x


def make_ids(g, T, dtype, extra=3):
    if dtype is None:
        return None
    return torch.randint(0, 50_000, (T + extra,), generator=g).to(dtype)


def make_bufs(g, *, cap, W, ring_rows, ring_dtype, acc_slots, enabled=True):
    """Static buffers prefilled with garbage so that untouched entries are checked too."""
    b = {}
    b["plan_meta"], b["plan"] = L.new_plan_buffers(cap, "cpu")
    b["plan"].copy_(torch.randint(-5, 10_000, b["plan"].shape, generator=g))
    b["site"] = L.new_site_buffer("cpu", enabled)
    b["site"][L.SITE_EXECUTIONS] = 41
    b["ring"] = torch.randn(ring_rows, W, generator=g).to(ring_dtype)
    b["ring_labels"] = torch.randint(-9, 9, (ring_rows, 3), generator=g, dtype=torch.int32)
    b["acc"] = torch.randn(acc_slots, W, generator=g)
    b["acc_labels"] = torch.randint(-9, 9, (acc_slots, 3), generator=g, dtype=torch.int32)
    b["acc_count"] = torch.randint(0, 5, (acc_slots,), generator=g, dtype=torch.int32)
    return b


def clone(b):
    return {k: v.clone() for k, v in b.items()}


def set_rows_plan(g, b, T, count, offset, *, shuffle=False, step=0):
    rows = torch.randperm(T, generator=g)[:count]
    if not shuffle:
        rows = rows.sort().values
    b["plan_meta"][:] = torch.tensor([L.MODE_ROWS, count, offset, step])
    b["plan"][L.PLAN_ROW, :count] = rows.to(torch.int32)
    b["plan"][L.PLAN_REQ, :count] = torch.randint(0, 1000, (count,), generator=g, dtype=torch.int32)
    b["plan"][L.PLAN_POS, :count] = torch.randint(0, 9000, (count,), generator=g, dtype=torch.int32)
    return rows


def set_segment_plan(g, b, T, mode, n_seg, acc_slots):
    """``n_seg`` disjoint runs of rows (with gaps), distinct slots, random order."""
    assert n_seg <= T and n_seg <= acc_slots
    cuts = sorted(torch.randperm(T + 1, generator=g)[: 2 * n_seg].tolist()) if n_seg else []
    segs = []
    for i in range(n_seg):
        lo, hi = cuts[2 * i], cuts[2 * i + 1]
        segs.append((lo, hi - lo))
    slots = torch.randperm(acc_slots, generator=g)[:n_seg].tolist()
    order = torch.randperm(n_seg, generator=g).tolist()
    b["plan_meta"][:] = torch.tensor([mode, n_seg, 0, 0])
    covered = set()
    for s, i in enumerate(order):
        start, cnt = segs[i]
        b["plan"][:, s] = torch.tensor([start, cnt, slots[s], 100 + s], dtype=torch.int32)
        covered.update(range(start, start + cnt))
    return covered


def run_all(x, residual, ids, b, *, triton=True):
    """Apply every implementation to its own copy of ``b``; returns {name: buffers}."""
    out = {}
    impls = {
        "brute": lambda bb: brute(x, residual, ids, *(bb[k] for k in BUFS)),
        "ref_host": lambda bb: K.launch_capture(x, residual, ids, *(bb[k] for k in BUFS), use_triton=False),
        "ref_nosync": lambda bb: K.capture_reference(x, residual, ids, *(bb[k] for k in BUFS),
                                                     allow_sync=False),
    }
    if triton and K.HAVE_TRITON:
        impls["triton"] = lambda bb: K.launch_capture(x, residual, ids, *(bb[k] for k in BUFS),
                                                      use_triton=True)
        # An eager launch: the grid covers the plan's count of entries only.
        impls["triton_eager"] = lambda bb: K.launch_capture(
            x, residual, ids, *(bb[k] for k in BUFS), use_triton=True,
            entries=int(bb["plan_meta"][L.META_COUNT]))
    for name, fn in impls.items():
        bb = clone(b)
        fn(bb)
        out[name] = bb
    return out


def bits(t):
    return t.view(BITS[t.dtype]) if t.is_floating_point() else t


def assert_same(out, *, approx_acc=False):
    ref = out["brute"]
    for name, got in out.items():
        for k in BUFS:
            a, e = got[k], ref[k]
            if approx_acc and k == "acc":
                torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}.{k}: {m}")
            else:
                assert torch.equal(bits(a), bits(e)), f"{name}.{k} differs from brute force:\n{a}\n{e}"


# ----------------------------------------------------------------------------------------------
# rows
# ----------------------------------------------------------------------------------------------

# (W, x dtype, ring dtype, residual, layout, ids dtype) -- covers every value of every axis.
ROW_CASES = [
    (1, torch.float32, torch.float32, False, "contig", torch.int64),
    (5, torch.float16, torch.float16, True, "transposed", torch.int32),
    (37, torch.bfloat16, torch.bfloat16, True, "sliced", torch.int64),
    (130, torch.float32, torch.bfloat16, True, "transposed", torch.int32),
    (37, torch.float32, torch.float16, False, "sliced", torch.int32),
    (5, torch.bfloat16, torch.float32, False, "contig", torch.int64),
    (130, torch.float16, torch.float32, True, "contig", torch.int64),
    (1, torch.bfloat16, torch.float16, True, "transposed", None),
]


@needs_triton
@pytest.mark.parametrize("W,x_dtype,ring_dtype,with_res,layout,ids_dtype", ROW_CASES)
def test_rows_random_plan(W, x_dtype, ring_dtype, with_res, layout, ids_dtype):
    g = torch.Generator().manual_seed(W * 7 + FLOATS.index(x_dtype) * 3 + FLOATS.index(ring_dtype))
    T, cap, offset = 37, 24, 29
    b = make_bufs(g, cap=cap, W=W, ring_rows=3 * cap, ring_dtype=ring_dtype, acc_slots=2)
    count = 19  # spans two BLOCK_R row tiles
    rows = set_rows_plan(g, b, T, count, offset=offset, shuffle=W % 2 == 1)
    unplanned = [r for r in range(T) if r not in set(rows.tolist())]
    x = make_x(g, T, W, x_dtype, layout, fill_nan_rows=unplanned)
    res = make_x(g, T, W, x_dtype, "contig" if layout != "contig" else "transposed") if with_res else None
    ids = make_ids(g, T, ids_dtype)
    out = run_all(x, res, ids, b)
    assert_same(out)
    got = out["triton"]
    mine = slice(offset, offset + count)
    assert not torch.isnan(got["ring"][mine].float()).any()
    # spot-check against the spec directly
    r0 = int(rows[0])
    expect = x[r0].float() + (res[r0].float() if with_res else 0)
    assert torch.equal(bits(got["ring"][offset]), bits(expect.to(ring_dtype)))
    assert int(got["ring_labels"][offset, 2]) == (int(ids[r0]) if ids is not None else L.NO_TOKEN)
    assert int(got["site"][L.SITE_EXECUTIONS]) == 42
    # ring rows of other steps (before the offset and past count) and the accumulators are untouched
    for k in ("acc", "acc_labels", "acc_count"):
        assert torch.equal(got[k], b[k])
    for other in (slice(0, offset), slice(offset + count, None)):
        assert torch.equal(bits(got["ring"][other]), bits(b["ring"][other]))
        assert torch.equal(got["ring_labels"][other], b["ring_labels"][other])


@needs_triton
@pytest.mark.parametrize("step", [1, 3])
def test_a_repeated_step_writes_after_the_last_one_a_position_further(step):
    """``META_STEP``: the plan of ``count`` rows at ``offset``, ``step`` steps on, writes ring rows
    ``offset + step * count`` onwards, its position labels ``step`` further; the rows before and
    after stay as they were."""
    g = torch.Generator().manual_seed(step)
    T, W, cap, count, offset = 21, 37, 24, 9, 4
    b = make_bufs(g, cap=cap, W=W, ring_rows=offset + 5 * count, ring_dtype=torch.bfloat16,
                  acc_slots=1)
    rows = set_rows_plan(g, b, T, count, offset=offset, shuffle=True, step=step)
    x = make_x(g, T, W, torch.float32, "transposed")
    out = run_all(x, None, make_ids(g, T, torch.int32), b)
    assert_same(out)
    got, first = out["triton"], offset + step * count
    mine = slice(first, first + count)
    assert torch.equal(got["ring_labels"][mine, L.LABEL_POS], b["plan"][L.PLAN_POS, :count] + step)
    assert torch.equal(got["ring_labels"][mine, L.LABEL_REQ], b["plan"][L.PLAN_REQ, :count])
    assert torch.equal(bits(got["ring"][first]), bits(x[int(rows[0])].to(torch.bfloat16)))
    for other in (slice(0, first), slice(first + count, None)):
        assert torch.equal(bits(got["ring"][other]), bits(b["ring"][other]))
        assert torch.equal(got["ring_labels"][other], b["ring_labels"][other])


@needs_triton
@pytest.mark.parametrize("T,cap", [(10, 10), (7, 12), (40, 16)])
def test_rows_full_ring(T, cap):
    """count == min(T, cap) rows ending exactly at the ring's last row: every row is written."""
    g = torch.Generator().manual_seed(T + cap)
    W = 5
    count = min(T, cap)
    b = make_bufs(g, cap=cap, W=W, ring_rows=count + 3, ring_dtype=torch.float16, acc_slots=1)
    set_rows_plan(g, b, T, count, offset=3, shuffle=True)
    x = make_x(g, T, W, torch.float32, "transposed")
    out = run_all(x, None, make_ids(g, T, torch.int64), b)
    assert_same(out)
    assert torch.equal(out["triton"]["ring_labels"][:3], b["ring_labels"][:3])
    assert not torch.equal(out["triton"]["ring_labels"][3:], b["ring_labels"][3:])


@needs_triton
@pytest.mark.parametrize("offset", [10, 13, 14, 40])
def test_rows_past_the_ring_end_are_skipped(offset):
    """A plan running past the ring's last row (host bug) writes only the rows that fit."""
    g = torch.Generator().manual_seed(offset)
    T, W, cap = 20, 37, 8
    b = make_bufs(g, cap=cap, W=W, ring_rows=14, ring_dtype=torch.bfloat16, acc_slots=1)
    set_rows_plan(g, b, T, cap, offset=offset)
    out = run_all(make_x(g, T, W, torch.float32, "contig"), None, make_ids(g, T, torch.int32), b)
    assert_same(out)
    written = max(0, 14 - offset)
    assert torch.equal(bits(out["triton"]["ring"][:offset]), bits(b["ring"][:offset]))
    if written:
        assert not torch.equal(out["triton"]["ring_labels"][offset:], b["ring_labels"][offset:])


@needs_triton
def test_rows_count_beyond_capacity_is_clamped():
    """A count larger than cap (host bug) writes exactly cap rows, never past the ring."""
    g = torch.Generator().manual_seed(3)
    T, W, cap = 30, 5, 8
    b = make_bufs(g, cap=cap, W=W, ring_rows=2 * cap, ring_dtype=torch.float32, acc_slots=1)
    set_rows_plan(g, b, T, cap, offset=cap)
    b["plan_meta"][L.META_COUNT] = 1000
    out = run_all(make_x(g, T, W, torch.float32, "contig"), None, make_ids(g, T, torch.int32), b)
    assert_same(out)


@needs_triton
def test_rows_out_of_range_entries_stay_in_bounds():
    """Rows outside [0, T) become zeros with NO_TOKEN; ids past the buffer give NO_TOKEN; a negative
    offset writes nothing. (Host bugs; the kernel must still not touch foreign memory.)"""
    g = torch.Generator().manual_seed(4)
    T, W, cap = 12, 37, 8
    b = make_bufs(g, cap=cap, W=W, ring_rows=2 * cap, ring_dtype=torch.bfloat16, acc_slots=1)
    set_rows_plan(g, b, T, 6, offset=cap)
    b["plan"][L.PLAN_ROW, :6] = torch.tensor([3, -1, 12, 11, 2**30, 0], dtype=torch.int32)
    x = make_x(g, T, W, torch.float16, "sliced")
    ids = torch.arange(11, dtype=torch.int64) + 500  # shorter than T: row 11 has no id
    out = run_all(x, x.t().contiguous().t(), ids, b)
    assert_same(out)
    got = out["triton"]
    assert got["ring_labels"][cap:cap + 6, 2].tolist() == [503, -1, -1, -1, -1, 500]
    assert not got["ring"][cap + 1].any() and not got["ring"][cap + 2].any()
    for bad_offset in (-1, -2**31):
        b["plan_meta"][L.META_OFFSET] = bad_offset
        out = run_all(x, None, ids, b)
        assert_same(out)
        assert torch.equal(bits(out["triton"]["ring"]), bits(b["ring"]))


# ----------------------------------------------------------------------------------------------
# last / mean
# ----------------------------------------------------------------------------------------------

SEG_CASES = [
    (1, torch.float32, False, "contig", torch.int64, 5),
    (5, torch.bfloat16, True, "transposed", torch.int32, 3),
    (37, torch.float16, True, "sliced", torch.int64, 17),
    (130, torch.bfloat16, False, "sliced", torch.int32, 1),
    (130, torch.float32, True, "transposed", None, 2),
]


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_LAST, L.MODE_MEAN])
@pytest.mark.parametrize("W,x_dtype,with_res,layout,ids_dtype,n_seg", SEG_CASES)
def test_segments_random_plan(mode, W, x_dtype, with_res, layout, ids_dtype, n_seg):
    g = torch.Generator().manual_seed(W * 13 + n_seg + mode)
    # short (<= MEAN_SHORT rows) and long segments share a program; an 80-row one needs two chunks
    T, cap, acc_slots = 90, 24, 20
    assert K.MEAN_SHORT < 80 and K.BLOCK_T < 80 <= 2 * K.BLOCK_T
    b = make_bufs(g, cap=cap, W=W, ring_rows=cap, ring_dtype=torch.float32, acc_slots=acc_slots)
    covered = set_segment_plan(g, b, T, mode, n_seg, acc_slots)
    if n_seg == 1:  # one long segment
        b["plan"][:, 0] = torch.tensor([2, 80, 7, 5], dtype=torch.int32)
        covered = set(range(2, 82))
    unread = [t for t in range(T) if t not in covered] if mode == L.MODE_MEAN else []
    x = make_x(g, T, W, x_dtype, layout, fill_nan_rows=unread)
    res = make_x(g, T, W, x_dtype, "transposed") if with_res else None
    ids = make_ids(g, T, ids_dtype)
    out = run_all(x, res, ids, b)
    assert_same(out, approx_acc=mode == L.MODE_MEAN)
    got = out["triton"]
    assert not torch.isnan(got["acc"]).any()
    for k in ("ring", "ring_labels"):
        assert torch.equal(bits(got[k]), bits(b[k]))
    # labels[:, LABEL_POS] is never written by segments
    assert torch.equal(got["acc_labels"][:, L.LABEL_POS], b["acc_labels"][:, L.LABEL_POS])
    if mode == L.MODE_MEAN:  # token labels are untouched by mean
        assert torch.equal(got["acc_labels"][:, L.LABEL_TOKEN], b["acc_labels"][:, L.LABEL_TOKEN])


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_LAST, L.MODE_MEAN])
def test_segments_invalid_entries_are_skipped(mode):
    g = torch.Generator().manual_seed(11 + mode)
    T, W, cap, acc_slots = 20, 5, 8, 6
    b = make_bufs(g, cap=cap, W=W, ring_rows=cap, ring_dtype=torch.float32, acc_slots=acc_slots)
    segs = [(0, 3, 1), (3, 0, 2), (-1, 2, 3), (18, 3, 4), (5, 2, 6), (5, 2, -1), (10, 4, 5), (14, 2, 0)]
    b["plan_meta"][:] = torch.tensor([mode, len(segs), 0, 0])
    for s, (start, cnt, slot) in enumerate(segs):
        b["plan"][:, s] = torch.tensor([start, cnt, slot, 50 + s], dtype=torch.int32)
    out = run_all(make_x(g, T, W, torch.float32, "transposed"), None, make_ids(g, T, torch.int32), b)
    assert_same(out, approx_acc=mode == L.MODE_MEAN)
    touched = {1, 5, 0}
    for slot in range(acc_slots):
        if slot not in touched:
            assert torch.equal(out["triton"]["acc"][slot], b["acc"][slot])
            assert int(out["triton"]["acc_count"][slot]) == int(b["acc_count"][slot])


def _chunked_steps(g, total_rows, n_steps):
    """Split one request's rows into ``n_steps`` consecutive chunks."""
    cuts = sorted(torch.randperm(total_rows - 1, generator=g)[: n_steps - 1].add(1).tolist())
    bounds = [0] + cuts + [total_rows]
    return [(bounds[i], bounds[i + 1]) for i in range(n_steps)]


@pytest.mark.parametrize("use_triton", [pytest.param(True, marks=needs_triton), False])
@pytest.mark.parametrize("storage", ["mean", "last"])
def test_reduction_over_several_steps(use_triton, storage):
    """Chunked prefill then decode: mean over steps == mean over all rows; last == final row.

    Each step has its own padded T, the request's rows sit at a different offset each step, and
    another request shares the batch.
    """
    g = torch.Generator().manual_seed(5 if storage == "mean" else 6)
    W, cap, acc_slots, slot = 37, 16, 4, 2
    mode = L.MODE_MEAN if storage == "mean" else L.MODE_LAST
    total = 53
    full = torch.randn(total, W, generator=g).to(torch.bfloat16)
    full_res = torch.randn(total, W, generator=g).to(torch.bfloat16)
    token_ids = torch.randint(0, 1000, (total,), generator=g)
    plan_meta, plan = L.new_plan_buffers(cap, "cpu")
    site = L.new_site_buffer("cpu")
    ring, ring_labels = L.new_ring_buffers(0, W, torch.float32, "cpu")
    acc, acc_labels, acc_count = L.new_acc_buffers(acc_slots, W, "cpu")
    chunks = _chunked_steps(g, total - 3, 4) + [(total - 3, total - 2), (total - 2, total - 1),
                                                  (total - 1, total)]
    for step, (lo, hi) in enumerate(chunks):
        n = hi - lo
        offset = step % 3  # another request's rows come first
        T = offset + n + 2  # and padding after
        x = torch.randn(W, T, generator=g).to(torch.bfloat16).t()  # non-contiguous
        res = torch.randn(T, W, generator=g).to(torch.bfloat16)
        x[offset:offset + n] = full[lo:hi]
        res[offset:offset + n] = full_res[lo:hi]
        ids = torch.zeros(T + 4, dtype=torch.int64)
        ids[offset:offset + n] = token_ids[lo:hi]
        plan_meta[:] = torch.tensor([mode, 2 if offset else 1, 0, 0])
        plan[:, 0] = torch.tensor([offset, n, slot, 9], dtype=torch.int32)
        if offset:
            plan[:, 1] = torch.tensor([0, offset, 0, 8], dtype=torch.int32)
        K.launch_capture(x, res, ids, plan_meta, plan, site, ring, ring_labels, acc, acc_labels,
                         acc_count, use_triton=use_triton)
    expect_rows = full.float() + full_res.float()
    assert int(acc_count[slot]) == total
    assert int(acc_labels[slot, L.LABEL_REQ]) == 9
    assert int(site[L.SITE_EXECUTIONS]) == len(chunks)
    if storage == "mean":
        torch.testing.assert_close(acc[slot] / acc_count[slot], expect_rows.mean(0), rtol=1e-5, atol=1e-6)
    else:
        assert torch.equal(acc[slot], expect_rows[-1])
        assert int(acc_labels[slot, L.LABEL_TOKEN]) == int(token_ids[-1])


@needs_triton
def test_mean_is_deterministic():
    g = torch.Generator().manual_seed(8)
    T, W = 150, 130
    b = make_bufs(g, cap=16, W=W, ring_rows=16, ring_dtype=torch.float32, acc_slots=4)
    b["plan_meta"][:] = torch.tensor([L.MODE_MEAN, 2, 0, 0])
    b["plan"][:, :2] = torch.tensor([[0, 3], [3, 147], [1, 3], [7, 8]], dtype=torch.int32)
    x = make_x(g, T, W, torch.float16, "transposed")
    results = []
    for _ in range(2):
        bb = clone(b)
        K.launch_capture(x, None, None, *(bb[k] for k in BUFS), use_triton=True)
        results.append(bb["acc"])
    assert torch.equal(bits(results[0]), bits(results[1]))


@needs_triton
def test_mean_short_segments_sum_sequentially():
    """Segments of <= MEAN_SHORT rows are summed row by row: bit-equal to the sequential loop."""
    g = torch.Generator().manual_seed(9)
    T, W, acc_slots = 60, 37, 20
    b = make_bufs(g, cap=32, W=W, ring_rows=32, ring_dtype=torch.float32, acc_slots=acc_slots)
    lens = [1, 16, 5, 1, 1, 9, 2, 16, 1, 3, 1, 1, 1]
    assert max(lens) <= K.MEAN_SHORT and sum(lens) <= T
    b["plan_meta"][:] = torch.tensor([L.MODE_MEAN, len(lens), 0, 0])
    start = 0
    for s, n in enumerate(lens):
        b["plan"][:, s] = torch.tensor([start, n, s + 3, s], dtype=torch.int32)
        start += n
    x = make_x(g, T, W, torch.bfloat16, "sliced")
    res = make_x(g, T, W, torch.bfloat16, "contig")
    out = run_all(x, res, None, b)
    assert torch.equal(bits(out["triton"]["acc"]), bits(out["brute"]["acc"]))
    assert_same(out, approx_acc=True)


# ----------------------------------------------------------------------------------------------
# decode steps: rows read alongside the plan
# ----------------------------------------------------------------------------------------------

def _decode_plan(b, mode):
    """A decode-like step: entry ``e`` at row ``e``, except a few the plan puts elsewhere (a swap,
    a prefill chunk in the same step, a segment ending at its own index). Returns the rows read."""
    if mode == L.MODE_ROWS:
        rows = list(range(30))
        rows[5], rows[6] = 6, 5
        rows[20], rows[25] = 35, 39
        b["plan_meta"][:] = torch.tensor([mode, len(rows), 2, 0])
        for r, row in enumerate(rows):
            b["plan"][:3, r] = torch.tensor([row, 700 + r, 9000 + row], dtype=torch.int32)
        return set(rows)
    segs = [(s, 1) for s in range(20)]
    segs[3] = (30, 6)    # a prefill chunk
    segs[7] = (36, 1)
    segs[8] = (7, 2)     # ends at row 8: its last row is its own index, its first is not
    b["plan_meta"][:] = torch.tensor([mode, len(segs), 0, 0])
    for s, (start, cnt) in enumerate(segs):
        b["plan"][:, s] = torch.tensor([start, cnt, (s * 7) % 20, 100 + s], dtype=torch.int32)
    if mode == L.MODE_LAST:
        return {start + cnt - 1 for start, cnt in segs}
    return {t for start, cnt in segs for t in range(start, start + cnt)}


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN])
def test_decode_rows_read_with_the_plan(mode, monkeypatch):
    """At most ``SPEC_ROWS`` tokens, the kernel reads row ``e`` beside plan entry ``e`` and uses
    it where the plan agrees. Rows no entry reads are NaN, so a row taken for the wrong entry
    shows; the result is bit-equal to brute force and to the kernel with that read off."""
    capture = sys.modules["vllm_capture.kernels.capture"]
    g = torch.Generator().manual_seed(50 + mode)
    T, W, acc_slots = 40, 130, 20
    assert T <= capture.SPEC_ROWS
    b = make_bufs(g, cap=32, W=W, ring_rows=40, ring_dtype=torch.bfloat16, acc_slots=acc_slots)
    read = _decode_plan(b, mode)
    unread = [t for t in range(T) if t not in read]
    x = make_x(g, T, W, torch.bfloat16, "sliced", fill_nan_rows=unread)
    res = make_x(g, T, W, torch.bfloat16, "contig", fill_nan_rows=unread)
    ids = make_ids(g, T, torch.int64)
    out = run_all(x, res, ids, b)
    assert_same(out, approx_acc=mode == L.MODE_MEAN)
    # short segments sum row by row, as brute force does
    assert torch.equal(bits(out["triton"]["acc"]), bits(out["brute"]["acc"]))
    assert not torch.isnan(out["triton"]["acc"]).any()
    assert not torch.isnan(out["triton"]["ring"].float()).any()
    for spec_rows in (0, T - 1):
        monkeypatch.setattr(capture, "SPEC_ROWS", spec_rows)
        bb = clone(b)
        K.launch_capture(x, res, ids, *(bb[k] for k in BUFS), use_triton=True)
        for k in BUFS:
            assert torch.equal(bits(bb[k]), bits(out["triton"][k])), (spec_rows, k)


# ----------------------------------------------------------------------------------------------
# no-op paths, counter, edge sizes
# ----------------------------------------------------------------------------------------------

@needs_triton
@pytest.mark.parametrize("mode,enabled", [(L.MODE_OFF, True), (L.MODE_OFF, False), (L.MODE_ROWS, False),
                                          (L.MODE_LAST, False), (L.MODE_MEAN, False)])
def test_off_and_disabled_only_count(mode, enabled):
    g = torch.Generator().manual_seed(mode)
    T, W, cap = 20, 37, 8
    b = make_bufs(g, cap=cap, W=W, ring_rows=2 * cap, ring_dtype=torch.float16, acc_slots=4,
                  enabled=enabled)
    if mode in (L.MODE_OFF, L.MODE_ROWS):
        set_rows_plan(g, b, T, 5, offset=0)
    else:
        set_segment_plan(g, b, T, mode, 3, 4)
    b["plan_meta"][L.META_MODE] = mode
    out = run_all(make_x(g, T, W, torch.float32, "contig"), None, make_ids(g, T, torch.int64), b)
    assert_same(out)
    for name, got in out.items():
        assert int(got["site"][L.SITE_EXECUTIONS]) == 42, name
        for k in BUFS:
            if k != "site":
                assert torch.equal(bits(got[k]), bits(b[k])), (name, k)


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN])
def test_empty_plan(mode):
    g = torch.Generator().manual_seed(20 + mode)
    T, W = 9, 5
    b = make_bufs(g, cap=8, W=W, ring_rows=16, ring_dtype=torch.bfloat16, acc_slots=3)
    b["plan_meta"][:] = torch.tensor([mode, 0, 1, 0])
    out = run_all(make_x(g, T, W, torch.float16, "transposed"), None, make_ids(g, T, torch.int32), b)
    assert_same(out)
    for k in BUFS:
        if k != "site":
            assert torch.equal(bits(out["triton"][k]), bits(b[k])), k


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_OFF, L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN])
def test_zero_tokens(mode):
    """T == 0: the grid is still one program, so the counter moves; nothing is read or written."""
    g = torch.Generator().manual_seed(30 + mode)
    W = 37
    b = make_bufs(g, cap=8, W=W, ring_rows=16, ring_dtype=torch.float32, acc_slots=3)
    b["plan_meta"][:] = torch.tensor([mode, 3, 0, 0])
    b["plan"][:, :3] = torch.tensor([[0, 0, 0], [1, 1, 1], [0, 1, 2], [0, 0, 0]], dtype=torch.int32)
    x = torch.empty(0, W, dtype=torch.float16)
    out = run_all(x, torch.empty(0, W, dtype=torch.float16), torch.empty(0, dtype=torch.int64), b)
    assert_same(out)
    assert int(out["triton"]["site"][L.SITE_EXECUTIONS]) == 42
    assert K.capture_grid(0, W, 8) == (1, 1)


@needs_triton
def test_counter_exactly_once_per_launch_many_programs():
    """Grids of several programs in both axes still bump the counter by exactly 1 per launch."""
    g = torch.Generator().manual_seed(40)
    W, cap = 130, 40
    b = make_bufs(g, cap=cap, W=W, ring_rows=cap, ring_dtype=torch.float16, acc_slots=1)
    b["site"][L.SITE_EXECUTIONS] = 0
    launches = 0
    for T, mode in [(37, L.MODE_ROWS), (40, L.MODE_OFF), (1, L.MODE_ROWS), (33, L.MODE_MEAN), (17, L.MODE_LAST)]:
        grid = K.capture_grid(T, W, cap)
        assert grid[1] == -(-W // K.BLOCK_W) > 1 and (T < K.BLOCK_R or grid[0] > 1)
        b["plan_meta"][:] = torch.tensor([mode, 0, 0, 0])
        x = make_x(g, T, W, torch.float32, "contig")
        K.launch_capture(x, None, None, *(b[k] for k in BUFS), use_triton=True)
        launches += 1
        assert int(b["site"][L.SITE_EXECUTIONS]) == launches
    b["site"][L.SITE_ENABLED] = 0
    K.launch_capture(x, None, None, *(b[k] for k in BUFS), use_triton=True)
    assert int(b["site"][L.SITE_EXECUTIONS]) == launches + 1


def test_eager_grid_covers_the_plan_entries_only():
    """An eager launch's grid rows cover the step's plan count (at least one program, for the
    counter), never more than the padded tokens or the plan's capacity allow."""
    W = 130
    assert K.capture_grid(16384, W, 16384) == (1024, 3)
    assert K.capture_grid(16384, W, 16384, entries=256) == (16, 3)
    assert K.capture_grid(16384, W, 16384, entries=257) == (17, 3)
    assert K.capture_grid(16384, W, 16384, entries=0) == (1, 3)
    assert K.capture_grid(16384, W, 16384, entries=-1) == (1, 3)
    assert K.capture_grid(40, W, 16384, entries=256) == K.capture_grid(40, W, 16384)
    assert K.capture_grid(16384, W, 100, entries=256) == K.capture_grid(16384, W, 100)


@needs_triton
@pytest.mark.parametrize("mode", [L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN])
def test_eager_grid_captures_what_the_full_grid_does(mode):
    """Plans whose entries reach past the first program rows, launched with the grid the plan's
    count gives and with the full one: the same buffers, bit for bit (the kernel reads the count
    on the device either way), and the counter moves once per launch."""
    g = torch.Generator().manual_seed(50 + mode)
    T, W, cap, slots = 150, 70, 160, 40
    b = make_bufs(g, cap=cap, W=W, ring_rows=2 * cap, ring_dtype=torch.bfloat16, acc_slots=slots)
    if mode == L.MODE_ROWS:
        n = 37
        rows = torch.randperm(T, generator=g)[:n].to(torch.int32)
        b["plan_meta"][:] = torch.tensor([mode, n, 5, 0])
        b["plan"][:, :n] = torch.stack([rows, torch.arange(n, dtype=torch.int32) % 7,
                                        rows + 1000, torch.zeros(n, dtype=torch.int32)])
    else:
        n = 33
        set_segment_plan(g, b, T, mode, n, slots)
    x = make_x(g, T, W, torch.bfloat16, "sliced")
    res = make_x(g, T, W, torch.bfloat16, "contig")
    ids = make_ids(g, T, torch.int64)
    assert K.capture_grid(T, W, cap, entries=n)[0] < K.capture_grid(T, W, cap)[0]
    out = run_all(x, res, ids, b)
    assert_same(out, approx_acc=mode == L.MODE_MEAN)
    for name in ("triton", "triton_eager"):
        assert int(out[name]["site"][L.SITE_EXECUTIONS]) == int(b["site"][L.SITE_EXECUTIONS]) + 1
    for k in BUFS:
        assert torch.equal(bits(out["triton_eager"][k]), bits(out["triton"][k])), k


def test_triton_is_installed_so_the_kernel_tests_run():
    """The kernel tests skip without Triton; on CI (torch brings Triton) a skip would hide them."""
    assert K.HAVE_TRITON


@needs_triton
def test_nan_stays_nan_in_bf16_and_fp16_rings():
    """Quiet, signalling, negative and all-ones-mantissa NaNs: rounding by hand must not carry a
    NaN's mantissa into the exponent (an inf) or drop it (a zero)."""
    words = [0x7FC00000, 0x7F800001, 0xFFC00000, 0x7FFFFFFF, 0xFF800001]
    vals = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32).view(torch.float32)
    T = vals.numel()
    for ring_dtype in (torch.bfloat16, torch.float16):
        b = make_bufs(torch.Generator().manual_seed(0), cap=T, W=1, ring_rows=T,
                      ring_dtype=ring_dtype, acc_slots=1)
        b["plan_meta"][:] = torch.tensor([L.MODE_ROWS, T, 0, 0])
        b["plan"][L.PLAN_ROW] = torch.arange(T, dtype=torch.int32)
        out = run_all(vals.view(T, 1), None, None, b)
        for name, got in out.items():
            assert torch.isnan(got["ring"][:, 0].float()).all(), f"{name} {ring_dtype}"


@needs_triton
def test_bf16_and_fp16_rounding_edges_match_torch():
    """Round-half-even ties, overflow to inf, subnormals, +-0, inf: bitwise equal to torch's cast.

    (Triton's interpreter truncates in ``.to(tl.bfloat16)``; the kernel rounds by hand.)
    """
    words = [0x3F800000, 0x3F808000, 0x3F818000, 0x3F80C000, 0x3F807FFF, 0xBF808000, 0x7F7FFFFF,
             0x7F7F8000, 0x00008000, 0x00018000, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000,
             0x3F8FFFFF, 0x477FF000, 0x387FC000, 0x33800000]
    vals = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                        dtype=torch.int32).view(torch.float32)
    T = vals.numel()
    x = vals.view(T, 1)
    for ring_dtype in (torch.bfloat16, torch.float16):
        b = make_bufs(torch.Generator().manual_seed(0), cap=T, W=1, ring_rows=T, ring_dtype=ring_dtype,
                      acc_slots=1)
        b["plan_meta"][:] = torch.tensor([L.MODE_ROWS, T, 0, 0])
        b["plan"][L.PLAN_ROW] = torch.arange(T, dtype=torch.int32)
        out = run_all(x, None, None, b)
        assert_same(out)
        assert torch.equal(bits(out["triton"]["ring"][:, 0]), bits(vals.to(ring_dtype)))


# ----------------------------------------------------------------------------------------------
# the torch reference alone (fast): property test against brute force, both reference forms
# ----------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    mode=st.sampled_from([L.MODE_OFF, L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN]),
    T=st.integers(0, 33),
    W=st.sampled_from([1, 5, 37, 130]),
    cap=st.integers(1, 20),
    x_dtype=st.sampled_from(FLOATS),
    ring_dtype=st.sampled_from(FLOATS),
    layout=st.sampled_from(["contig", "transposed", "sliced"]),
    with_res=st.booleans(),
    ids_dtype=st.sampled_from([torch.int32, torch.int64, None]),
    enabled=st.booleans(),
    frac=st.floats(0.0, 1.0),
)
def test_reference_matches_brute_force(seed, mode, T, W, cap, x_dtype, ring_dtype, layout, with_res,
                                       ids_dtype, enabled, frac):
    g = torch.Generator().manual_seed(seed)
    acc_slots = 24
    ring_rows = 1 + seed % (2 * cap)
    b = make_bufs(g, cap=cap, W=W, ring_rows=ring_rows, ring_dtype=ring_dtype, acc_slots=acc_slots,
                  enabled=enabled)
    if mode in (L.MODE_OFF, L.MODE_ROWS):
        # Offsets from before the ring (nothing written) to past its end (rows cut at the end).
        set_rows_plan(g, b, T, round(frac * min(T, cap)), offset=seed % (ring_rows + 3) - 1,
                      shuffle=seed % 3 == 0, step=seed % 4 if seed % 5 else 0)
        b["plan_meta"][L.META_MODE] = mode
    else:
        set_segment_plan(g, b, T, mode, round(frac * min(T // 2, cap, acc_slots)), acc_slots)
    x = make_x(g, T, W, x_dtype, layout)
    res = make_x(g, T, W, x_dtype, "contig") if with_res else None
    out = run_all(x, res, make_ids(g, T, ids_dtype), b, triton=False)
    assert_same(out, approx_acc=mode == L.MODE_MEAN)


# ----------------------------------------------------------------------------------------------
# launcher plumbing
# ----------------------------------------------------------------------------------------------

def test_launch_checks_layout():
    g = torch.Generator().manual_seed(0)
    b = make_bufs(g, cap=4, W=5, ring_rows=4, ring_dtype=torch.float32, acc_slots=1)
    x = torch.zeros(3, 5)
    K.launch_capture(x, None, None, *(b[k] for k in BUFS), use_triton=False)
    # Each bad buffer, and the start of the message that names it.
    bad = [
        (dict(ring=torch.zeros(4, 6)), "ring width 6 != W 5"),
        (dict(ring=torch.zeros(1, 4, 5)), "ring must be [ring_rows, W], got (1, 4, 5)"),
        (dict(plan=torch.zeros(3, 4, dtype=torch.int32)), "plan shape (3, 4)"),
        (dict(acc=torch.zeros(1, 5, dtype=torch.float16)), "acc must be fp32"),
        (dict(ring_labels=torch.zeros(4, 2, dtype=torch.int32)), "ring_labels shape (4, 2)"),
        (dict(site=torch.zeros(2, dtype=torch.int64)), "site must be int32, got torch.int64"),
        (dict(plan=torch.zeros(4, 8, dtype=torch.int32)[:, ::2]), "plan must be entry-major"),
        # field-major: the kernel reads entry-major
        (dict(plan=torch.zeros(4, 4, dtype=torch.int32)), "plan must be entry-major"),
    ]
    for override, message in bad:
        bb = dict(b, **override)
        with pytest.raises(ValueError, match=re.escape(f"launch_capture: {message}")):
            K.launch_capture(x, None, None, *(bb[k] for k in BUFS), use_triton=False)
    with pytest.raises(ValueError, match=re.escape("residual (3, 4) != x (3, 5)")):
        K.launch_capture(x, torch.zeros(3, 4), None, *(b[k] for k in BUFS))
    with pytest.raises(ValueError, match=re.escape("x must be 2-D [T, W], got (3, 5, 1)")):
        K.launch_capture(torch.zeros(3, 5, 1), None, None, *(b[k] for k in BUFS))


def test_dummy_buffers_for_unused_kind():
    """A rows-only site may pass 0-slot accumulators (and a segments-only site a 0-slot ring)."""
    g = torch.Generator().manual_seed(1)
    W = 5
    for mode in (L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN):
        x = torch.randn(3, W, generator=g)
        for use_triton in ([False, True] if K.HAVE_TRITON else [False]):
            plan_meta, plan = L.new_plan_buffers(4, "cpu")
            plan_meta[:] = torch.tensor([mode, 1, 0, 0])
            plan[:, 0] = torch.tensor([0, 1, 0, 0], dtype=torch.int32)
            site = L.new_site_buffer("cpu")
            ring, ring_labels = L.new_ring_buffers(4 * int(mode == L.MODE_ROWS), W, torch.float32, "cpu")
            acc, acc_labels, acc_count = L.new_acc_buffers(int(mode != L.MODE_ROWS), W, "cpu")
            K.launch_capture(x, None, None, plan_meta, plan, site, ring, ring_labels, acc, acc_labels,
                             acc_count, use_triton=use_triton)
            assert int(site[L.SITE_EXECUTIONS]) == 1
            assert torch.equal((ring[0] if mode == L.MODE_ROWS else acc[0]), x[0])


def test_warmup_is_noop_off_cuda():
    assert K.warmup("cpu", [torch.bfloat16]) == 0


@needs_triton
def test_compile_variants_compiles_what_the_engine_launches(monkeypatch):
    """The compile process passes dtypes where launches pass buffers: argument for argument it
    must name the variant a real launch of an engine's site uses (its dtypes, residual or not,
    unit column stride, the tile), or graph capture would compile it again."""
    capture = sys.modules["vllm_capture.kernels.capture"]
    calls = {"warmup": [], "launch": []}

    class Recorder:
        def warmup(self, *args, grid, **kwargs):
            calls["warmup"].append((args, kwargs))

        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls["launch"].append((args, kwargs))

    monkeypatch.setattr(capture, "capture_site_kernel", Recorder())
    assert K.compile_variants([torch.bfloat16], ids_dtypes=(torch.int64,)) == 2
    g = torch.Generator().manual_seed(0)
    b = make_bufs(g, cap=8, W=70, ring_rows=16, ring_dtype=torch.bfloat16, acc_slots=4)
    x = make_x(g, 8, 70, torch.bfloat16, "sliced")  # a view with row stride, unit column stride
    ids = make_ids(g, 8, torch.int64)
    for res in (None, make_x(g, 8, 70, torch.bfloat16, "contig")):
        K.launch_capture(x, res, ids, *(b[k] for k in BUFS), use_triton=True)
    assert len(calls["launch"]) == 2
    for (wargs, wkw), (largs, lkw) in zip(calls["warmup"], calls["launch"]):
        assert wkw == lkw
        assert len(wargs) == len(largs)
        for w, a in zip(wargs, largs):
            if isinstance(a, torch.Tensor):
                assert w == a.dtype
            else:
                assert type(w) is type(a) is int


@needs_triton
def test_bound_launch_passes_what_the_jit_passes():
    """``launch_kernel`` calls a compiled kernel's launcher with every parameter in the kernel's
    order, as Triton's JIT does: ``kernel_arguments``' run-time arguments, then
    ``CONSTEXPR_PARAMS``; ``bound_key`` reads the aligned pointers and the sizes by position."""
    capture = sys.modules["vllm_capture.kernels.capture"]
    names = list(inspect.signature(capture.capture_site_kernel.fn).parameters)
    g = torch.Generator().manual_seed(0)
    b = make_bufs(g, cap=8, W=70, ring_rows=16, ring_dtype=torch.bfloat16, acc_slots=4)
    x = make_x(g, 8, 70, torch.bfloat16, "contig")
    _, args, constexprs = capture.kernel_arguments(x, x, make_ids(g, 8, torch.int32),
                                                   *(b[k] for k in BUFS))
    assert names[len(args):] == list(capture.CONSTEXPR_PARAMS)
    assert sorted(set(constexprs) - {"num_warps"}) == sorted(capture.CONSTEXPR_PARAMS)
    assert [names[i] for i in capture._INT_ARGS] == capture._SIZE_ARGS
    assert all(type(args[i]) is int for i in capture._INT_ARGS)
    pointers = names[:capture._INT_ARGS.start]
    assert all(isinstance(a, torch.Tensor) for a in args[:len(pointers)])
    assert [names[i] for i in capture._ALIGNED_ARGS] == [
        n for n in pointers if n not in capture._UNALIGNED_ARGS]


@needs_triton
def test_bound_key_separates_what_triton_specializes_on():
    """Launches that Triton compiles apart get different keys (dtypes, residual, a static buffer's
    alignment); launches it does not tell apart share one (the token count, an activation view's
    offset, no token ids); a size past int32 is never bound."""
    capture = sys.modules["vllm_capture.kernels.capture"]
    g = torch.Generator().manual_seed(0)
    W = 5
    b = make_bufs(g, cap=8, W=W, ring_rows=16, ring_dtype=torch.float32, acc_slots=4)
    x = make_x(g, 8, W, torch.bfloat16, "contig")
    ids = make_ids(g, 8, torch.int32)

    def key(x=x, residual=None, ids=ids, **override):
        bb = dict(b, **override)
        _, args, constexprs = capture.kernel_arguments(x, residual, ids, *(bb[k] for k in BUFS))
        return capture.bound_key(args, constexprs, 0)

    base = key()
    differ = {
        "x dtype": key(x=x.to(torch.float16)),
        "residual": key(residual=x),
        "ids dtype": key(ids=ids.to(torch.int64)),
        "ring dtype": key(ring=b["ring"].to(torch.float16)),
        "ring alignment": key(ring=torch.zeros(17, W)[1:]),
        "acc alignment": key(acc=torch.zeros(5, W)[1:]),
    }
    for what, k in differ.items():
        assert k != base, what
    assert key(x=make_x(g, 64, W, torch.bfloat16, "contig")) == base  # T is not specialized
    assert key(x=torch.zeros(9, W, dtype=torch.bfloat16)[1:]) == base  # nor x's alignment
    assert key(ids=None) == base  # an int32 stand-in, never read
    _, args, constexprs = capture.kernel_arguments(x, None, ids, *(b[k] for k in BUFS))
    stride = capture._INT_ARGS.start + capture._SIZE_ARGS.index("stride_xt")
    wide = args[:stride] + (2**31,) + args[stride + 1:]
    assert capture.bound_key(wide, constexprs, 0) is None
    assert capture.bound_key(args, constexprs, 1) != capture.bound_key(args, constexprs, 0)


@needs_triton
def test_launch_hooks_are_read_as_inductor_reads_them():
    """A launch hook (a profiler's) must see every launch, so a hook keeps launches on the JIT:
    an empty chain or None is no hook; a chain with a call, or a plain function, is one."""
    import triton

    capture = sys.modules["vllm_capture.kernels.capture"]
    chain = triton.knobs.HookChain()
    assert capture.hook_is_empty(None) and capture.hook_is_empty(chain)
    chain.add(print)
    assert not capture.hook_is_empty(chain)
    assert not capture.hook_is_empty(print)


def test_layout_constants():
    assert (L.META_MODE, L.META_COUNT, L.META_OFFSET, L.META_STEP, L.META_FIELDS) == (0, 1, 2, 3, 4)
    assert (L.MODE_OFF, L.MODE_ROWS, L.MODE_LAST, L.MODE_MEAN) == (0, 1, 2, 3)
    assert (L.PLAN_ROW, L.PLAN_REQ, L.PLAN_POS, L.PLAN_FIELDS) == (0, 1, 2, 4)
    assert (L.PLAN_SEG_START, L.PLAN_SEG_COUNT, L.PLAN_SEG_SLOT, L.PLAN_SEG_REQ) == (0, 1, 2, 3)
    assert (L.SITE_EXECUTIONS, L.SITE_ENABLED, L.SITE_FIELDS) == (0, 1, 2)
    assert (L.LABEL_REQ, L.LABEL_POS, L.LABEL_TOKEN, L.LABEL_FIELDS) == (0, 1, 2, 3)
