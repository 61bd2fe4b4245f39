"""Row selection: the SelectSpec where-clause and the per-step row planner (numpy + stdlib only)."""

from .geometry import BatchGeometry, StepBuffers
from .planner import (
    DecodeRepeat,
    RequestTrack,
    RowPlan,
    SegmentPlan,
    Skipped,
    TokenCondition,
    plan_rows,
    plan_segments,
)
from .spec import PHASE_ALL, UNKNOWN_TOKEN, RowMatch, SelectSpec

__all__ = [
    "PHASE_ALL",
    "UNKNOWN_TOKEN",
    "BatchGeometry",
    "DecodeRepeat",
    "RequestTrack",
    "RowMatch",
    "RowPlan",
    "SegmentPlan",
    "SelectSpec",
    "Skipped",
    "StepBuffers",
    "TokenCondition",
    "plan_rows",
    "plan_segments",
]
