"""Row planner: examples, input checks, and a randomized scheduler checked against a brute-force
reference written from the SelectSpec definition (not from the planner's code)."""

import time
import warnings
from dataclasses import dataclass, field, replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.select_reference import selected as reference_selected
from tests.test_selection_spec import VOCAB, select_specs
from vllm_capture.selection import (
    BatchGeometry,
    DecodeRepeat,
    RequestTrack,
    SelectSpec,
    Skipped,
    StepBuffers,
    TokenCondition,
    plan_rows,
    plan_segments,
)


def geometry(rows_per_req: dict, num_computed=None, pad=0, tokens=None) -> BatchGeometry:
    req_ids = tuple(rows_per_req)
    counts = list(rows_per_req.values())
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    total = int(qsl[-1])
    return BatchGeometry(
        req_ids=req_ids,
        query_start_loc=qsl,
        num_computed=np.asarray(num_computed or [0] * len(req_ids), dtype=np.int64),
        num_rows_padded=total + pad,
        token_ids=np.asarray(tokens if tokens is not None else np.arange(total), dtype=np.int32),
    )


# ---- examples ---------------------------------------------------------------------------------


def test_mixed_batch_with_padding_and_an_untracked_request():
    # "a" decodes (prompt 4, position 6 = generation step 2), "b" is untracked, "c" prefills 3 of
    # its 5 prompt tokens; two padding rows follow.
    geo = geometry({"a": 1, "b": 2, "c": 3}, num_computed=[6, 0, 0], pad=2)
    tracks = {
        "a": RequestTrack(req_index=7, prompt_len=4),
        "c": RequestTrack(req_index=9, prompt_len=5),
    }
    plan = plan_rows(geo, tracks, row_limit=100)
    assert plan.rows.tolist() == [0, 3, 4, 5]
    assert plan.req_index.tolist() == [7, 9, 9, 9]
    assert plan.positions.tolist() == [6, 0, 1, 2]
    assert plan.condition.tolist() == [-1] * 4 and plan.conditions == [] and plan.dropped == 0
    arrays = (plan.rows, plan.req_index, plan.positions, plan.condition)
    assert all(a.dtype == np.int32 for a in arrays)
    assert tracks["a"].next_position == 7 and tracks["c"].next_position == 3


def test_chunked_prefill_resolves_negative_positions_against_the_whole_prompt():
    spec = SelectSpec(prompt_positions=[-1, 1])
    track = RequestTrack(req_index=0, prompt_len=5, select=spec)
    first = plan_rows(geometry({"r": 3}, num_computed=[0]), {"r": track}, 10)
    second = plan_rows(geometry({"r": 2}, num_computed=[3]), {"r": track}, 10)
    assert first.positions.tolist() == [1]
    assert second.positions.tolist() == [4] and second.rows.tolist() == [1]


def test_preemption_recompute_is_not_captured_twice():
    track = RequestTrack(req_index=0, prompt_len=3, select=SelectSpec.all())
    assert plan_rows(geometry({"r": 3}), {"r": track}, 10).positions.tolist() == [0, 1, 2]
    assert plan_rows(geometry({"r": 1}, [3]), {"r": track}, 10).positions.tolist() == [3]
    # Preempted: prompt + the two sampled tokens are recomputed from position 0.
    again = plan_rows(geometry({"r": 5}), {"r": track}, 10)
    assert again.positions.tolist() == [4] and again.rows.tolist() == [4]
    assert track.next_position == 5
    assert again.skipped == ()


def test_a_step_past_the_high_water_mark_reports_the_positions_between():
    # "a" computed 0-2, then resumes at 6 (a prefix-cache hit); "b" is new and starts at 2 (one
    # too); "c" recomputes from 0 after preemption; "d" is not tracked.
    tracks = {r: RequestTrack(req_index=i, prompt_len=8) for i, r in enumerate("abc")}
    tracks["a"].next_position = 3
    tracks["c"].next_position = 4
    geo = geometry({"a": 2, "b": 1, "c": 5, "d": 1}, num_computed=[6, 2, 0, 5])
    plan = plan_rows(geo, tracks, 10)
    assert plan.skipped == (Skipped("a", 3, 6), Skipped("b", 0, 2))
    assert plan.positions.tolist() == [6, 7, 2, 4]
    assert [tracks[r].next_position for r in "abc"] == [8, 3, 5]


