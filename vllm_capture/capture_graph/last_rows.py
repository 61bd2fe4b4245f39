"""Last-token hidden states stored by traced torch ops, with no capture kernel of their own.

The capture op is opaque to Inductor, so each layer that launches it adds a kernel, and a node,
to every step's graph: for the 1B's 16 layers of a decode step the largest part of last-token
capture's cost. A store written as torch ops in the layer's forward is traced into vLLM's compiled
graph instead, where Inductor fuses it into the next layer's add + RMSNorm kernel, which sums the
residual stream anyway (on an H100, session 53: no kernel and no graph node added, and the layers
still share one compiled piece).

So a ``last`` stream of hidden states takes its rows from these stores: each layer's forward puts
the residual stream of every token of the step into ``rows[dest[token]]``, where ``dest`` sends a
request's last selected token of the step to the request's reduction slot and every other token to
one of ``SINK_ROWS`` rows after the slots (spread, so that a long prefill does not write one row
from every program). The capture op still runs at one site (the stream's first layer) for the
slots' labels and row counts, which the host reads with every layer's rows.

Each layer stores into a tensor of its own: one tensor for every layer (or views of one)
miscompiled in vLLM's CPU engine (session 53; the greedy tokens changed).

The stores run in every forward Dynamo traces (switched off, ``dest`` sends every token to the
sinks), and in eager forwards only while a stream uses them (``LastRowPlan.active``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_capture.capture_graph.uploads import upload

#: rows after the reduction slots that take the tokens a step does not reduce (token t: row
#: ``slots + t % SINK_ROWS``).
SINK_ROWS = 64


def store_last_rows(rows: torch.Tensor, dest: torch.Tensor, hidden: torch.Tensor,
                    residual: torch.Tensor | None) -> None:
    """Put each token's residual stream (``hidden + residual``) into ``rows[dest[token]]``.

    A bf16 or fp16 sum is made in fp32 and rounded once, in eager torch and in Inductor's code
    alike: the row the capture kernel's ``MODE_LAST`` keeps in fp32 and a read then rounds to the
    site's dtype, bit for bit."""
    value = hidden if residual is None else hidden + residual
    rows.index_put_((dest[:hidden.shape[0]],), value.to(rows.dtype))


def sink_rows(tokens: np.ndarray, slot_count: int) -> np.ndarray:
    """The sink row of each token in ``tokens`` (its index in the step): ``slot_count + t %
    SINK_ROWS``, after the slots."""
    return slot_count + tokens % SINK_ROWS


@dataclass
class LastRowPlan:
    """Where each token of the step goes in every layer's last-row tensor (``dest``, shared by
    the layers of one component), and whether a stream reads those tensors (``active``)."""

    dest: torch.Tensor  # int64 [max tokens], device; registered on every instrumented layer
    slot_count: int
    active: bool = False
    # The host image of ``dest``, and the tokens it sends to slots (the rest go to sinks).
    host: np.ndarray = field(init=False)
    tokens: np.ndarray = field(init=False)
    targets: np.ndarray = field(init=False)
    uploads: int = 0

    def __post_init__(self):
        self.host = sink_rows(np.arange(self.dest.shape[0], dtype=np.int64), self.slot_count)
        self.tokens = self.targets = np.zeros(0, dtype=np.int64)

    @classmethod
    def allocate(cls, tokens: int, slot_count: int, device: torch.device) -> "LastRowPlan":
        plan = cls(torch.empty(tokens, dtype=torch.int64, device=device), slot_count)
        plan.dest.copy_(torch.from_numpy(plan.host))  # every token to its sink
        return plan

    def rows_for(self, width: int, dtype: torch.dtype) -> torch.Tensor:
        """A layer's tensor: one row per slot, then the sinks."""
        return torch.zeros(self.slot_count + SINK_ROWS, width, dtype=dtype,
                           device=self.dest.device)

    def point(self, row_start: np.ndarray, row_count: np.ndarray, slots: np.ndarray) -> None:
        """Send each segment's last row to its slot (a ``MODE_LAST`` plan's segments), every other
        token to a sink; copies ``dest`` to the device only where it changes."""
        valid = (row_count > 0) & (slots >= 0) & (slots < self.slot_count)
        tokens = (np.asarray(row_start, dtype=np.int64) + row_count - 1)[valid]
        targets = np.asarray(slots, dtype=np.int64)[valid]
        if np.array_equal(tokens, self.tokens) and np.array_equal(targets, self.targets):
            return
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= len(self.host)):
            raise ValueError(f"last rows {tokens.min()}..{tokens.max()} outside the "
                             f"{len(self.host)} tokens of dest")
        self.host[self.tokens] = sink_rows(self.tokens, self.slot_count)
        self.host[tokens] = targets
        end = 1 + max(self.tokens.max(initial=-1), tokens.max(initial=-1))
        self.tokens, self.targets = tokens, targets
        if end > 0:
            upload(self.dest[:end], self.host[:end])
            self.uploads += 1

    def clear(self) -> None:
        """Every token to a sink: no slot is written until the next ``point``."""
        empty = np.zeros(0, dtype=np.int64)
        self.point(empty, empty, empty)
