"""Row planning: which activation rows of one step a stream captures, and with which labels.

Pure host code (numpy), run once per stream per step before the forward pass; the resulting index
arrays are uploaded to static device buffers the capture op reads, so planning is on the step path
and stays vectorised (one numpy pass over the step's rows; Python loops are per request or per
distinct clause, never per row).

Each position of a request is planned at most once: a per-(stream, request) high-water mark
(``RequestTrack.next_position``) skips positions the runner recomputes after preemption or that
an earlier step already covered, so chunked prefill, preemption and requests joining mid-stream
never duplicate or mislabel rows. Positions no step computed (a step starting past the mark) are
reported with the plan (``Skipped``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter

import numpy as np

from .geometry import BatchGeometry
from .spec import RowMatch, SelectSpec

__all__ = [
    "DecodeRepeat",
    "RequestTrack",
    "RowPlan",
    "SegmentPlan",
    "Skipped",
    "TokenCondition",
    "plan_rows",
    "plan_segments",
]

_UNCONDITIONAL = -1
_NOT_PLANNED = -2


@dataclass(eq=False)
class RequestTrack:
    """Mutable planner state of one request in one stream.

    ``select=None`` captures every row; ``next_position`` is the high-water mark (positions below
    it were already planned). The planners advance it to the end of the request's rows each step.
    """

    req_index: int
    prompt_len: int
    prompt_token_ids: tuple[int, ...] | None = None
    select: SelectSpec | None = None
    next_position: int = 0
    _prompt_ids: tuple = field(default=(None, None), init=False, repr=False)

    def __post_init__(self):
        if self.prompt_len < 1:
            raise ValueError(f"RequestTrack.prompt_len: must be >= 1, got {self.prompt_len}")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"RequestTrack.prompt_token_ids: {len(self.prompt_token_ids)} ids for "
                f"prompt_len={self.prompt_len}"
            )
        if self.select is not None:
            if not isinstance(self.select, SelectSpec):
                raise ValueError(
                    "RequestTrack.select: expected a SelectSpec or None, "
                    f"got {type(self.select).__name__}"
                )
            self.select = self.select.interned()

    def prompt_ids_array(self) -> np.ndarray | None:
        """``prompt_token_ids`` as an int64 array, converted once (prompts can be long)."""
        source, array = self._prompt_ids
        if source is not self.prompt_token_ids:
            array = None if self.prompt_token_ids is None else np.asarray(
                self.prompt_token_ids, dtype=np.int64
            )
            self._prompt_ids = (self.prompt_token_ids, array)
        return array


@dataclass(frozen=True)
class TokenCondition:
    """Deferred decision for a row whose token id the host did not know at planning time.

    ``include=None`` means any token is included (the row was selected by position or phase).
    """

    include: frozenset[int] | None
    exclude: frozenset[int] = frozenset()

    def accepts(self, token_id: int) -> bool:
        return (self.include is None or token_id in self.include) and token_id not in self.exclude

    def accepts_array(self, token_ids: np.ndarray) -> np.ndarray:
        """Vectorised ``accepts`` for the drain."""
        token_ids = np.asarray(token_ids)
        keep = ~np.isin(token_ids, list(self.exclude))
        if self.include is not None:
            keep &= np.isin(token_ids, list(self.include))
        return keep


@dataclass(frozen=True)
class Skipped:
    """Positions ``[start, stop)`` of ``req_id`` that no step computed: its rows this step begin
    past its track's high-water mark. vLLM's prefix cache does this, when a request is admitted
    and when it resumes after preemption (another request may have cached more of its sequence
    meanwhile). Whether it lost rows the stream wanted is the caller's to decide."""

    req_id: str
    start: int
    stop: int