def test_unknown_decode_tokens_get_shared_conditions():
    spec = SelectSpec(
        generation_tokens=[3], generation_positions=[0], exclude_generation_tokens=[2]
    )
    tracks = {r: RequestTrack(req_index=i, prompt_len=2, select=spec) for i, r in enumerate("abcd")}
    # Decode steps 0, 1, 1, 0: step 0 is included by position, step 1 only by token.
    geo = geometry({r: 1 for r in "abcd"}, num_computed=[2, 3, 3, 2], tokens=[-1, -1, 3, -1])
    plan = plan_rows(geo, tracks, 10)
    assert plan.rows.tolist() == [0, 1, 2, 3]
    by_position = TokenCondition(include=None, exclude=frozenset({2}))
    by_token = TokenCondition(include=frozenset({3}), exclude=frozenset({2}))
    assert sorted(map(repr, plan.conditions)) == sorted(map(repr, [by_position, by_token]))
    resolved = [plan.conditions[c] if c >= 0 else None for c in plan.condition.tolist()]
    assert resolved == [by_position, by_token, None, by_position]


def test_row_limit_keeps_the_lowest_rows_and_counts_the_rest():
    tracks = {r: RequestTrack(req_index=i, prompt_len=3) for i, r in enumerate("ab")}
    plan = plan_rows(geometry({"a": 3, "b": 3}), tracks, row_limit=4)
    assert plan.rows.tolist() == [0, 1, 2, 3] and plan.dropped == 2
    assert tracks["b"].next_position == 3  # advanced past the cut rows too
    nothing = plan_rows(geometry({"a": 1, "b": 1}, [3, 3]), tracks, row_limit=0)
    assert nothing.rows.size == 0 and nothing.dropped == 2
    assert tracks["a"].next_position == 4


def test_conditions_cut_by_the_row_limit_are_dropped_from_the_list():
    spec = SelectSpec(generation_tokens=[1])
    tracks = {
        "a": RequestTrack(0, 2, select=SelectSpec.all()),
        "b": RequestTrack(1, 2, select=spec),
    }
    plan = plan_rows(geometry({"a": 1, "b": 1}, [2, 2], tokens=[-1, -1]), tracks, 1)
    assert plan.rows.tolist() == [0] and plan.condition.tolist() == [-1]
    assert plan.conditions == [] and plan.dropped == 1


def test_host_prompt_ids_beat_unknown_geometry_tokens():
    spec = SelectSpec(prompt_tokens=[5])
    with_ids = RequestTrack(req_index=0, prompt_len=3, prompt_token_ids=(5, 6, 5), select=spec)
    without = RequestTrack(req_index=1, prompt_len=3, select=spec)
    geo = geometry({"a": 3, "b": 3}, tokens=[-1, -1, -1, 5, -1, 6])
    plan = plan_rows(geo, {"a": with_ids, "b": without}, 10)
    assert plan.rows.tolist() == [0, 2, 3, 4]
    assert plan.condition.tolist()[:3] == [-1, -1, -1]
    assert plan.conditions[plan.condition[3]] == TokenCondition(frozenset({5}), frozenset())


def test_empty_steps():
    empty = geometry({}, pad=4)
    assert plan_rows(empty, {}, 10).rows.size == 0
    assert plan_segments(empty, {}, {}).slot.size == 0
    track = RequestTrack(req_index=0, prompt_len=2)
    assert plan_rows(geometry({"other": 2}), {"r": track}, 10).rows.size == 0
    assert track.next_position == 0


