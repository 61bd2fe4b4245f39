"""Per-stream capture configuration, validated when a stream is enabled.

Everything here arrives through an RPC from a client, so each field is
checked up front with a message naming it: a bad value must fail
``start_capture``, not a forward pass later.
"""

import inspect
import logging
from typing import TYPE_CHECKING, Any

import torch

from vllm_capture.checks import is_int

if TYPE_CHECKING:
    from vllm_capture.selection import SelectSpec

logger = logging.getLogger("vllm_capture")

_STORAGE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
_REDUCTIONS = ("all", "last", "mean")

# The unbounded-capture warning is advice, not an alarm: capture_batches()
# enables a stream per batch, and one notice per process is enough.
_warned_unbounded = False


def storage_dtype_name(dtype: torch.dtype) -> str:
    """The name a storage dtype goes by on the wire and in status (``bfloat16``)."""
    return _DTYPE_NAMES[dtype]


def resolve_storage_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a user's storage dtype spelling to one the wire can carry.

    Only float32, float16 and bfloat16 have a wire encoding, so anything else
    is refused here rather than at fetch time.
    """
    if isinstance(name, torch.dtype):
        dtype = name
    elif isinstance(name, str):
        key = name.strip().lower()
        dtype = _STORAGE_DTYPES.get(key.removeprefix("torch."))
    else:
        dtype = None
    if dtype not in _DTYPE_NAMES:
        raise ValueError(
            "dtype must be float32, float16 or bfloat16 (also fp32, fp16, half, "
            f"bf16, 'torch.<name>' or a torch.dtype), got {name!r}"
        )
    return dtype


def _is_int(value: Any, limit: int) -> bool:
    """An int (numpy's too; bool is not one) in ``[0, limit)``: the wire carries it (vLLM's
    encoder refuses an int past 2**64, naming no field)."""
    return is_int(value) and 0 <= value < limit


class StreamConfig:
    """Per-stream capture configuration.

    Row selection uses the shared ``SelectSpec`` where-clause language
    (``select``: a SelectSpec or its ``to_wire()`` dict, kept decoded in ``select_spec``;
    ``select`` reads back its wire dict) —
    the same clause semantics steering resolves, so "which rows to capture"
    and "which tokens to steer" mean the same thing. ``reduce`` applies a within-sample reduction ("all" | "last" |
    "mean"); ``budget_rows`` caps the rows held per layer.
    """

    def __init__(
        self,
        layers: list[int] | None = None,
        dtype: str | torch.dtype | None = None,
        reduce: str = "all",
        select: "SelectSpec | dict | None" = None,
        budget_rows: int | None = None,
    ):
        if not isinstance(reduce, str) or reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be 'all', 'last' or 'mean', got {reduce!r}")
        if reduce != "all" and select is not None:
            raise ValueError(
                "row selection cannot combine with the 'last'/'mean' "
                "reductions; use reduce='all' with a select clause"
            )
        spec = None if select is None else _select_spec(select)
        if layers is not None:
            if not isinstance(layers, (list, tuple, set, frozenset)) or not all(
                _is_int(layer, 2 ** 31) for layer in layers
            ):
                raise ValueError(
                    f"layers must be None or a list of nonnegative ints (below 2**31), got "
                    f"{layers!r}"
                )
            if not layers:
                # An empty list would enable a stream that can never capture.
                raise ValueError("layers must name at least one layer, or be None for all")
        if budget_rows is not None and not _is_int(budget_rows, 2 ** 63):
            raise ValueError(
                f"budget_rows must be None or a nonnegative int (below 2**63), got {budget_rows!r}"
            )
        self.layers = set(map(int, layers)) if layers is not None else None
        self.dtype = resolve_storage_dtype(dtype) if dtype is not None else None
        self.reduce = reduce
        # Decoded once: every request the stream opens shares it (22 us a decode).
        self.select_spec = spec
        self.budget_rows = None if budget_rows is None else int(budget_rows)

    @property
    def select(self) -> dict | None:
        """The selection's wire dict (status replies, ``to_dict``), from ``select_spec``."""
        return None if self.select_spec is None else self.select_spec.to_wire()

    @property
    def selects_rows(self) -> bool:
        """Whether a source-side row selection (not a reduction) is set."""
        return self.select_spec is not None

    def to_dict(self) -> dict[str, Any]:
        """Msgpack-safe summary that is also valid ``StreamConfig`` kwargs: a client can
        re-enable an identical stream from it (status RPCs report only ``reduce`` and
        ``select``)."""
        return {
            "layers": sorted(self.layers) if self.layers is not None else None,
            "dtype": storage_dtype_name(self.dtype) if self.dtype is not None else None,
            "reduce": self.reduce,
            "select": self.select,
            "budget_rows": self.budget_rows,
        }


# The keys a stream's configuration takes (``start_capture``'s keywords).
STREAM_OPTIONS = frozenset(inspect.signature(StreamConfig).parameters)


def _select_spec(select: Any) -> "SelectSpec":
    """Validate at enable time instead of failing mid-forward. A SelectSpec needs no decoding
    (an engine in the client's process hands the worker the caller's object); either way the
    result is the process's one instance of that clause (``SelectSpec.interned``)."""
    from vllm_capture.selection import SelectSpec

    if isinstance(select, SelectSpec):
        return select.interned()
    try:
        return SelectSpec.from_wire(select).interned()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"select is not a valid SelectSpec wire dict: {exc}") from exc


def warn_if_unbounded(config: StreamConfig) -> None:
    """Where a stream is enabled (the worker; a client checking a config does not warn)."""
    global _warned_unbounded
    if _warned_unbounded or not (config.reduce == "all" and config.select_spec is None
                                 and config.budget_rows is None):
        return
    _warned_unbounded = True
    logger.warning(
        "Capture enabled with reduce='all', no select clause and "
        "no budget_rows: every position of every request "
        "accumulates in CPU memory. Prefer a select clause, a "
        "reduction, or an explicit budget for long corpora."
    )