@dataclass(frozen=True, eq=False)
class RowPlan:
    """Rows to gather this step (reduce="all"), ascending, with their labels.

    ``condition[i]`` is -1 for a row kept unconditionally, else an index into ``conditions``: the
    drain keeps the row iff ``conditions[c].accepts(token_id)``. ``dropped`` counts selected rows
    (conditional ones included) cut by ``row_limit``.
    """

    rows: np.ndarray
    req_index: np.ndarray
    positions: np.ndarray
    condition: np.ndarray
    conditions: list[TokenCondition]
    dropped: int
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True, eq=False)
class SegmentPlan:
    """Per-request contiguous row segments to reduce this step (reduce="last"/"mean")."""

    slot: np.ndarray
    row_start: np.ndarray
    row_count: np.ndarray
    last_position: np.ndarray
    skipped: tuple[Skipped, ...] = ()


@dataclass(frozen=True, eq=False)
class _Scan:
    """Tracked requests of one step (geometry order) and their not-yet-planned rows."""

    tracks: list[RequestTrack]
    req: np.ndarray  # geometry index of each tracked request
    first_row: np.ndarray  # first new row
    num_new: np.ndarray  # new rows (0 when all were planned before)
    first_position: np.ndarray  # position of the request's first row this step
    row_start: np.ndarray  # first row of the request this step (new or not)
    end_position: np.ndarray  # one past the request's last position this step
    next_position: np.ndarray  # each track's high-water mark before this step

    def skipped(self, req_ids: tuple[str, ...]) -> tuple[Skipped, ...]:
        ahead = np.flatnonzero(self.first_position > self.next_position)
        if ahead.size == 0:
            return ()
        return tuple(map(Skipped, map(req_ids.__getitem__, self.req[ahead].tolist()),
                         self.next_position[ahead].tolist(), self.first_position[ahead].tolist()))

    def advance(self) -> None:
        grown = self.end_position > self.next_position
        for track, end in zip(compress(self.tracks, grown.tolist()),
                              self.end_position[grown].tolist()):
            track.next_position = end


# Planning runs on every step: per-request work goes through C-level map/fromiter, not Python loops.
_NEXT_POSITION = attrgetter("next_position")
_SELECT = attrgetter("select")
_PROMPT_LEN = attrgetter("prompt_len")
_REQ_INDEX = attrgetter("req_index")


def _scan(geometry: BatchGeometry, tracks: dict[str, RequestTrack]) -> _Scan:
    found = list(map(tracks.get, geometry.req_ids))
    if None in found:
        req = np.fromiter((i for i, t in enumerate(found) if t is not None), dtype=np.int64)
        found = [t for t in found if t is not None]
    else:
        req = np.arange(len(found), dtype=np.int64)
    next_position = np.fromiter(map(_NEXT_POSITION, found), dtype=np.int64, count=len(found))
    qsl = geometry.query_start_loc.astype(np.int64)
    row_start, row_end = qsl[req], qsl[req + 1]
    first_position = geometry.num_computed[req]
    skip = np.clip(next_position - first_position, 0, row_end - row_start)
    return _Scan(
        tracks=found,
        req=req,
        first_row=row_start + skip,
        num_new=row_end - row_start - skip,
        first_position=first_position,
        row_start=row_start,
        end_position=first_position + (row_end - row_start),
        next_position=next_position,
    )