def test_segments_example():
    tracks = {r: RequestTrack(req_index=i, prompt_len=4) for i, r in enumerate("abc")}
    tracks["b"].next_position = 6  # recomputing after preemption: only position 6 is new
    geo = geometry({"a": 4, "b": 7, "c": 1}, num_computed=[0, 0, 9], pad=3)
    plan = plan_segments(geo, tracks, {"a": 2, "b": 0, "c": 5})
    assert plan.slot.tolist() == [2, 0, 5]
    assert plan.row_start.tolist() == [0, 10, 11]
    assert plan.row_count.tolist() == [4, 1, 1]
    assert plan.last_position.tolist() == [3, 6, 9]
    assert [tracks[r].next_position for r in "abc"] == [4, 7, 10]
    assert plan.skipped == (Skipped("c", 0, 9),)  # its first 9 positions came from the cache


def test_segments_reject_clauses_and_missing_slots():
    with pytest.raises(ValueError, match="select"):
        tracks = {"a": RequestTrack(0, 2, select=SelectSpec.all())}
        plan_segments(geometry({"a": 1}), tracks, {"a": 0})
    with pytest.raises(ValueError, match="'a'"):
        plan_segments(geometry({"a": 1}), {"a": RequestTrack(0, 2)}, {})


def test_token_condition():
    by_position = TokenCondition(include=None, exclude=frozenset({2}))
    by_token = TokenCondition(include=frozenset({3, 4}), exclude=frozenset({4}))
    assert [by_position.accepts(t) for t in (1, 2, 3)] == [True, False, True]
    assert [by_token.accepts(t) for t in (2, 3, 4)] == [False, True, False]
    assert by_token.accepts_array(np.array([2, 3, 4])).tolist() == [False, True, False]
    assert by_position.accepts_array(np.array([1, 2])).tolist() == [True, False]


# ---- input checks -----------------------------------------------------------------------------


def _geometry_fields(**override):
    fields = dict(
        req_ids=("a", "b"),
        query_start_loc=np.array([0, 2, 3], dtype=np.int32),
        num_computed=np.array([0, 5], dtype=np.int64),
        num_rows_padded=4,
        token_ids=np.array([1, 2, -1], dtype=np.int32),
    )
    return fields | override


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"req_ids": ["a", "b"]}, "req_ids"),
        ({"req_ids": ("a", 2)}, "req_ids"),
        ({"req_ids": ("a", "a")}, "req_ids"),
        ({"query_start_loc": np.array([0, 2, 3], dtype=np.int64)}, "query_start_loc"),
        ({"query_start_loc": np.array([0, 3], dtype=np.int32)}, "query_start_loc"),
        ({"query_start_loc": [0, 2, 3]}, "query_start_loc"),
        ({"query_start_loc": np.array([1, 2, 3], dtype=np.int32)}, "query_start_loc"),
        ({"query_start_loc": np.array([0, 2, 1], dtype=np.int32)}, "query_start_loc"),
        ({"num_computed": np.array([0, 5], dtype=np.int32)}, "num_computed"),
        ({"num_computed": np.array([0, -1], dtype=np.int64)}, "num_computed"),
        ({"num_computed": np.array([0], dtype=np.int64)}, "num_computed"),
        ({"num_rows_padded": 2}, "num_rows_padded"),
        ({"num_rows_padded": 4.0}, "num_rows_padded"),
        ({"num_rows_padded": True}, "num_rows_padded"),
        ({"token_ids": np.array([1, 2], dtype=np.int32)}, "token_ids"),
        ({"token_ids": np.array([1, 2, 3], dtype=np.int64)}, "token_ids"),
        ({"token_ids": np.array([1, -2, 3], dtype=np.int32)}, "token_ids"),
    ],
)
def test_bad_geometry_names_the_field(override, needle):
    with pytest.raises(ValueError, match=needle):
        BatchGeometry(**_geometry_fields(**override))


