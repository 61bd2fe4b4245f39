"""The host-side shape of one model step: as the runner holds it, and as the planner sees it.

The engine glue wraps each real step's runner host buffers in a ``StepBuffers`` (views, nothing
copied or checked: a steady decode step that repeats the last one is recognised from them alone,
``DecodeRepeat.advance``). Any other step is planned from its ``BatchGeometry``, from which the
planner derives every row's request and absolute position. A malformed geometry would silently
mislabel rows, so it is checked on construction and raises ValueError naming the bad field.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_capture.checks import is_int

__all__ = ["BatchGeometry", "StepBuffers"]


@dataclass(frozen=True, eq=False)
class BatchGeometry:
    """One step's rows: rows of request ``i`` are ``[query_start_loc[i], query_start_loc[i+1])``.

    Equality is identity: a fresh geometry is a fresh step, even if its numbers repeat.
    """

    req_ids: tuple[str, ...]
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    num_computed: np.ndarray  # int64 [num_reqs]; position of each request's first row
    num_rows_padded: int  # rows of the activation tensor; rows >= query_start_loc[-1] are padding
    token_ids: np.ndarray  # int32 [query_start_loc[-1]]; -1 where the host does not know the token

    def __post_init__(self):
        self.validate()

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @property
    def num_rows(self) -> int:
        """Real (unpadded) rows this step."""
        return int(self.query_start_loc[-1])

    def validate(self) -> None:
        """Check shapes, dtypes and invariants; raise ValueError naming the bad field."""
        # map(type, ...) keeps the per-request work in C: this runs on every step.
        if not isinstance(self.req_ids, tuple) or not set(map(type, self.req_ids)) <= {str}:
            raise ValueError("BatchGeometry.req_ids: expected a tuple of str")
        if len(set(self.req_ids)) != len(self.req_ids):
            raise ValueError("BatchGeometry.req_ids: duplicate request ids")
        n = len(self.req_ids)
        qsl = _array("query_start_loc", self.query_start_loc, np.int32, n + 1)
        if qsl[0] != 0:
            raise ValueError(f"BatchGeometry.query_start_loc: must start at 0, got {qsl[0]}")
        if n and np.any(qsl[1:] < qsl[:-1]):
            raise ValueError("BatchGeometry.query_start_loc: must be non-decreasing")
        computed = _array("num_computed", self.num_computed, np.int64, n)
        if n and computed.min() < 0:
            raise ValueError("BatchGeometry.num_computed: must be >= 0")
        rows = int(qsl[-1])
        padded = self.num_rows_padded
        if not is_int(padded) or padded < rows:
            raise ValueError(
                f"BatchGeometry.num_rows_padded: expected an int >= {rows} rows, got {padded!r}"
            )
        tokens = _array("token_ids", self.token_ids, np.int32, rows)
        if rows and tokens.min() < -1:
            raise ValueError("BatchGeometry.token_ids: must be >= -1 (-1 = unknown)")


def _array(name: str, value, dtype, length: int) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype != dtype or value.shape != (length,):
        got = (
            f"{value.dtype}{list(value.shape)}"
            if isinstance(value, np.ndarray)
            else type(value).__name__
        )
        raise ValueError(f"BatchGeometry.{name}: expected {np.dtype(dtype)}[{length}], got {got}")
    return value


class StepBuffers:
    """One step as the runner's host buffers hold it: views of their first ``len(req_ids)``
    requests, in the runner's dtypes, unchecked, valid until the runner's next step.

    ``token_ids`` (the host's token of each row, -1 unknown) is None where the host knows none:
    under async scheduling generated tokens exist on the device only.
    """

    __slots__ = ("req_ids", "query_start_loc", "num_computed", "num_rows_padded", "token_ids")

    def __init__(self, req_ids, query_start_loc: np.ndarray, num_computed: np.ndarray,
                 num_rows_padded: int, token_ids: np.ndarray | None = None):
        self.req_ids = tuple(req_ids)
        n = len(self.req_ids)
        self.query_start_loc = query_start_loc[: n + 1]
        self.num_computed = num_computed[:n]
        self.num_rows_padded = num_rows_padded
        self.token_ids = token_ids

    def geometry(self) -> BatchGeometry:
        """The checked geometry, its arrays copied out of the runner's buffers."""
        qsl = np.asarray(self.query_start_loc, dtype=np.int32).copy()
        tokens = self.token_ids
        return BatchGeometry(
            req_ids=self.req_ids,
            query_start_loc=qsl,
            num_computed=np.asarray(self.num_computed, dtype=np.int64).copy(),
            num_rows_padded=int(self.num_rows_padded),
            token_ids=(np.full(int(qsl[-1]), -1, dtype=np.int32) if tokens is None
                       else np.asarray(tokens, dtype=np.int32).copy()),
        )
