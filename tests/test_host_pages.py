"""``host_pages``: the huge pages inside a range, and the advice given before a tensor is written."""

from __future__ import annotations

import pytest
import torch

import vllm_capture.host_pages as host_pages
from vllm_capture.host_pages import HUGE_PAGE, cat_on_huge_pages, empty_on_huge_pages, huge_page_span


@pytest.mark.parametrize("address, nbytes, expected", [
    (0, HUGE_PAGE, (0, HUGE_PAGE)),
    (1, HUGE_PAGE, None),                      # straddles two pages, holds neither
    (1, 2 * HUGE_PAGE, (HUGE_PAGE, HUGE_PAGE)),
    (HUGE_PAGE - 64, 3 * HUGE_PAGE + 64, (HUGE_PAGE, 3 * HUGE_PAGE)),
    (5 * HUGE_PAGE, 0, None),
    (5 * HUGE_PAGE + 4096, 10 * HUGE_PAGE, (6 * HUGE_PAGE, 9 * HUGE_PAGE)),
])
def test_huge_page_span_is_the_whole_pages_inside(address, nbytes, expected):
    assert huge_page_span(address, nbytes) == expected


def _brute_span(address: int, nbytes: int):
    pages = [p for p in range(address // HUGE_PAGE, (address + nbytes) // HUGE_PAGE + 1)
             if p * HUGE_PAGE >= address and (p + 1) * HUGE_PAGE <= address + nbytes]
    return (pages[0] * HUGE_PAGE, len(pages) * HUGE_PAGE) if pages else None


def test_huge_page_span_matches_a_page_by_page_count():
    import random

    rng = random.Random(0)
    for _ in range(2000):
        address = rng.randrange(0, 64 * HUGE_PAGE)
        nbytes = rng.randrange(0, 8 * HUGE_PAGE)
        assert huge_page_span(address, nbytes) == _brute_span(address, nbytes)


def test_only_tensors_from_min_bytes_on_are_marked(monkeypatch):
    marked = []
    monkeypatch.setattr(host_pages, "_madvise", lambda *a: marked.append(a) or 0)
    small = empty_on_huge_pages((host_pages.MIN_BYTES // 4 - 1,), torch.float32)
    assert marked == [] and small.shape == (host_pages.MIN_BYTES // 4 - 1,)
    big = empty_on_huge_pages((host_pages.MIN_BYTES // 2,), torch.bfloat16)
    assert big.dtype == torch.bfloat16 and big.is_contiguous() and big.device.type == "cpu"
    assert len(marked) == 1
    start, length, advice = marked[0]
    assert (start, length) == huge_page_span(big.data_ptr(), host_pages.MIN_BYTES)
    assert advice == 14  # MADV_HUGEPAGE


def test_the_advice_reaches_the_kernel_and_the_tensor_holds_what_is_written():
    """The real madvise (Linux): a refused call would return -1; the memory stays usable."""
    import os

    madvise = host_pages._libc_madvise()
    if not madvise or not os.path.isdir("/sys/kernel/mm/transparent_hugepage"):
        pytest.skip("no libc madvise, or a kernel without transparent huge pages")
    t = empty_on_huge_pages((host_pages.MIN_BYTES // 4,), torch.float32)
    span = huge_page_span(t.data_ptr(), host_pages.MIN_BYTES)
    assert madvise(span[0], span[1], 14) == 0
    t.copy_(torch.arange(t.numel(), dtype=torch.float32))
    assert t[-1].item() == t.numel() - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
def test_cat_on_huge_pages_is_torch_cat(monkeypatch, dtype):
    marked = []
    monkeypatch.setattr(host_pages, "MIN_BYTES", 1)
    monkeypatch.setattr(host_pages, "_madvise", lambda *a: marked.append(a) or 0)
    parts = [torch.arange(n * 3 * 2 ** 18).reshape(n, 3 * 2 ** 18).to(dtype) for n in (2, 0, 5)]
    parts.append(torch.ones(7, 6 * 2 ** 18).to(dtype)[:, ::2])  # a strided part
    out = cat_on_huge_pages(parts)
    assert torch.equal(out, torch.cat(parts)) and out.is_contiguous()
    assert len(marked) == 1  # 14 rows of 3 MiB or more: whole huge pages inside
