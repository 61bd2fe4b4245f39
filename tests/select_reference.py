"""The SelectSpec rules, brute force: one row at a time, straight from the definition.

The independent reference the planner, the session and the engine tests compare with. It does not
import ``vllm_capture.selection``: a clause is a SelectSpec or its wire dict, read by field name.

A phase (prompt: ``position < prompt_len``; generation: the rest, indexed from 0 at the first
fed-back token) is covered iff it is ``"all"`` or one of its include selectors is set; a covered
row is kept iff (its phase is ``"all"`` or an include selector matches) and no exclude selector
matches. Prompt positions may be negative (from the end); past the end they clamp to the last
prompt token. Prompt windows follow Python slices; generation windows are ``[start, stop)`` with
``stop`` None for open-ended.
"""

from __future__ import annotations

from typing import Any, Sequence

_KINDS = ("tokens", "positions", "window")


def selected(clause: Any, prompt_len: int, position: int, token: int) -> bool:
    """Whether ``clause`` (None: every row) keeps the row at ``position`` whose input is ``token``."""
    if clause is None:
        return True
    field = clause.get if isinstance(clause, dict) else (lambda name: getattr(clause, name))
    if position < prompt_len:
        phase, index = "prompt", position

        def by_positions(values):
            return any(index == (prompt_len + v if v < 0 else min(v, prompt_len - 1))
                       for v in values)

        def by_window(window):
            return index in range(prompt_len)[slice(*window)]
    else:
        phase, index = "generation", position - prompt_len

        def by_positions(values):
            return index in values

        def by_window(window):
            return window[0] <= index and (window[1] is None or index < window[1])

    def matches(prefix: str) -> bool:
        tokens, positions, window = (field(f"{prefix}{phase}_{kind}") for kind in _KINDS)
        return bool((tokens is not None and token in tokens)
                    or (positions is not None and by_positions(positions))
                    or (window is not None and by_window(window)))

    included = field(phase) == "all" or matches("")
    return included and not matches("exclude_")


def selected_positions(clause: Any, prompt_ids: Sequence[int], gen_fed: Sequence[int]) -> set[int]:
    """Absolute positions ``clause`` keeps for one request: ``prompt_ids`` then the generated
    tokens that were fed back (all but the last sampled one)."""
    seq = list(prompt_ids) + list(gen_fed)
    return {p for p, tok in enumerate(seq) if selected(clause, len(prompt_ids), p, tok)}