def test_good_geometry():
    geo = BatchGeometry(**_geometry_fields())
    assert geo.num_reqs == 2 and geo.num_rows == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"prompt_len": 0}, "prompt_len"),
        ({"prompt_len": 3, "prompt_token_ids": (1, 2)}, "prompt_token_ids"),
        ({"prompt_len": 3, "select": {"prompt": "all"}}, "select"),
    ],
)
def test_bad_track_names_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        RequestTrack(req_index=0, **kwargs)


def test_negative_row_limit_rejected():
    with pytest.raises(ValueError, match="row_limit"):
        plan_rows(geometry({"a": 1}), {}, -1)


# ---- randomized scheduler vs brute-force reference ----------------------------------------------


@dataclass
class SimRequest:
    rid: str
    index: int
    prompt_len: int
    seq: list  # true input token of every position (prompt + fed generated tokens)
    arrive: int
    cache_hit: int
    track_from: int | None  # step the stream starts tracking it (None: never tracked)
    track_until: int | None  # step it stops being tracked (None: never)
    spec: SelectSpec | None
    host_prompt_ids: bool
    preemptions_left: int
    computed: int = 0
    known: int = 0  # tokens the scheduler knows: the prompt, then each sampled token
    started: bool = False
    tracked_ranges: list = field(default_factory=list)  # (first, stop) positions per tracked step

    @property
    def total(self) -> int:
        return len(self.seq)

    @property
    def done(self) -> bool:
        return self.computed == self.total


@st.composite
def sim_requests(draw):
    rng = draw(st.randoms(use_true_random=False))
    count = draw(st.integers(1, 5))
    requests = []
    for i in range(count):
        prompt_len = rng.randint(1, 10)
        generated = rng.randint(0, 6)
        arrive = rng.randint(0, 6)
        tracking = rng.random()
        if tracking < 0.6:
            track_from, track_until = 0, None
        elif tracking < 0.75:
            track_from, track_until = None, None
        else:
            track_from = rng.randint(0, 15)
            track_until = rng.choice([None, track_from + rng.randint(1, 10)])
        requests.append(
            SimRequest(
                rid=f"req-{i}",
                index=i,
                prompt_len=prompt_len,
                seq=[rng.randrange(VOCAB) for _ in range(prompt_len + generated)],
                arrive=arrive,
                cache_hit=rng.choice([0, 0, rng.randrange(prompt_len)]),
                track_from=track_from,
                track_until=track_until,
                spec=draw(st.none() | select_specs()),
                host_prompt_ids=rng.random() < 0.5,
                preemptions_left=rng.randint(0, 2),
                known=prompt_len,
            )
        )
    return rng, requests


def _new_track(req: SimRequest, with_clause: bool) -> RequestTrack:
    return RequestTrack(
        req_index=req.index,
        prompt_len=req.prompt_len,
        prompt_token_ids=tuple(req.seq[: req.prompt_len]) if req.host_prompt_ids else None,
        select=req.spec if with_clause else None,
    )


def _schedule(rng, requests, step):
    """One scheduler step: (request, first position, rows) in a random batch order."""
    waiting = [r for r in requests if r.arrive <= step and not r.done]
    for r in waiting:
        if r.started and r.computed and r.preemptions_left and rng.random() < 0.1:
            r.preemptions_left -= 1
            r.computed = 0  # recomputed later as a prefill of prompt + generated tokens
    batch = [r for r in waiting if rng.random() < 0.8] or waiting[:1]
    rng.shuffle(batch)
    scheduled = []
    for r in batch:
        if not r.started:
            r.started, r.computed = True, r.cache_hit
        rows = min(rng.randint(1, 6), min(r.known, r.total) - r.computed)
        scheduled.append((r, r.computed, rows))
    return scheduled