def plan_rows(
    geometry: BatchGeometry, tracks: dict[str, RequestTrack], row_limit: int
) -> RowPlan:
    """Plan the rows a reduce="all" stream gathers this step, and advance the tracks.

    Only requests in ``tracks`` are planned. At most ``row_limit`` rows (the ring capacity) are
    planned, lowest row indices first; the rest are counted in ``dropped``.
    """
    if row_limit < 0:
        raise ValueError(f"row_limit must be >= 0, got {row_limit}")
    scan = _scan(geometry, tracks)
    num_new = scan.num_new
    total = int(num_new.sum())
    # New rows in ascending row order: ``owner`` indexes scan.tracks.
    owner = np.repeat(np.arange(len(scan.tracks)), num_new)
    offsets = np.cumsum(num_new) - num_new
    rows = np.repeat(scan.first_row - offsets, num_new) + np.arange(total)
    positions = scan.first_position[owner] + (rows - scan.row_start[owner])

    selects = list(map(_SELECT, scan.tracks))
    if selects.count(None) == len(selects):
        # Every row of every request (the common stream without a clause): nothing to decide.
        kept = min(total, row_limit)
        planned, dropped = slice(0, kept), total - kept
        condition, condition_list = np.full(kept, _UNCONDITIONAL, dtype=np.int32), []
    else:
        planned, condition, condition_list = _plan_clauses(geometry, scan, selects, owner, rows,
                                                           positions)
        dropped = max(0, planned.size - row_limit)
        planned, condition = planned[:row_limit], condition[:row_limit]
        if condition_list:
            condition, condition_list = _compact_conditions(condition, condition_list)
    req_index = np.fromiter(
        map(_REQ_INDEX, scan.tracks), dtype=np.int32, count=len(scan.tracks)
    )
    scan.advance()
    return RowPlan(
        rows=rows[planned].astype(np.int32),
        req_index=req_index[owner[planned]],
        positions=positions[planned].astype(np.int32),
        condition=condition,
        conditions=condition_list,
        dropped=dropped,
        skipped=scan.skipped(geometry.req_ids),
    )


def _plan_clauses(geometry, scan: _Scan, selects: list, owner, rows, positions):
    """(planned new-row indices ascending, their condition ids, conditions) under the clauses."""
    prompt_len = np.fromiter(
        map(_PROMPT_LEN, scan.tracks), dtype=np.int64, count=len(scan.tracks)
    )[owner]
    step = _StepRows(geometry, scan.tracks, owner, rows, positions, prompt_len)
    status = np.full(rows.size, _NOT_PLANNED, dtype=np.int32)
    conditions: dict[TokenCondition, int] = {}
    for spec, members in _group_by_clause(selects, owner):
        if spec is None:
            status[members] = _UNCONDITIONAL
        else:
            _plan_clause(spec, members, step, status, conditions)
    planned = np.flatnonzero(status != _NOT_PLANNED)
    return planned, status[planned], list(conditions)


def _group_by_clause(selects: list, owner: np.ndarray):
    """Yield (clause, indices of new rows) per distinct clause; requests mostly share one."""
    group_of = {spec: g for g, spec in enumerate(dict.fromkeys(selects))}
    specs = list(group_of)
    if len(specs) == 1:
        yield specs[0], np.arange(owner.size)
        return
    group = np.fromiter(map(group_of.__getitem__, selects), dtype=np.int64, count=len(selects))
    row_group = group[owner]
    # Stable: each request's rows stay contiguous and ascending inside its group.
    order = np.argsort(row_group, kind="stable")
    bounds = np.searchsorted(row_group[order], np.arange(len(specs) + 1))
    for g, spec in enumerate(specs):
        yield spec, order[bounds[g] : bounds[g + 1]]


@dataclass(frozen=True, eq=False)
class _StepRows:
    """Per-new-row facts shared by every clause group of one ``plan_rows`` call."""

    geometry: BatchGeometry
    tracks: list[RequestTrack]
    owner: np.ndarray  # index into tracks
    rows: np.ndarray
    positions: np.ndarray
    prompt_len: np.ndarray


def _plan_clause(spec: SelectSpec, members: np.ndarray, step: _StepRows, status, conditions):
    """Fill ``status`` for the new rows ``members`` of requests sharing clause ``spec``."""
    positions = step.positions[members]
    prompt_len = step.prompt_len[members]
    is_prompt = positions < prompt_len
    prompt_rows, gen_rows = members[is_prompt], members[~is_prompt]
    if prompt_rows.size and spec.covers_prompt:
        tokens = step.geometry.token_ids[step.rows[prompt_rows]].astype(np.int64)
        if spec.reads_prompt_tokens:
            _host_prompt_tokens(tokens, prompt_rows, step)
        match = spec.match_prompt(positions[is_prompt], prompt_len[is_prompt], tokens)
        _record(match, prompt_rows, status, conditions)
    if gen_rows.size and spec.covers_generation:
        steps = positions[~is_prompt] - prompt_len[~is_prompt]
        match = spec.match_generation(steps, step.geometry.token_ids[step.rows[gen_rows]])
        _record(match, gen_rows, status, conditions)


