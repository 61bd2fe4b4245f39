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
