"""Host tensors whose pages fault in 2 MiB at a time.

A fresh CPU tensor of tens of megabytes is fresh pages: the first write into each 4 KiB page
faults, and the kernel zeroes it. Copying a fetched layer into prompt order or a shard's batches
into one tensor wrote into such memory, and the faults were most of the copy: on the CPU VM,
75 MB of bfloat16 rows took 28 ms by ``index_select`` into a new tensor and 7 ms into one
already touched. Marked ``MADV_HUGEPAGE`` before the first write, the same copy takes 7 ms
(transparent huge pages: the kernel's ``enabled`` mode ``madvise`` or ``always``; where it is
``never``, or off Linux, nothing changes). torch's own ``THP_MEM_ALLOC_ENABLE`` does this for
every allocation of the process, read once when torch starts: too late for a library, and not
ours to decide for the whole process.

Only tensors of ``MIN_BYTES`` or more are marked: glibc maps those on their own (its mmap
threshold grows to 32 MiB at most), so the advice goes with the mapping when the tensor is freed,
instead of splitting the heap's mapping for smaller ones.
"""

from __future__ import annotations

import ctypes
import sys

import torch

HUGE_PAGE = 2 << 20
MIN_BYTES = 32 << 20
_MADV_HUGEPAGE = 14  # Linux, every architecture

_madvise = None  # libc's madvise, once looked up (False: none)


def huge_page_span(address: int, nbytes: int) -> tuple[int, int] | None:
    """The whole huge pages inside ``[address, address + nbytes)``: (start, length), or None
    where the range holds none."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + nbytes) // HUGE_PAGE * HUGE_PAGE
    return (start, end - start) if end > start else None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                fn.restype = ctypes.c_int
                _madvise = fn
    return _madvise


def empty_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype)`` on the CPU, its whole huge pages marked
    ``MADV_HUGEPAGE`` before anything is written to them (from ``MIN_BYTES`` on). For tensors
    that are written once, right away, in full: a copy's destination."""
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    span = huge_page_span(t.data_ptr(), nbytes) if nbytes >= MIN_BYTES else None
    madvise = _libc_madvise() if span is not None else None
    if madvise:
        madvise(span[0], span[1], _MADV_HUGEPAGE)  # advice: a failure leaves small pages
    return t


def cat_on_huge_pages(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` (rows: dim 0) into :func:`empty_on_huge_pages` memory."""
    rows = sum(t.shape[0] for t in parts)
    return torch.cat(parts, out=empty_on_huge_pages((rows, *parts[0].shape[1:]), parts[0].dtype))