def _host_prompt_tokens(tokens: np.ndarray, prompt_rows: np.ndarray, step: _StepRows) -> None:
    """Overwrite ``tokens`` with the tracks' own prompt ids where they have them.

    Relies on each request's rows being one contiguous ascending run of ``prompt_rows``.
    """
    owners, starts, counts = np.unique(
        step.owner[prompt_rows], return_index=True, return_counts=True
    )
    for o, start, count in zip(owners.tolist(), starts.tolist(), counts.tolist()):
        ids = step.tracks[o].prompt_ids_array()
        if ids is not None:
            first = int(step.positions[prompt_rows[start]])
            tokens[start : start + count] = ids[first : first + count]


def _record(match: RowMatch, members, status, conditions) -> None:
    status[members[match.keep]] = _UNCONDITIONAL
    for mask, condition in (
        (match.keep_unless_excluded, TokenCondition(None, match.exclude_tokens)),
        (match.keep_if_included, TokenCondition(match.include_tokens, match.exclude_tokens)),
    ):
        if mask.any():
            status[members[mask]] = conditions.setdefault(condition, len(conditions))


def _compact_conditions(condition: np.ndarray, conditions: list[TokenCondition]):
    """Drop conditions whose rows were all cut by the row limit, renumbering the rest."""
    used = np.unique(condition[condition >= 0])
    if used.size == len(conditions):
        return condition, conditions
    renumber = np.full(len(conditions), _UNCONDITIONAL, dtype=np.int32)
    renumber[used] = np.arange(used.size, dtype=np.int32)
    condition = np.where(condition >= 0, renumber[np.maximum(condition, 0)], condition)
    return condition.astype(np.int32), [conditions[i] for i in used.tolist()]


def plan_segments(
    geometry: BatchGeometry, tracks: dict[str, RequestTrack], slots: dict[str, int]
) -> SegmentPlan:
    """Plan one reduction segment per tracked request with new rows, and advance the tracks.

    Reductions take whole requests, so a clause (``select``) on a track is a caller bug.
    """
    scan = _scan(geometry, tracks)
    if any(s is not None for s in set(map(_SELECT, scan.tracks))):
        raise ValueError("plan_segments: reduce='last'/'mean' streams take no select clause")
    has_rows = np.flatnonzero(scan.num_new > 0)
    try:
        slot = list(map(slots.__getitem__, map(geometry.req_ids.__getitem__,
                                               scan.req[has_rows].tolist())))
    except KeyError as exc:
        raise ValueError(
            f"plan_segments: no accumulator slot for request {exc.args[0]!r}"
        ) from None
    scan.advance()
    return SegmentPlan(
        slot=np.asarray(slot, dtype=np.int32),
        row_start=scan.first_row[has_rows].astype(np.int32),
        row_count=scan.num_new[has_rows].astype(np.int32),
        last_position=(scan.end_position[has_rows] - 1).astype(np.int32),
        skipped=scan.skipped(geometry.req_ids),
    )