def _geometry_for(rng, scheduled) -> BatchGeometry:
    counts = [rows for _, _, rows in scheduled]
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    tokens = []
    for r, first, rows in scheduled:
        for q in range(first, first + rows):
            unknown = rng.random() < (0.5 if q >= r.prompt_len else 0.15)
            tokens.append(-1 if unknown else r.seq[q])
    return BatchGeometry(
        req_ids=tuple(r.rid for r, _, _ in scheduled),
        query_start_loc=qsl,
        num_computed=np.array([first for _, first, _ in scheduled], dtype=np.int64),
        num_rows_padded=int(qsl[-1]) + rng.randint(0, 3),
        token_ids=np.array(tokens, dtype=np.int32),
    )


def _row_owner(geo: BatchGeometry, row: int) -> tuple[int, int]:
    """(geometry request index, position) of a real row, from the geometry alone."""
    assert 0 <= row < geo.num_rows, f"row {row} is padding or out of range"
    i = int(np.searchsorted(geo.query_start_loc, row, side="right")) - 1
    return i, int(geo.num_computed[i]) + row - int(geo.query_start_loc[i])


def _resolved(plan, n=None):
    n = len(plan.rows) if n is None else n
    return [plan.conditions[c] if c >= 0 else None for c in plan.condition[:n].tolist()]


def _check_row_plan(geo, plan, by_rid, captured, planned):
    assert np.all(np.diff(plan.rows) > 0)
    for k, row in enumerate(plan.rows.tolist()):
        i, position = _row_owner(geo, row)
        req = by_rid[geo.req_ids[i]]
        assert plan.req_index[k] == req.index and plan.positions[k] == position
        key = (req.rid, position)
        assert key not in planned, f"{key} planned twice"
        planned.add(key)
        c = int(plan.condition[k])
        if c >= 0:
            # Deferred only when the host did not know the token.
            assert geo.token_ids[row] == -1
            assert position >= req.prompt_len or not req.host_prompt_ids
            cond = plan.conditions[c]
            assert cond.include is not None or cond.exclude  # never trivially true
            keep = cond.accepts(req.seq[position])
        else:
            keep = True
        if keep:
            captured.add(key)
    assert len(set(plan.conditions)) == len(plan.conditions)


def _check_segments(geo, plan, by_rid, slots, covered):
    assert len({int(s) for s in plan.slot}) == len(plan.slot)
    for slot, start, count, last in zip(
        plan.slot.tolist(), plan.row_start.tolist(), plan.row_count.tolist(),
        plan.last_position.tolist(),
    ):
        assert count > 0
        i, first_position = _row_owner(geo, start)
        j, last_position = _row_owner(geo, start + count - 1)
        rid = geo.req_ids[i]
        assert i == j and slot == slots[rid] and last == last_position
        assert start + count == geo.query_start_loc[i + 1]  # runs to the request's last row
        for position in range(first_position, last_position + 1):
            assert (rid, position) not in covered, f"{(rid, position)} reduced twice"
            covered.add((rid, position))


def _expected(requests):
    """Reference (request, position) sets: (selected rows, all rows)."""
    selected, every = set(), set()
    for r in requests:
        if r.track_from == 0 and r.track_until is None:
            # Tracked for its whole life: every position from the cache hit to the end.
            positions = range(r.cache_hit, r.total)
        else:
            # Tracked for part of its life: positions seen while tracked, each the first time
            # the request got past it (a recompute after preemption is not new).
            positions, high = [], 0
            for first, stop in r.tracked_ranges:
                positions.extend(range(max(first, high), stop))
                high = max(high, stop)
        for q in positions:
            every.add((r.rid, q))
            if reference_selected(r.spec, r.prompt_len, q, r.seq[q]):
                selected.add((r.rid, q))
    return selected, every


