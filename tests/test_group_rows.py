"""``group_rows``: fetched rows into prompt order, checked against a per-row brute force.

The brute force matches every row label against every client id with ``match_capture_request_id``
(the definition); ``group_rows`` decides each distinct label once, for all layers.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_capture.api import group_rows
from vllm_capture.session.wire import CaptureMeta, match_capture_request_id


def _brute_owner(labels: list[str], request_ids: list[str]) -> list[int]:
    owner = []
    for label in labels:
        hits = [i for i, client in enumerate(request_ids) if match_capture_request_id(label, client)]
        assert len(hits) <= 1
        owner.append(hits[0] if hits else -1)
    return owner


def _fetched(rng: random.Random, request_ids: list[str], layers=(0, 3)):
    """Rows of every request in a shuffled batch order, labelled as the engine labels them
    (client id plus an 8-hex suffix, or the bare id when suffixing is off)."""
    rows = []
    for i, client in enumerate(request_ids):
        label = client if rng.random() < 0.3 else f"{client}-{rng.getrandbits(32):08x}"
        rows += [(label, position, 100 * i + position) for position in range(rng.randint(0, 5))]
    rng.shuffle(rows)
    labels = [r[0] for r in rows]
    meta = CaptureMeta(labels, torch.tensor([r[1] for r in rows], dtype=torch.int32),
                       torch.tensor([r[2] for r in rows], dtype=torch.int32))
    values = torch.randn(len(rows), 5)
    return {layer: values + layer for layer in layers}, {layer: meta for layer in layers}, rows


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("with_ends", [False, True])
def test_rows_group_by_prompt_then_position_like_the_brute_force(seed, with_ends):
    rng = random.Random(seed)
    # Ids that prefix one another ("1" and "12"), ids with dashes and hex-like tails.
    pool = ["1", "12", "12-x", "a-b", "req", "deadbeef", "7-0000000g", "x" * 12]
    request_ids = rng.sample(pool, rng.randint(1, len(pool)))
    tensors, meta, rows = _fetched(rng, request_ids)
    ends = [rng.randint(0, 6) for _ in request_ids] if with_ends else None
    grouped, grouped_meta, offsets = group_rows(tensors, meta, request_ids, ends)
    owner = np.asarray(_brute_owner([r[0] for r in rows], request_ids))
    kept = [j for j in range(len(rows)) if ends is None or rows[j][1] < ends[owner[j]]]
    order = sorted(kept, key=lambda j: (owner[j], rows[j][1], j))
    owner = owner[kept]
    for layer in tensors:
        assert torch.equal(grouped[layer], tensors[layer][order])
        assert grouped_meta[layer].req_ids == [rows[j][0] for j in order]
        assert grouped_meta[layer].positions.tolist() == [rows[j][1] for j in order]
        assert grouped_meta[layer].token_ids.tolist() == [rows[j][2] for j in order]
    counts = np.bincount(owner, minlength=len(request_ids))
    assert offsets == [0, *np.cumsum(counts).tolist()]


def test_rows_in_prompt_order_are_copied_all_the_same():
    """A view would keep the fetch's /dev/shm file from the pool while the caller holds it."""
    labels = ["a-0123abcd", "a-0123abcd", "b"]
    meta = {0: CaptureMeta(labels, torch.tensor([0, 1, 0]), torch.tensor([5, 6, 7]))}
    tensors = {0: torch.randn(3, 4)}
    grouped, grouped_meta, offsets = group_rows(tensors, meta, ["a", "b"])
    assert torch.equal(grouped[0], tensors[0]) and offsets == [0, 2, 3]
    assert grouped[0].untyped_storage().data_ptr() != tensors[0].untyped_storage().data_ptr()


def test_rows_of_no_prompt_and_rows_of_two_prompts_raise():
    tensors = {0: torch.zeros(2, 3)}
    meta = {0: CaptureMeta(["other-0123abcd", "a-0123abcd"], torch.tensor([0, 0]),
                           torch.tensor([1, 1]))}
    with pytest.raises(RuntimeError, match="not part of this capture"):
        group_rows(tensors, meta, ["a"])
    meta = {0: CaptureMeta(["a-0123abcd"], torch.tensor([0]), torch.tensor([1]))}
    with pytest.raises(RuntimeError, match="more than one request id"):
        group_rows({0: torch.zeros(1, 3)}, meta, ["a", "a-0123abcd"])


def test_layers_with_different_rows_raise():
    labels = ["a-0123abcd", "b-0123abcd"]
    meta = {0: CaptureMeta(labels, torch.tensor([0, 0]), torch.tensor([1, 2])),
            1: CaptureMeta(labels[:1] * 2, torch.tensor([0, 1]), torch.tensor([1, 2]))}
    with pytest.raises(RuntimeError, match="differ from the other layers"):
        group_rows({0: torch.zeros(2, 3), 1: torch.zeros(2, 3)}, meta, ["a", "b"])