@dataclass(eq=False)
class DecodeRepeat:
    """A planned step of one new row per request, every request tracked and without a clause.

    The next step repeats it when it holds the same requests in the same order, each one row and
    one position further (steady decode, the most common step). ``advance`` recognises such a step
    from the runner's buffers alone, so nothing is planned and no geometry is built: the plan is
    this one with the step's positions. The tracks move on only in the repeat meanwhile;
    ``settle`` writes them back, and must run before anything else reads them.

    Inside vLLM this runs between the engine's own work, from caches that work has emptied, where
    one numpy call takes microseconds (``np.add`` on the positions: about 5 us in the CPU engine).
    So a repeat computes the positions of ``AHEAD`` steps at once, as the bytes the runner's buffer
    will hold, and a step compares bytes.
    """

    AHEAD = 64

    req_ids: tuple[str, ...]
    tracks: list[RequestTrack]
    plan: RowPlan | SegmentPlan
    # Each request's position in the next ``AHEAD`` repeats, one bytes object a repeat, in the
    # dtype of the runner's buffer once one was seen; ``_next`` indexes the next repeat's.
    _ahead: list[bytes]
    _dtype: np.dtype
    _next: int = 0
    # The bytes of a repeat's query_start_loc, in the dtype of the runner's buffer (one of
    # another dtype never compares equal, so that step is planned).
    _one_row_each: bytes | None = None

    @classmethod
    def after(cls, geometry: BatchGeometry, tracks: dict[str, RequestTrack],
              plan: RowPlan | SegmentPlan) -> DecodeRepeat | None:
        """The repeat of a step just planned into ``plan``, or None if the step was not one row
        per request, every row planned unconditionally."""
        n = geometry.num_reqs
        if n == 0 or geometry.num_rows != n:
            return None
        if isinstance(plan, RowPlan):
            if plan.dropped or plan.conditions or len(plan.rows) != n:
                return None
        elif len(plan.slot) != n:
            return None
        found = list(map(tracks.get, geometry.req_ids))
        if None in found or set(map(_SELECT, found)) != {None}:
            return None
        next_computed = geometry.num_computed + 1  # int64: the geometry checked it
        planned = np.fromiter(map(_NEXT_POSITION, found), dtype=np.int64, count=n)
        if not np.array_equal(planned, next_computed):
            return None
        repeat = cls(geometry.req_ids, found, plan, [], next_computed.dtype)
        repeat._look_ahead(next_computed)
        return repeat

    def advance(self, step) -> np.ndarray | None:
        """This step's positions if it repeats the last one (a ``StepBuffers`` or a
        ``BatchGeometry``; the positions are its ``num_computed``, not a copy), and the repeat
        moves on a position. None: the step must be planned (after ``settle``)."""
        n = len(self.req_ids)
        if step.req_ids != self.req_ids or step.num_rows_padded < n:
            return None
        computed = step.num_computed
        got = computed.tobytes()
        if got != self._ahead[self._next]:
            if computed.dtype == self._dtype:
                return None
            self._look_ahead(self.next_computed().astype(computed.dtype))
            if got != self._ahead[0]:
                return None
        qsl = step.query_start_loc
        one_row_each = self._one_row_each
        if one_row_each is None:
            one_row_each = self._one_row_each = np.arange(n + 1, dtype=qsl.dtype).tobytes()
        if qsl.tobytes() != one_row_each:
            return None
        self.move_on()
        return computed

    def move_on(self) -> None:
        """Every position one further, as a repeated step moves them."""
        self._next += 1
        if self._next == len(self._ahead):
            self._look_ahead(np.frombuffer(self._ahead[-1], self._dtype) + 1)

    def next_computed(self) -> np.ndarray:
        """Each request's position in the next repeat, in ``req_ids`` order (a fresh array)."""
        return np.frombuffer(self._ahead[self._next], self._dtype).copy()

    def _look_ahead(self, next_computed: np.ndarray) -> None:
        ahead = next_computed + np.arange(self.AHEAD, dtype=next_computed.dtype)[:, None]
        self._ahead = list(map(np.ndarray.tobytes, ahead))
        self._dtype, self._next = next_computed.dtype, 0

    def settle(self) -> None:
        """Write the positions the repeats reached back into the tracks."""
        for track, end in zip(self.tracks, self.next_computed().tolist()):
            track.next_position = end

    def last_positions(self) -> np.ndarray:
        """Each request's last position planned or repeated (int64, in ``req_ids`` order)."""
        return self.next_computed().astype(np.int64) - 1
