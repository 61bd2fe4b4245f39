"""The one test of an integer argument, shared by every entry point's checks."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer, numpy's included; not a bool, which is an int subclass: True as a count,
    layer, position or token id is always a caller's bug."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