@settings(max_examples=300, deadline=None)
@given(sim=sim_requests(), row_limit=st.integers(0, 5))
def test_random_schedules_match_the_reference(sim, row_limit):
    rng, requests = sim
    by_rid = {r.rid: r for r in requests}
    full, limited, reduce = {}, {}, {}  # three streams' tracks
    slots = {r.rid: 100 + r.index for r in requests}
    captured, planned, covered = set(), set(), set()
    step = 0
    while not all(r.done for r in requests):
        assert step < 500
        for r in requests:
            if r.track_from == step:
                full[r.rid], limited[r.rid] = _new_track(r, True), _new_track(r, True)
                reduce[r.rid] = _new_track(r, False)
            if r.track_until == step and r.rid in full:
                del full[r.rid], limited[r.rid], reduce[r.rid]
        scheduled = _schedule(rng, requests, step)
        if scheduled:
            geo = _geometry_for(rng, scheduled)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # clamped prompt positions
                plan = plan_rows(geo, full, row_limit=1 << 20)
                cut = plan_rows(geo, limited, row_limit=row_limit)
            segments = plan_segments(geo, reduce, slots)
            _check_row_plan(geo, plan, by_rid, captured, planned)

            # The ring limit keeps a prefix of the full plan and counts the rest.
            n = min(row_limit, len(plan.rows))
            assert cut.rows.tolist() == plan.rows[:n].tolist()
            assert cut.positions.tolist() == plan.positions[:n].tolist()
            assert cut.req_index.tolist() == plan.req_index[:n].tolist()
            assert _resolved(cut) == _resolved(plan, n)
            assert set(cut.condition.tolist()) - {-1} == set(range(len(cut.conditions)))
            assert cut.dropped == len(plan.rows) - n

            _check_segments(geo, segments, by_rid, slots, covered)
            for rid in full:
                assert full[rid].next_position == limited[rid].next_position
                assert full[rid].next_position == reduce[rid].next_position

            for r, first, rows in scheduled:
                if r.rid in full:
                    r.tracked_ranges.append((first, first + rows))
                r.computed += rows
                if r.computed == r.known:
                    r.known += 1  # the step sampled a token
        step += 1

    selected, every = _expected(requests)
    assert captured == selected
    assert covered == every
    assert planned <= every


# ---- speed ----------------------------------------------------------------------------------


def test_planning_a_large_step_is_fast():
    """8k rows: 8 long prefills plus ~1000 single-row decodes with unknown tokens."""
    rng = np.random.default_rng(0)
    decodes, prefill = 1000, 899
    counts = [1] * decodes + [prefill] * 8
    geo = geometry(
        {f"r{i}": n for i, n in enumerate(counts)},
        num_computed=[300] * decodes + [prefill] * 8,
        tokens=np.where(np.arange(sum(counts)) < decodes, -1, rng.integers(0, 1000, sum(counts))),
        pad=64,
    )
    assert geo.num_rows == 8192
    clause = {
        "prompt_tokens": list(range(0, 1000, 7)),
        "prompt_window": [-64, None],
        "generation": "all",
        "exclude_generation_tokens": [1, 2, 3],
    }
    tracks = {
        rid: RequestTrack(
            req_index=i,
            prompt_len=100 if i < decodes else 3 * prefill,
            prompt_token_ids=None if i < decodes else tuple(range(3 * prefill)),
            select=SelectSpec.from_wire(clause),
        )
        for i, rid in enumerate(geo.req_ids)
    }
    timings = []
    for _ in range(10):
        for track in tracks.values():
            track.next_position = 0
        start = time.perf_counter()
        plan = plan_rows(geo, tracks, row_limit=4096)
        timings.append(time.perf_counter() - start)
    assert plan.condition[:decodes].tolist() == [0] * decodes  # decode rows await their token
    assert min(timings) < 0.005, f"plan_rows took {min(timings) * 1e3:.2f} ms"


# ---- steady decode: repeating the last plan ------------------------------------------------------


def _plan_fields(plan):
    names = ("rows", "req_index", "positions", "condition") if hasattr(plan, "rows") else (
        "slot", "row_start", "row_count", "last_position")
    return {name: getattr(plan, name).tolist() for name in names}


