"""A torch dtype's name as the project writes it everywhere: manifests, the command line, and the
kernel compile child's arguments (``bfloat16``, not ``torch.bfloat16``)."""

from __future__ import annotations

import torch


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
