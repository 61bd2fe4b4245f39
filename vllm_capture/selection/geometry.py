"""BatchGeometry: the host-side shape of one model step, as the planner sees it.

The engine glue builds one per real step from the runner's host buffers; the planner derives every
row's request and absolute position from it. A malformed geometry would silently mislabel rows,
so it is checked on construction and raises ValueError naming the bad field.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

__all__ = ["BatchGeometry"]


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
        if isinstance(padded, bool) or not isinstance(padded, numbers.Integral) or padded < rows:
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