@pytest.mark.parametrize("seed", range(40))
def test_decode_repeats_plan_what_full_planning_plans(seed):
    """Random decode runs with joins, leaves, reorders, multi-row steps, preemptions, untracked and
    clause requests: where DecodeRepeat repeats a step, its plan and the tracks it advances equal
    what plan_rows / plan_segments give on a second set of tracks."""
    rng = np.random.default_rng(seed)
    computed: dict[str, int] = {}
    untracked, with_clause = set(), set()
    full, fast = {}, {}  # kind -> tracks
    for kind in ("rows", "segments"):
        full[kind], fast[kind] = {}, {}
    slots: dict[str, int] = {}
    repeat = {"rows": None, "segments": None}
    repeats = 0
    for step in range(80):
        if not computed or rng.random() < 0.08:
            rid = f"r{step}"
            computed[rid] = 0
            slots[rid] = len(slots)
            if rng.random() < 0.1:
                untracked.add(rid)
            else:
                clause = rng.random() < 0.15
                if clause:
                    with_clause.add(rid)
                for kind in full:
                    for tracks in (full[kind], fast[kind]):
                        tracks[rid] = RequestTrack(
                            req_index=slots[rid], prompt_len=5,
                            select=SelectSpec(generation="all") if clause and kind == "rows"
                            else None)
        leaving = [rid for rid in untracked if rid in computed and computed[rid] > 8]
        if len(computed) > 1 and rng.random() < 0.05:
            leaving.append(rng.choice(sorted(computed)))
        for gone in dict.fromkeys(leaving):
            del computed[gone]
            for kind in full:
                full[kind].pop(gone, None)
                fast[kind].pop(gone, None)
                repeat[kind] = None  # as the session does when tracks change (settled each step here)
        order = sorted(computed)
        if rng.random() < 0.05:
            rng.shuffle(order)
        rows = {rid: (rng.integers(2, 6) if computed[rid] == 0 or rng.random() < 0.04 else 1)
                for rid in order}
        if rng.random() < 0.03:
            computed[order[0]] = 0  # preempted: recomputed from the start
        geo = geometry(rows, num_computed=[computed[rid] for rid in order])
        for kind in full:
            tracks = full[kind]
            expect = (plan_rows(geo, full[kind], row_limit=1 << 20) if kind == "rows"
                      else plan_segments(geo, full[kind], slots))
            # The runner's buffers: longer than the step, int32, as vLLM's are.
            buffers = StepBuffers(list(geo.req_ids),
                                  np.concatenate([geo.query_start_loc, [7, 7]]).astype(np.int32),
                                  np.concatenate([geo.num_computed, [3]]).astype(np.int32),
                                  geo.num_rows_padded)
            positions = None if repeat[kind] is None else repeat[kind].advance(buffers)
            if positions is None:
                if repeat[kind] is not None:
                    repeat[kind].settle()
                got = (plan_rows(geo, fast[kind], row_limit=1 << 20) if kind == "rows"
                       else plan_segments(geo, fast[kind], slots))
                repeat[kind] = DecodeRepeat.after(geo, fast[kind], got)
            else:
                repeats += 1
                got = repeat[kind].plan
                got = (replace(got, positions=positions) if kind == "rows"
                       else replace(got, last_position=repeat[kind].last_positions()))
            assert _plan_fields(got) == _plan_fields(expect), (step, kind)
            if repeat[kind] is not None:
                repeat[kind].settle()
            assert {r: t.next_position for r, t in fast[kind].items()} == {
                r: t.next_position for r, t in tracks.items()}
        for rid in order:
            computed[rid] += int(rows[rid])
    assert repeats > 0


