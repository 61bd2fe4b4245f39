"""Last rows stored by traced torch ops (capture_graph/last_rows.py): where each token goes, and
that the stored row is the capture kernel's ``MODE_LAST`` row in the site's dtype, bit for bit."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_capture.capture_graph.last_rows import SINK_ROWS, LastRowPlan, store_last_rows
from vllm_capture.kernels import layout as L
from vllm_capture.kernels.accumulate import accumulate_reference

TOKENS, SLOTS = 200, 6


@st.composite
def segment_plans(draw, tokens=TOKENS, slots=SLOTS):
    """One step's segments as plan_segments makes them: disjoint row ranges in row order, one
    per request, each with a slot of its own; now and then an invalid one (no rows, a slot out of
    range), which the kernel skips."""
    n = draw(st.integers(0, slots))
    cuts = sorted(draw(st.lists(st.integers(0, tokens), min_size=2 * n, max_size=2 * n)))
    starts, counts = np.array(cuts[0::2], dtype=np.int64), np.diff(cuts)[0::2].astype(np.int64)
    chosen = draw(st.permutations(range(slots)))[:n]
    slot = np.array(chosen, dtype=np.int64)
    if n and draw(st.booleans()):
        slot[draw(st.integers(0, n - 1))] = draw(st.sampled_from([-1, slots, slots + 3]))
    return starts, counts, slot


def brute_force_dest(tokens, slots, starts, counts, slot):
    dest = [slots + t % SINK_ROWS for t in range(tokens)]
    for start, count, s in zip(starts, counts, slot):
        if count > 0 and 0 <= s < slots:
            dest[start + count - 1] = s
    return dest


@settings(max_examples=60, deadline=None)
@given(plans=st.lists(segment_plans(), min_size=1, max_size=5))
def test_dest_sends_each_segments_last_row_to_its_slot_and_the_rest_to_sinks(plans):
    plan = LastRowPlan.allocate(TOKENS, SLOTS, torch.device("cpu"))
    assert plan.dest.tolist() == brute_force_dest(TOKENS, SLOTS, [], [], [])
    for starts, counts, slot in plans:
        uploads = plan.uploads
        same = brute_force_dest(TOKENS, SLOTS, starts, counts, slot) == plan.dest.tolist()
        plan.point(starts, counts, slot)
        assert plan.dest.tolist() == brute_force_dest(TOKENS, SLOTS, starts, counts, slot)
        if same:
            assert plan.uploads == uploads  # a step that repeats the last plan copies nothing
        plan.point(starts, counts, slot)
        assert plan.uploads <= uploads + 1
    plan.clear()
    assert plan.dest.tolist() == brute_force_dest(TOKENS, SLOTS, [], [], [])


def test_a_last_row_past_dest_is_refused():
    plan = LastRowPlan.allocate(8, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="outside the 8 tokens"):
        plan.point(np.array([5]), np.array([4]), np.array([0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@settings(max_examples=25, deadline=None)
@given(segments=segment_plans(tokens=40, slots=5), width=st.integers(1, 70),
       seed=st.integers(0, 2**31 - 1))
def test_a_stored_row_is_the_kernels_last_row_in_the_sites_dtype(dtype, with_residual, segments,
                                                                  width, seed):
    """Against the capture kernel's torch reference (``MODE_LAST`` into fp32, then the cast a
    read makes), on a column-strided activation as Inductor may hand over."""
    starts, counts, slot = segments
    gen = torch.Generator().manual_seed(seed)
    tokens = 40
    base = (torch.randn(tokens, 2 * width, generator=gen) * 100).to(dtype)
    hidden = base[:, ::2]
    residual = ((torch.randn(tokens, width, generator=gen) * 100).to(dtype) if with_residual
                else None)
    plan = LastRowPlan.allocate(tokens, 5, torch.device("cpu"))
    plan.point(starts, counts, slot)
    rows = plan.rows_for(width, dtype)
    store_last_rows(rows, plan.dest, hidden, residual)

    meta, kernel_plan = L.new_plan_buffers(8, "cpu")
    meta[L.META_MODE], meta[L.META_COUNT] = L.MODE_LAST, len(starts)
    for field, values in ((L.PLAN_SEG_START, starts), (L.PLAN_SEG_COUNT, counts),
                          (L.PLAN_SEG_SLOT, slot), (L.PLAN_SEG_REQ, np.zeros_like(slot))):
        kernel_plan[field, :len(values)] = torch.from_numpy(values.astype(np.int32))
    acc, acc_labels, acc_count = L.new_acc_buffers(5, width, "cpu")
    accumulate_reference(hidden, residual, None, meta, kernel_plan, acc, acc_labels, acc_count)
    written = acc_count > 0
    assert written.sum() == sum(1 for c, s in zip(counts, slot) if c > 0 and 0 <= s < 5)
    assert torch.equal(rows[:5][written], acc[written].to(dtype))
    assert not rows[:5][~written].any()
