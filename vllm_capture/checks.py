"""The one test of an integer argument, and of a count, shared by every entry point's checks."""

from __future__ import annotations

import numbers


def is_int(value) -> bool:
    """An integer, numpy's included; not a bool, which is an int subclass: True as a count,
    layer, position or token id is always a caller's bug. A plain int is asked first: the ABC
    check takes about 1 us, for each of a selection's token ids."""
    return type(value) is int or (isinstance(value, numbers.Integral)
                                  and not isinstance(value, bool))


def as_count(name: str, value, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= 1 (numpy's too), or ``error`` naming ``name``: the API raises
    ValueError, the command line its UsageError."""
    if not is_int(value) or value < 1:
        raise error(f"{name}: expected an int >= 1, got {value!r}")
    return int(value)