def test_decode_repeat_follows_long_decode_past_its_look_ahead():
    """A repeat runs on for several of its look-ahead spans in the runner's int32 buffers: each
    step is recognised, a skipped or repeated position anywhere is not, and the tracks settle
    where the last repeat left them."""
    tracks = {"a": RequestTrack(req_index=0, prompt_len=2),
              "b": RequestTrack(req_index=1, prompt_len=2)}
    geo = geometry({"a": 1, "b": 1}, num_computed=[4, 70])
    repeat = DecodeRepeat.after(geo, tracks, plan_rows(geo, tracks, row_limit=8))
    qsl = np.array([0, 1, 2, 2], np.int32)
    steps = 3 * DecodeRepeat.AHEAD + 5
    for k in range(1, steps + 1):
        computed = np.array([4 + k, 70 + k, 0], np.int32)
        if k in (DecodeRepeat.AHEAD - 1, DecodeRepeat.AHEAD, 2 * DecodeRepeat.AHEAD):
            for wrong in ([4 + k + 1, 70 + k], [4 + k, 70 + k - 1], [4 + k - 1, 70 + k - 1]):
                assert repeat.advance(StepBuffers(["a", "b"], qsl, np.array(wrong, np.int32),
                                                  2)) is None
        got = repeat.advance(StepBuffers(["a", "b"], qsl, computed, 2))
        assert got is not None and got.tolist() == [4 + k, 70 + k], k
    assert repeat.last_positions().tolist() == [4 + steps, 70 + steps]
    repeat.settle()
    assert tracks["a"].next_position == 5 + steps and tracks["b"].next_position == 71 + steps


def test_decode_repeat_requires_one_planned_row_per_request():
    tracks = {"a": RequestTrack(req_index=0, prompt_len=2), "b": RequestTrack(req_index=1, prompt_len=2)}
    geo = geometry({"a": 1, "b": 1}, num_computed=[4, 7])
    plan = plan_rows(geo, tracks, row_limit=8)
    repeat = DecodeRepeat.after(geo, tracks, plan)
    assert repeat is not None
    assert repeat.advance(geometry({"a": 1, "b": 1}, num_computed=[4, 7])) is None  # no progress
    assert repeat.advance(geometry({"b": 1, "a": 1}, num_computed=[8, 5])) is None  # reordered
    assert repeat.advance(geometry({"a": 2, "b": 0}, num_computed=[5, 8])) is None  # 2 rows, 0 rows
    assert repeat.advance(geometry({"a": 1}, num_computed=[5])) is None  # one left
    # The runner's own buffers: views of longer int32 arrays, read without a copy.
    qsl, computed = np.array([0, 1, 2, 9], np.int32), np.array([5, 8, 1], np.int32)
    again = repeat.advance(StepBuffers(["a", "b"], qsl, computed, 2))
    assert again.tolist() == [5, 8] and np.shares_memory(again, computed)
    assert tracks["a"].next_position == 5  # moved on in the repeat only, until it settles
    repeat.settle()
    assert tracks["a"].next_position == 6 and tracks["b"].next_position == 9
    assert repeat.last_positions().tolist() == [5, 8]
    assert repeat.advance(StepBuffers(["a", "b"], qsl, np.array([6, 9], np.int32), 1)) is None
    # Start offsets in a dtype other than the first repeat's: planned (the same plan), not repeated.
    assert repeat.advance(StepBuffers(["a", "b"], qsl.astype(np.int64), np.array([6, 9], np.int32),
                                      2)) is None
    assert repeat.advance(StepBuffers(["a", "b"], qsl, np.array([6, 9], np.int64), 2)) is not None
    # Not repeatable: a cut plan, a two-row request, an untracked request, a clause.
    assert DecodeRepeat.after(geo, tracks, plan_rows(geo, tracks, row_limit=1)) is None
    two = geometry({"a": 2, "b": 1}, num_computed=[6, 9])
    assert DecodeRepeat.after(two, tracks, plan_rows(two, tracks, row_limit=8)) is None
    extra = geometry({"a": 1, "b": 1, "c": 1}, num_computed=[8, 10, 0])
    assert DecodeRepeat.after(extra, tracks, plan_rows(extra, tracks, row_limit=8)) is None
    tracks["b"] = RequestTrack(req_index=1, prompt_len=2, select=SelectSpec(generation="all"),
                               next_position=11)
    nxt = geometry({"a": 1, "b": 1}, num_computed=[9, 11])
    assert DecodeRepeat.after(nxt, tracks, plan_rows(nxt, tracks, row_limit=8)) is None
