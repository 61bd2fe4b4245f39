"""SelectSpec: the where-clause that says which rows of a request are captured.

The clause arrives from clients as a JSON dict (per stream, or per request in sampling params) and
is resolved once per request, so it is validated strictly up front: a malformed clause must fail
at ``enable``/admission time, never mid-forward. Every selector is phase-scoped:

* prompt rows are indexed by prompt position ``p`` (``0 <= p < prompt_len``); negative
  ``prompt_positions`` and window bounds count from the prompt end, positive positions past the
  end clamp to the last prompt token (with a warning), negative ones before its start match no
  row (with a warning), windows resolve like Python slices;
* generation rows are indexed by decode step ``g = position - prompt_len`` (0-based).

A row is kept iff ``(phase "all" or any include matches) and not (any exclude matches)``.
Include and exclude selectors are symmetric twins evaluated by the same matcher, so an exclude
position past the prompt end clamps exactly like its include twin would.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from vllm_capture.checks import is_int

__all__ = ["PHASE_ALL", "UNKNOWN_TOKEN", "RowMatch", "SelectSpec"]

PHASE_ALL = "all"
# Token id of a row whose input token the host does not know (decode rows under async scheduling).
UNKNOWN_TOKEN = -1

Window = tuple[int | None, int | None]

_SELECTORS = ("tokens", "positions", "window")
_PHASES = ("prompt", "generation")

# Canonical instance per clause value, see SelectSpec.interned().
_INTERNED: weakref.WeakValueDictionary[tuple, SelectSpec] = weakref.WeakValueDictionary()


@dataclass(frozen=True, eq=False)
class RowMatch:
    """Verdict of one phase of a clause on a batch of rows (three disjoint masks).

    The host cannot always decide: a decode row's token id may be unknown (-1) when the plan is
    made, and only then is a row's fate deferred to the drain, which sees the real token.
    ``keep`` rows are selected whatever their token; ``keep_unless_excluded`` rows (included by
    position) are kept iff their token is not in ``exclude_tokens``; ``keep_if_included`` rows are
    kept iff their token is in ``include_tokens`` and not in ``exclude_tokens``.
    """

    keep: np.ndarray
    keep_unless_excluded: np.ndarray
    keep_if_included: np.ndarray
    include_tokens: frozenset[int]
    exclude_tokens: frozenset[int]


class _Selectors:
    """One side (include or exclude) of one phase: token set, positions and window.

    ``match_positions`` takes ``length=None`` for the generation phase, whose index space is
    unbounded (no negative positions, no clamping, an open window runs forever).
    """

    def __init__(self, tokens, positions, window):
        self.tokens = frozenset(tokens or ())
        self._token_array = np.array(sorted(self.tokens), dtype=np.int64)
        all_positions = np.array(positions or (), dtype=np.int64)  # sorted by normalisation
        self._nonneg = all_positions[all_positions >= 0]
        self._neg = all_positions[all_positions < 0]
        self.window = window

    @property
    def max_position(self) -> int | None:
        return int(self._nonneg[-1]) if self._nonneg.size else None

    @property
    def min_negative_position(self) -> int | None:
        return int(self._neg[0]) if self._neg.size else None

    def match_tokens(self, token_ids: np.ndarray) -> np.ndarray:
        if not self.tokens:
            return np.zeros(token_ids.shape, dtype=bool)
        return np.isin(token_ids, self._token_array)

    def match_positions(self, index: np.ndarray, length: np.ndarray | None) -> np.ndarray:
        mask = np.zeros(index.shape, dtype=bool)
        if self._nonneg.size:
            mask |= np.isin(index, self._nonneg)
            if length is not None:
                # Positions past the end all land on the last prompt token.
                mask |= (index == length - 1) & (self._nonneg[-1] >= length)
        if self._neg.size:
            mask |= np.isin(index - length, self._neg)
        if self.window is not None:
            start, stop = self.window
            if start is not None:
                mask_lo = index >= (start if start >= 0 else length + start)
            else:
                mask_lo = True
            if stop is not None:
                mask_hi = index < (stop if stop >= 0 else length + stop)
            else:
                mask_hi = True  # open end: the prompt end (index < length always) or unbounded
            mask |= mask_lo & mask_hi
        return mask


class _PhaseClause:
    """The part of a clause that concerns one phase."""

    def __init__(self, select_all: bool, include: _Selectors, exclude: _Selectors):
        self.select_all = select_all
        self.include = include
        self.exclude = exclude
        # A token-conditional row that no token can satisfy is not worth planning.
        self._tokens_can_include = bool(include.tokens - exclude.tokens)

    def match(self, index, length, token_ids) -> RowMatch:
        index = np.asarray(index, dtype=np.int64)
        token_ids = np.asarray(token_ids, dtype=np.int64)
        if self.select_all:
            inc_pos = np.ones(index.shape, dtype=bool)
        else:
            inc_pos = self.include.match_positions(index, length)
        exc_pos = self.exclude.match_positions(index, length)
        known = token_ids != UNKNOWN_TOKEN
        inc = inc_pos | self.include.match_tokens(token_ids)
        exc = exc_pos | self.exclude.match_tokens(token_ids)
        keep = known & inc & ~exc
        undecided = ~known & ~exc_pos
        if self.exclude.tokens:
            keep_unless_excluded = undecided & inc_pos
        else:
            keep |= undecided & inc_pos
            keep_unless_excluded = np.zeros(index.shape, dtype=bool)
        if self._tokens_can_include:
            keep_if_included = undecided & ~inc_pos
        else:
            keep_if_included = np.zeros(index.shape, dtype=bool)
        return RowMatch(
            keep=keep,
            keep_unless_excluded=keep_unless_excluded,
            keep_if_included=keep_if_included,
            include_tokens=self.include.tokens,
            exclude_tokens=self.exclude.tokens,
        )


def _field_error(name: str, message: str) -> ValueError:
    return ValueError(f"SelectSpec.{name}: {message}")


# Token ids and positions travel as int32 label columns; a larger value can match nothing, and
# past int64 numpy cannot even hold it (the worker would raise inside a step).
_INT_LIMIT = 2 ** 31


def _as_int(name: str, value: Any) -> int:
    if not is_int(value):
        raise _field_error(name, f"expected an int, got {value!r} ({type(value).__name__})")
    value = int(value)
    if not -_INT_LIMIT < value < _INT_LIMIT:
        raise _field_error(name, f"{value} is out of range (|value| must be below 2**31)")
    return value


def _int_list(name: str, value: Any, minimum: int | None) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)):
        raise _field_error(name, f"expected a list of ints, got {type(value).__name__}")
    if not value:
        raise _field_error(name, "empty list selects nothing; leave the field unset (None)")
    ints = [_as_int(name, v) for v in value]
    if minimum is not None:
        bad = sorted(v for v in ints if v < minimum)
        if bad:
            raise _field_error(name, f"values must be >= {minimum}, got {bad}")
    return tuple(sorted(set(ints)))


def _window(name: str, value: Any, nonneg: bool) -> Window:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise _field_error(name, f"expected a 2-item (start, stop) window, got {value!r}")
    start, stop = (None if v is None else _as_int(name, v) for v in value)
    if nonneg:
        if start is None:
            raise _field_error(name, "start must be an int >= 0 (decode steps)")
        if start < 0 or (stop is not None and stop < 0):
            raise _field_error(name, f"bounds must be >= 0 (decode steps), got {value!r}")
    lo = 0 if start is None else start
    # Empty for every prompt length: stop 0, or both bounds on the same side and stop <= start.
    if stop is not None and (stop == 0 or ((lo >= 0) == (stop >= 0) and stop <= lo)):
        raise _field_error(name, f"half-open window {value!r} is empty")
    return (start, stop)


def _check_excludes_leave_rows(phase: str, select_all: bool, include: list, exclude: list) -> None:
    """Refuse a phase whose excludes remove every row its includes take, whatever the prompt's
    length or the tokens (the cases decidable from the clause alone): it would capture nothing
    of that phase, silently."""
    tokens, positions, window = include
    exclude_tokens, exclude_positions, exclude_window = exclude
    if exclude_window is not None and exclude_window[0] in (None, 0) and exclude_window[1] is None:
        raise _field_error(f"exclude_{phase}_window",
                           f"{list(exclude_window)} excludes every {phase} row, so the clause's "
                           f"{phase} part selects nothing")
    if select_all or window is not None:
        return
    if ((tokens is None or set(tokens) <= set(exclude_tokens or ()))
            and (positions is None or set(positions) <= set(exclude_positions or ()))):
        named = [f"exclude_{phase}_{kind}" for kind, value in
                 (("tokens", tokens), ("positions", positions)) if value is not None]
        raise _field_error(" and ".join(named),
                           f"excludes every {phase} row the clause includes, so its {phase} part "
                           f"selects nothing")


@dataclass(frozen=True, kw_only=True)
class SelectSpec:
    """The where-clause; see the module docstring for the semantics.

    Lists are normalised to sorted tuples of unique ints and windows to tuples, so equal clauses
    compare and hash equal (the planner groups requests by clause). Invalid clauses raise
    ValueError naming the field.
    """

    prompt: Literal["all"] | None = None
    generation: Literal["all"] | None = None
    prompt_tokens: tuple[int, ...] | None = None
    prompt_positions: tuple[int, ...] | None = None
    prompt_window: Window | None = None
    generation_tokens: tuple[int, ...] | None = None
    generation_positions: tuple[int, ...] | None = None
    generation_window: Window | None = None
    exclude_prompt_tokens: tuple[int, ...] | None = None
    exclude_prompt_positions: tuple[int, ...] | None = None
    exclude_prompt_window: Window | None = None
    exclude_generation_tokens: tuple[int, ...] | None = None
    exclude_generation_positions: tuple[int, ...] | None = None
    exclude_generation_window: Window | None = None

    def __post_init__(self):
        for phase in _PHASES:
            value = getattr(self, phase)
            if value is not None and (not isinstance(value, str) or value != PHASE_ALL):
                raise _field_error(phase, f"expected 'all' or None, got {value!r}")
            for side in ("", "exclude_"):
                for kind in _SELECTORS:
                    name = f"{side}{phase}_{kind}"
                    value = getattr(self, name)
                    if value is None:
                        continue
                    if kind == "window":
                        value = _window(name, value, nonneg=phase == "generation")
                    else:
                        floor = None if (phase, kind) == ("prompt", "positions") else 0
                        value = _int_list(name, value, floor)
                    object.__setattr__(self, name, value)

        clauses = {}
        for phase in _PHASES:
            include = [getattr(self, f"{phase}_{kind}") for kind in _SELECTORS]
            exclude = [getattr(self, f"exclude_{phase}_{kind}") for kind in _SELECTORS]
            covered = getattr(self, phase) == PHASE_ALL or any(v is not None for v in include)
            if covered:
                select_all = getattr(self, phase) == PHASE_ALL
                _check_excludes_leave_rows(phase, select_all, include, exclude)
                clauses[phase] = _PhaseClause(select_all, _Selectors(*include),
                                              _Selectors(*exclude))
            else:
                for kind, value in zip(_SELECTORS, exclude):
                    if value is not None:
                        raise _field_error(
                            f"exclude_{phase}_{kind}",
                            f"excludes from the {phase} phase, which the clause does not select "
                            f"(set {phase}='all' or a {phase}_* include)",
                        )
        if not clauses:
            raise ValueError(
                "SelectSpec selects nothing: set prompt='all', generation='all' or an include "
                "selector (prompt_tokens/positions/window, generation_tokens/positions/window)"
            )
        object.__setattr__(self, "_clauses", clauses)
        object.__setattr__(self, "_warned_clamp", False)
        object.__setattr__(self, "_key", tuple(getattr(self, f.name) for f in fields(self)))
        # Cached: the planner hashes every tracked request's clause every step.
        object.__setattr__(self, "_hash", hash(self._key))

    def __hash__(self) -> int:
        return self._hash

    def interned(self) -> SelectSpec:
        """The process-wide canonical instance equal to this clause.

        Each request resolves its own clause from the wire, so a batch holds many equal but
        distinct instances; sharing one makes the planner's per-step grouping an identity check
        instead of a field-by-field comparison, and makes the clamp warning fire once per clause.
        """
        return _INTERNED.setdefault(self._key, self)

    def __repr__(self) -> str:
        set_fields = ", ".join(
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) is not None
        )
        return f"SelectSpec({set_fields})"

    @classmethod
    def all(cls) -> SelectSpec:
        """Every prompt and generation row."""
        return cls(prompt=PHASE_ALL, generation=PHASE_ALL)

    @classmethod
    def last_prompt_token(cls) -> SelectSpec:
        """The last prompt row only (the row that produces the first generated token)."""
        return cls(prompt_positions=(-1,))

    # ---- wire form -------------------------------------------------------------------------

    def to_wire(self) -> dict[str, Any]:
        """JSON/msgpack-safe dict with every key present (None included)."""
        return {
            f.name: list(value) if isinstance(value := getattr(self, f.name), tuple) else value
            for f in fields(self)
        }

    @classmethod
    def from_wire(cls, data: Any) -> SelectSpec:
        """Parse and re-validate a wire dict; missing keys default to None."""
        if not isinstance(data, dict):
            raise ValueError(f"SelectSpec wire form must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(map(str, set(data) - known))
        if unknown:
            raise ValueError(f"SelectSpec: unknown keys {unknown}")
        return cls(**data)

    # ---- semantics -------------------------------------------------------------------------

    @property
    def covers_prompt(self) -> bool:
        return "prompt" in self._clauses

    @property
    def covers_generation(self) -> bool:
        return "generation" in self._clauses

    @property
    def reads_prompt_tokens(self) -> bool:
        """Whether prompt rows' selection can depend on their token ids."""
        return self.prompt_tokens is not None or self.exclude_prompt_tokens is not None

    def selects_nothing_at(self, max_tokens: int) -> str | None:
        """Why the clause can select no row of a request generating ``max_tokens`` tokens
        (``max_tokens=N`` feeds the prompt and N-1 generated rows), or None where it may select
        one. Tokens are not known before the generate: a token selector may match."""
        if self.covers_prompt:
            return None
        if max_tokens < 2:
            return (f"selects generated rows only, but max_tokens={max_tokens} feeds none "
                    f"(max_tokens=N feeds N-1 generated rows)")
        # A step's fate changes only at a position or window bound, so the first and last step
        # fed and the steps beside each bound decide.
        bounds = [v for name in ("generation_positions", "generation_window",
                                 "exclude_generation_positions", "exclude_generation_window")
                  for v in getattr(self, name) or () if v is not None]
        last = max_tokens - 2
        steps = np.array(sorted({0, last} | {min(max(b + d, 0), last) for b in bounds
                                             for d in (-1, 0, 1)}), dtype=np.int64)
        match = self.match_generation(steps, np.full(steps.shape, UNKNOWN_TOKEN))
        if not (match.keep | match.keep_unless_excluded | match.keep_if_included).any():
            return (f"selects generated rows only, but no decode step that max_tokens="
                    f"{max_tokens} feeds (steps 0..{last}) matches it")
        return None

    def match_prompt(self, positions, prompt_len, token_ids) -> RowMatch:
        """Judge prompt rows: ``positions`` (each ``< prompt_len``), ``prompt_len`` (scalar or
        per row) and the rows' token ids (-1 where unknown)."""
        positions = np.asarray(positions, dtype=np.int64)
        prompt_len = np.asarray(prompt_len, dtype=np.int64)
        clause = self._clauses.get("prompt")
        if clause is None:
            return _nothing(positions.shape)
        if positions.size:
            self._warn_if_clamped(clause, int(prompt_len.min()))
        return clause.match(positions, prompt_len, token_ids)

    def match_generation(self, steps, token_ids) -> RowMatch:
        """Judge generation rows by 0-based decode step and token id (-1 where unknown)."""
        steps = np.asarray(steps, dtype=np.int64)
        clause = self._clauses.get("generation")
        if clause is None:
            return _nothing(steps.shape)
        return clause.match(steps, None, token_ids)

    def selected_prompt_positions(self, prompt_len: int, prompt_token_ids=None) -> np.ndarray:
        """Resolve the clause against a whole known prompt: the sorted selected positions.

        Token selectors need ``prompt_token_ids``; without them a token-dependent clause raises.
        """
        positions = np.arange(prompt_len, dtype=np.int64)
        if prompt_token_ids is None:
            if self.reads_prompt_tokens:
                raise ValueError("this SelectSpec selects prompt tokens; pass prompt_token_ids")
            prompt_token_ids = np.zeros(prompt_len, dtype=np.int64)
        elif len(prompt_token_ids) != prompt_len:
            raise ValueError(
                f"prompt_token_ids has {len(prompt_token_ids)} ids for prompt_len={prompt_len}"
            )
        return np.flatnonzero(self.match_prompt(positions, prompt_len, prompt_token_ids).keep)

    def _warn_if_clamped(self, clause: _PhaseClause, prompt_len: int) -> None:
        """Warn (once per clause) of a position outside a prompt: past its end it clamps to the
        last token; before its start (a negative one) it matches no row of that prompt."""
        if self._warned_clamp:
            return
        for side, selectors in (("", clause.include), ("exclude_", clause.exclude)):
            top, bottom = selectors.max_position, selectors.min_negative_position
            if top is not None and top >= prompt_len:
                message = (f"position {top} is past the end of a {prompt_len}-token prompt; "
                           f"positions past the end clamp to the last prompt token (position "
                           f"{prompt_len - 1})")
            elif bottom is not None and bottom < -prompt_len:
                message = (f"position {bottom} is before the start of a {prompt_len}-token "
                           f"prompt; it matches no row of such a prompt")
            else:
                continue
            object.__setattr__(self, "_warned_clamp", True)
            warnings.warn(f"SelectSpec.{side}prompt_positions: {message}", stacklevel=3)
            return


def _nothing(shape) -> RowMatch:
    return RowMatch(
        np.zeros(shape, dtype=bool),
        np.zeros(shape, dtype=bool),
        np.zeros(shape, dtype=bool),
        frozenset(),
        frozenset(),
    )
