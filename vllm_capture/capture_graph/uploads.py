"""Host-to-device copies of what the host writes each step (plans, last-row destinations)."""

from __future__ import annotations

import numpy as np
import torch


def upload(device_view: torch.Tensor, host: np.ndarray) -> None:
    """Copy ``host`` into ``device_view`` on the current stream, without waiting for it.

    A fresh pinned tensor per copy: the caching host allocator keeps it alive until the
    non-blocking copy has run, so the step never waits for the copy."""
    if device_view.is_cuda:
        device_view.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
    else:
        device_view.copy_(torch.from_numpy(host))