def test_each_distinct_label_is_decided_once_for_every_layer(monkeypatch):
    import vllm_capture.api as api

    rng = random.Random(7)
    request_ids = [f"r{i}" for i in range(12)]
    tensors, meta, rows = _fetched(rng, request_ids, layers=tuple(range(16)))
    calls = []

    def counted(label, client):
        calls.append(label)
        return match_capture_request_id(label, client)

    monkeypatch.setattr(api, "match_capture_request_id", counted)
    grouped, _, offsets = group_rows(tensors, meta, request_ids)
    distinct = {r[0] for r in rows}
    assert set(calls) == distinct and len(calls) <= 2 * len(distinct)  # not once a layer
    assert sorted(grouped) == list(range(16)) and offsets[-1] == len(rows)


def _reordered(meta: CaptureMeta, values: torch.Tensor, perm: list[int]):
    idx = torch.tensor(perm)
    return (CaptureMeta([meta.req_ids[j] for j in perm], meta.positions[idx].clone(),
                        meta.token_ids[idx].clone()), values[idx])


@pytest.mark.parametrize("seed", range(5))
def test_layers_fetched_in_other_orders_or_with_their_own_labels_group_alike(seed):
    """Each fetched layer brings labels of its own: equal to the layer before (the fast path),
    or the same rows in another order (sorted and compared again)."""
    rng = random.Random(seed)
    request_ids = [f"r{i}" for i in range(6)]
    tensors, meta, rows = _fetched(rng, request_ids, layers=(0,))
    base_meta, base = meta[0], tensors[0]
    n = len(rows)
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    fetched = {0: (base_meta, base),
               1: _reordered(base_meta, base + 1, list(range(n))),  # equal labels, own objects
               2: _reordered(base_meta, base + 2, shuffled),
               3: _reordered(base_meta, base + 3, shuffled)}
    grouped, grouped_meta, offsets = group_rows({k: v[1] for k, v in fetched.items()},
                                                {k: v[0] for k, v in fetched.items()},
                                                request_ids)
    owner = np.asarray(_brute_owner([r[0] for r in rows], request_ids))
    order = sorted(range(n), key=lambda j: (owner[j], rows[j][1], j))
    for layer in fetched:
        assert torch.equal(grouped[layer], base[order] + layer)
        assert grouped_meta[layer].req_ids == [rows[j][0] for j in order]
        assert grouped_meta[layer].positions.tolist() == [rows[j][1] for j in order]
        assert grouped_meta[layer].token_ids.tolist() == [rows[j][2] for j in order]
    # Every layer's labels are its own: a caller may change one layer's without the others'.
    grouped_meta[0].positions[:] = -5
    grouped_meta[0].req_ids.clear()
    assert grouped_meta[1].req_ids == [rows[j][0] for j in order]
    assert grouped_meta[1].positions.tolist() == [rows[j][1] for j in order]


def test_a_layer_whose_token_ids_alone_differ_raises():
    labels = ["a-0123abcd", "b-0123abcd"]
    meta = {0: CaptureMeta(labels, torch.tensor([0, 0]), torch.tensor([1, 2])),
            1: CaptureMeta(list(labels), torch.tensor([0, 0]), torch.tensor([1, 3]))}
    with pytest.raises(RuntimeError, match="differ from the other layers"):
        group_rows({0: torch.zeros(2, 3), 1: torch.zeros(2, 3)}, meta, ["a", "b"])


def test_large_layers_are_copied_into_huge_page_memory(monkeypatch):
    import vllm_capture.host_pages as host_pages

    marked = []
    monkeypatch.setattr(host_pages, "MIN_BYTES", 1)
    monkeypatch.setattr(host_pages, "_madvise", lambda start, length, advice: marked.append(
        (start, length, advice)) or 0)
    rng = random.Random(3)
    request_ids = [f"r{i}" for i in range(4)]
    _, meta, rows = _fetched(rng, request_ids, layers=(0,))
    values = torch.randn(len(rows), 1 << 19)  # 2 MiB a row: every row spans a huge page
    grouped, _, _ = group_rows({0: values}, meta, request_ids)
    owner = np.asarray(_brute_owner([r[0] for r in rows], request_ids))
    order = sorted(range(len(rows)), key=lambda j: (owner[j], rows[j][1], j))
    assert torch.equal(grouped[0], values[order])
    start = grouped[0].data_ptr()
    assert len(marked) == 1
    first, length, advice = marked[0]
    assert advice == 14 and first % (2 << 20) == 0 and length % (2 << 20) == 0
    assert start <= first and first + length <= start + grouped[0].numel() * 4
    assert length >= (len(rows) - 1) * (2 << 20)
