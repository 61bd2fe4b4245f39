"""The shared-memory fetch path: the probe handshake, the file round trip and its refusals.

Replies are built the way the worker builds them (``StreamStore.serialize(raw_data=True)``, then
``shm.write_reply``); the bytes path (``shared=False``, what a client on another host gets) is
the reference every shared-memory result must equal bit for bit.
"""

from __future__ import annotations

import collections
import errno
import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import vllm_capture.session.config as config_module
import vllm_capture.session.store as store_module
from vllm_capture.api import join_shards
from vllm_capture.session import StreamConfig, StreamStore, shm
from vllm_capture.session.components import ATTENTION_HEADS
from vllm_capture.session.store import FetchedRows
from vllm_capture.session.wire import deserialize_captured

pytestmark = pytest.mark.skipif(not os.access(shm.SHM_DIR, os.W_OK), reason="no writable /dev/shm")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _quiet_unbounded_warning(monkeypatch):
    monkeypatch.setattr(config_module, "_warned_unbounded", True)


@pytest.fixture(autouse=True)
def shm_dir(monkeypatch):
    """A private directory in /dev/shm for each test, so its pool is its own."""
    path = tempfile.mkdtemp(prefix="vllm-capture-test-", dir="/dev/shm")
    monkeypatch.setattr(shm, "SHM_DIR", path)
    monkeypatch.setattr(shm, "_pooled", set())
    monkeypatch.setattr(shm, "_probe", None)  # a probe made earlier lives in the real /dev/shm
    monkeypatch.setattr(shm, "_kept", {})
    yield path
    shm.drop_spare()
    for mapped in shm._kept.values():
        shm._close(mapped)
    gc.collect()  # release mappings before the directory goes
    shm.settle()
    shutil.rmtree(path, ignore_errors=True)


def _store(layers=(0, 1, 2), width=6, dtype=torch.bfloat16, requests=3, steps=(5, 1, 1, 1),
           seed=0) -> StreamStore:
    """A store holding, per layer, a prefill step then decode steps of ``requests`` requests
    (distinct random values everywhere, so any misplaced row shows)."""
    g = torch.Generator().manual_seed(seed)
    store = StreamStore(StreamConfig())
    index = [store.request_index(f"req{r}-0123abcd") for r in range(requests)]
    position = [0] * requests
    for rows in steps:
        meta = []
        for r in reversed(range(requests)):  # the store regroups rows by request
            meta += [[index[r], position[r] + i, 7 * r + i] for i in range(rows)]
            position[r] += rows
        meta = torch.tensor(meta, dtype=torch.int32)
        values = {layer: (torch.randn(len(meta), width, generator=g) * 100).to(dtype)
                  for layer in layers}
        store.append_layers(values, meta, {layer: f"model.layers.{layer}" for layer in layers})
    return store


def _reply(store, rank=0, tp=1, **fetch):
    data = store.serialize(raw_data=True, **fetch)
    return {"tp_rank": rank, "tp_size": tp, "layers": {str(k): v for k, v in data.items()}}


def _via_both(make_store, **fetch):
    """``(via shared memory, via bytes)``, each decoded, from two identical stores."""
    via_file = shm.write_reply(_reply(make_store(), **fetch))
    via_bytes = shm.write_reply(_reply(make_store(), **fetch), shared=False)
    assert "shm_path" in via_file and "shm_path" not in via_bytes
    assert all(type(v["data"]) is bytes for v in via_bytes["layers"].values())
    return (deserialize_captured(shm.read_replies([via_file])[0]["layers"]),
            deserialize_captured(via_bytes["layers"]))


def _assert_same(got, want):
    (got_t, got_m), (want_t, want_m) = got, want
    assert sorted(got_t) == sorted(want_t)
    for layer in want_t:
        assert got_t[layer].dtype == want_t[layer].dtype
        assert got_t[layer].shape == want_t[layer].shape
        # bit for bit: compare the raw bits, not values (NaN, -0.0)
        assert got_t[layer].view(torch.uint8).equal(want_t[layer].view(torch.uint8))
        assert got_m[layer].req_ids == want_m[layer].req_ids
        assert torch.equal(got_m[layer].positions, want_m[layer].positions)
        assert torch.equal(got_m[layer].token_ids, want_m[layer].token_ids)


def _shm_files() -> set[str]:
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(shm.ROWS)}


def _pool() -> list[str]:
    return sorted(f for f in os.listdir(shm.SHM_DIR) if f.startswith(shm.FREE))


def _inode(path: str) -> int:
    return os.stat(path).st_ino


def _recording_populate(monkeypatch) -> list[tuple[int, int, str]]:
    """``(address, bytes, thread name)`` of every populate call from now on."""
    calls, real = [], shm._populate_range
    monkeypatch.setattr(shm, "_populate_range", lambda address, length: calls.append(
        (address, length, threading.current_thread().name)) or real(address, length))
    return calls


@pytest.mark.parametrize("large_copy", [None, 0], ids=["numpy-copies", "torch-copies"])
@pytest.mark.parametrize("steps", [(5, 1, 1, 1), (1,) * 12, (4,)],
                         ids=["prefill+decode", "decode-scatter", "one-chunk"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shared_memory_round_trip_equals_the_bytes_path(monkeypatch, dtype, steps, large_copy):
    if large_copy is not None:
        monkeypatch.setattr(store_module, "_LARGE_COPY", large_copy)
    got, want = _via_both(lambda: _store(dtype=dtype, steps=steps, requests=10))
    _assert_same(got, want)
    assert len(want[0]) == 3 and all(t.dtype == dtype for t in got[0].values())
    assert len(_shm_files()) == 1  # held by the tensors
    del got
    gc.collect()
    assert not _shm_files() and len(_pool()) == 1


def test_request_subsets_with_clear_selected_match_the_bytes_path():
    stores = [_store(requests=4), _store(requests=4)]
    for req_ids, wanted in ((["req2"], {2}), (["req0-0123abcd", "req3"], {0, 3}), (None, {1})):
        replies = [_reply(s, req_ids=req_ids, clear_selected=True) for s in stores]
        got = deserialize_captured(shm.read_replies([shm.write_reply(replies[0])])[0]["layers"])
        want = deserialize_captured(shm.write_reply(replies[1], shared=False)["layers"])
        _assert_same(got, want)
        assert set(got[1][0].req_ids) == {f"req{r}-0123abcd" for r in wanted}
    assert all(s.serialize() == {} for s in stores)  # everything was drained


def test_rows_stay_valid_when_the_store_changes_before_the_copy():
    """The worker copies after serialize returned (and released the lock): removing, compacting
    or appending rows meanwhile must not change what the reply carries."""
    want = deserialize_captured(_store(requests=4).serialize(req_ids=["req1", "req2"]))
    store = _store(requests=4)
    reply = _reply(store, req_ids=["req1", "req2"], clear_selected=True)
    store.serialize(req_ids=["req0"], clear_selected=True)  # compacts the shared chunks
    store.clear()
    _store(requests=4, seed=1)  # other allocations reuse freed memory
    _assert_same(deserialize_captured(shm.read_replies([shm.write_reply(reply)])[0]["layers"]),
                 want)


def test_mixed_dtypes_in_one_layer_promote_on_both_paths():
    def make():
        store = StreamStore(StreamConfig())
        a, b = store.request_index("a"), store.request_index("b")
        g = torch.Generator().manual_seed(3)
        for index, dtype in ((a, torch.bfloat16), (b, torch.float16), (a, torch.bfloat16)):
            meta = torch.tensor([[index, p, p] for p in range(3)], dtype=torch.int32)
            store.append(0, torch.randn(3, 5, generator=g).to(dtype), meta, "l0")
        return store

    got, want = _via_both(make)
    _assert_same(got, want)
    assert got[0][0].dtype == torch.float32 and got[0][0].shape == (9, 5)
    # promoted exactly: the stored bf16/fp16 values, in wire order (request a's rows first)
    rows = list(make().chunks[0].values())
    expected = torch.cat([rows[0].tensor.float(), rows[2].tensor.float(), rows[1].tensor.float()])
    assert torch.equal(got[0][0], expected)


def test_layers_of_odd_sizes_are_aligned_in_the_file():
    def make():
        store = StreamStore(StreamConfig())
        a = store.request_index("a")
        g = torch.Generator().manual_seed(4)
        for layer, (rows, dtype) in enumerate([(3, torch.float16), (1, torch.float32),
                                               (5, torch.bfloat16), (2, torch.float32)]):
            meta = torch.tensor([[a, p, p] for p in range(rows)], dtype=torch.int32)
            store.append(layer, torch.randn(rows, 3, generator=g).to(dtype), meta, f"l{layer}")
        return store

    reply = shm.write_reply(_reply(make()))
    assert all(v["shm_offset"] % shm.ALIGN == 0 for v in reply["layers"].values())
    got = deserialize_captured(shm.read_replies([reply])[0]["layers"])
    want = deserialize_captured(shm.write_reply(_reply(make()), shared=False)["layers"])
    _assert_same(got, want)


def test_returned_tensors_are_writable_views_independent_of_the_file():
    reply = shm.write_reply(_reply(_store(dtype=torch.float32)))
    path = reply["shm_path"]
    with open(path, "rb") as f:
        shm.read_replies([reply])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. torch's "non-writable array" warning
            tensors, _ = deserialize_captured(reply["layers"])
        original = tensors[0].clone()
        file_before = f.read()
        for t in tensors.values():
            t.fill_(-1.0)
        f.seek(0)
        assert f.read() == file_before  # a private mapping: writes never reach the file
    assert all(bool((t == -1.0).all()) for t in tensors.values())
    # Not copied: the tensors are the mapping read_reply handed to the decoder.
    assert (np.frombuffer(reply["layers"]["0"]["data"], dtype=np.float32) == -1.0).all()
    assert not torch.equal(original, tensors[0])
    # The tensors outlive the reply; the file waits for the last of them, then joins the pool.
    del reply
    gc.collect()
    assert tensors[1].sum().item() == -tensors[1].numel() and os.path.exists(path)
    del tensors, original, t
    gc.collect()
    assert not os.path.exists(path) and len(_pool()) == 1


def test_bytes_path_tensors_own_their_memory():
    reply = shm.write_reply(_reply(_store()), shared=False)
    tensors, _ = deserialize_captured(reply["layers"])
    data = reply["layers"]["0"]["data"]
    tensors[0].zero_()
    assert any(data)  # the msgpack-style bytes are untouched


def test_not_enough_space_falls_back_to_bytes(monkeypatch):
    before = _shm_files()
    want = deserialize_captured(shm.write_reply(_reply(_store()), shared=False)["layers"])
    monkeypatch.setattr(shm.os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    reply = shm.write_reply(_reply(_store()))
    assert "shm_path" not in reply and _shm_files() == before
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def _full(fd, offset, length):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("kernel", ["populates", "cannot populate"])
def test_a_full_dev_shm_at_reservation_falls_back_to_bytes_and_leaves_no_file(monkeypatch, kernel):
    before = _shm_files()
    # What MADV_POPULATE_WRITE answers where tmpfs has no page left (EFAULT: "would SIGBUS"), and
    # what a kernel before 5.14 answers (EINVAL), after which posix_fallocate reserves.
    monkeypatch.setattr(shm, "_populate_range", lambda address, length: (
        errno.EFAULT if kernel == "populates" else errno.EINVAL))
    monkeypatch.setattr(shm.os, "posix_fallocate", _full)
    reply = shm.write_reply(_reply(_store()))
    assert "shm_path" not in reply and _shm_files() == before
    assert all(type(v["data"]) is bytes for v in reply["layers"].values())


def test_a_kernel_without_populate_reserves_with_fallocate_and_still_shares_the_file(monkeypatch):
    reserved = []
    monkeypatch.setattr(shm, "_populate_range", lambda address, length: errno.EINVAL)
    monkeypatch.setattr(shm.os, "posix_fallocate",
                        lambda fd, offset, length: reserved.append(length) or os.ftruncate(fd, length))
    reply = shm.write_reply(_reply(_store()))
    assert "shm_path" in reply and reserved
    want = deserialize_captured(shm.write_reply(_reply(_store()), shared=False)["layers"])
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_the_file_is_populated_in_ranges_on_several_threads(monkeypatch):
    """Ranges cover the file exactly once, page-aligned, and each range runs on a pool thread."""
    calls = _recording_populate(monkeypatch)
    monkeypatch.setattr(shm, "WRITE_THREADS", 3)
    monkeypatch.setattr(shm, "POPULATE_BYTES", 4096)
    reply = shm.write_reply(_reply(_store(width=2000)))
    total = os.path.getsize(reply["shm_path"])
    ranges = sorted((address, length) for address, length, _ in calls)
    assert ranges[0][1] % mmap.PAGESIZE == 0 and len(ranges) == 3
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    assert sum(n for _, n in ranges) == total
    assert threading.current_thread().name not in {name for _, _, name in calls}
    want = deserialize_captured(shm.write_reply(_reply(_store(width=2000)), shared=False)["layers"])
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_a_layer_larger_than_a_threads_share_is_split_between_shares(monkeypatch):
    """Two layers of 276 rows on three threads: shares of 184 rows, so each layer is copied in
    two parts, off the calling thread, and the file holds what the bytes path sends."""
    monkeypatch.setattr(shm, "WRITE_THREADS", 3)
    monkeypatch.setattr(shm, "POPULATE_BYTES", 4096)
    copies = collections.defaultdict(list)
    copy_into = FetchedRows.copy_into

    def recording(self, out, part=None):
        copies[id(self)].append((part, threading.current_thread().name))
        copy_into(self, out, part)

    monkeypatch.setattr(FetchedRows, "copy_into", recording)

    def make():  # 12 requests' decode steps, several to an append: scattered rows
        return _store(layers=(0, 1), width=1000, requests=12, steps=(3,) + (4,) * 5)

    reply = shm.write_reply(_reply(make()))
    parts = sorted(sorted(part for part, _ in calls) for calls in copies.values())
    assert parts == [[(0, 92), (92, 276)], [(0, 184), (184, 276)]]
    threads = {name for calls in copies.values() for _, name in calls}
    assert threading.current_thread().name not in threads
    monkeypatch.setattr(FetchedRows, "copy_into", copy_into)
    want = deserialize_captured(shm.write_reply(_reply(make()), shared=False)["layers"])
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_a_shared_write_reports_its_parts_and_a_bytes_reply_none():
    parts: dict[str, float] = {}
    t0 = time.perf_counter()
    shm.write_reply(_reply(_store()), parts=parts)
    took = time.perf_counter() - t0
    assert set(parts) == set(shm.WRITE_PARTS) and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= took
    unshared: dict[str, float] = {}
    shm.write_reply(_reply(_store()), shared=False, parts=unshared)
    assert unshared == {}


def test_a_failed_copy_leaves_no_file():
    before = _shm_files()
    reply = _reply(_store())

    def broken(out, part):
        raise RuntimeError("copy failed")

    layer = reply["layers"]["1"]
    layer["data"] = SimpleNamespace(nbytes=layer["data"].nbytes, shape=layer["data"].shape,
                                    copy_into=broken)
    with pytest.raises(RuntimeError, match="copy failed"):
        shm.write_reply(reply)
    assert _shm_files() == before


def test_a_reply_without_rows_carries_no_file():
    store = StreamStore(StreamConfig())
    store.request_index("a")
    reply = shm.write_reply(_reply(store))
    assert reply["layers"] == {} and "shm_path" not in reply
    assert deserialize_captured(shm.read_replies([reply])[0]["layers"]) == ({}, {})


def test_attention_head_shards_through_shared_memory_join():
    heads = {rank: _store(layers=(0, 2), width=4, seed=rank) for rank in range(2)}
    copies = {rank: _store(layers=(0, 2), width=4, seed=rank) for rank in range(2)}
    replies = []
    for rank in (1, 0):
        reply = _reply(heads[rank], rank=rank, tp=2)
        for info in reply["layers"].values():
            info["layout"] = {"width": 4, "num_heads": 2, "head_size": 2}
        replies.append(shm.write_reply(reply))
    assert all("shm_path" in r for r in replies)
    tensors, meta, layouts = join_shards(ATTENTION_HEADS, shm.read_replies(replies))
    for layer in (0, 2):
        parts = [deserialize_captured(copies[r].serialize())[0][layer] for r in range(2)]
        assert tensors[layer].view(torch.int16).equal(torch.cat(parts, dim=1).view(torch.int16))
        assert tensors[layer].dtype == torch.bfloat16
        assert layouts[layer]["num_heads"] == 4 and layouts[layer]["heads_per_rank"] == [2, 2]


def test_the_worker_uses_shared_memory_only_when_it_reads_the_clients_probe(tmp_path):
    probe = shm.client_probe()
    assert shm.worker_sees(probe)
    assert not shm.worker_sees({**probe, "nonce": "0" * 32})  # another namespace's file
    assert not shm.worker_sees({"path": str(tmp_path / "x"), "nonce": probe["nonce"]})
    assert not shm.worker_sees(None) and not shm.worker_sees("probe")


def test_a_reply_naming_a_foreign_file_or_a_bad_span_is_refused():
    with pytest.raises(ValueError, match="unexpected shared-memory file"):
        shm.read_reply({"shm_path": "/etc/passwd", "layers": {}})
    reply = shm.write_reply(_reply(_store()))
    reply["layers"]["2"]["shm_nbytes"] += 10**6
    other = shm.write_reply(_reply(_store()))
    paths = [reply["shm_path"], other["shm_path"]]
    assert all(os.path.exists(p) for p in paths)
    with pytest.raises(ValueError, match="layer 2: shared-memory span"):
        shm.read_replies([reply, other])
    # Both files are released, once the replies holding their views go, although the first
    # reply was bad.
    del reply, other
    gc.collect()
    assert not any(os.path.exists(p) for p in paths)


@pytest.mark.parametrize("shared", [True, False])
def test_replies_survive_msgpack_like_the_rpc(shared):
    msgspec = pytest.importorskip("msgspec")
    want = deserialize_captured(_store().serialize())
    reply = _reply(_store())
    assert shm.write_reply(reply, shared=shared) is reply  # in place
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(reply))
    assert ("shm_path" in sent) is shared
    got = deserialize_captured(shm.read_replies([sent])[0]["layers"])
    _assert_same(got, want)


# ---- the pool of files ----------------------------------------------------------------------------


def _fetch(store):
    """A shared-memory fetch decoded, and the file it came in."""
    reply = shm.write_reply(_reply(store))
    path = reply["shm_path"]
    return deserialize_captured(shm.read_replies([reply])[0]["layers"]), path


def test_a_released_file_carries_the_next_fetch():
    first, path = _fetch(_store(seed=1))
    inode = _inode(path)
    del first
    gc.collect()
    [pooled] = _pool()
    assert _inode(os.path.join(shm.SHM_DIR, pooled)) == inode
    want = deserialize_captured(shm.write_reply(_reply(_store(seed=2)), shared=False)["layers"])
    got, path = _fetch(_store(seed=2))
    assert _inode(path) == inode and not _pool()  # claimed: no new file, no new pages
    _assert_same(got, want)


def test_a_file_back_from_the_pool_is_written_through_the_workers_kept_mapping(monkeypatch):
    populated = _recording_populate(monkeypatch)
    first, path = _fetch(_store(seed=1))
    inode = _inode(path)
    assert populated and len(shm._kept) == 1
    del first
    gc.collect()
    populated.clear()
    want = deserialize_captured(shm.write_reply(_reply(_store(seed=2)), shared=False)["layers"])
    got, again = _fetch(_store(seed=2))
    assert _inode(again) == inode and not populated  # no page populated twice
    _assert_same(got, want)


def test_the_worker_lets_go_of_mappings_of_files_that_are_gone(monkeypatch):
    held = [_fetch(_store(seed=seed)) for seed in range(2)]
    assert len(shm._kept) == 2
    os.unlink(held[0][1])  # the client deleted it (pool full, or its exit)
    third = _fetch(_store(seed=3))
    inodes = {_inode(path) for _, path in held[1:] + [third]}
    assert set(shm._kept) == {(os.stat(shm.SHM_DIR).st_dev, i) for i in inodes}
    monkeypatch.setattr(shm, "KEEP_MAPPINGS", 1)
    fourth = _fetch(_store(seed=4))
    assert list(shm._kept) == [(os.stat(shm.SHM_DIR).st_dev, _inode(fourth[1]))]
    del held, third, fourth


@pytest.mark.parametrize("file_pages", [8, 5], ids=["file-as-long", "file-shorter"])
def test_a_reaped_mapping_lets_go_of_its_pages_a_step_at_a_time_and_the_file_keeps_its_data(
        monkeypatch, file_pages):
    """The reaper drops page tables in UNMAP_STEP ranges covering the mapping, as far as the
    file reaches (a taken spare's file is shorter than its mapping), on its own thread, then
    closes it; the file's contents stay (MADV_DONTNEED on a shared mapping)."""
    calls, real = [], shm._libc

    class Recording:
        @staticmethod
        def madvise(address, length, advice):
            calls.append((address, length, advice, threading.current_thread().name))
            return real.madvise(address, length, advice)

    monkeypatch.setattr(shm, "_libc", Recording)
    monkeypatch.setattr(shm, "UNMAP_STEP", 3 * mmap.PAGESIZE)
    size = 8 * mmap.PAGESIZE
    fd, path = tempfile.mkstemp(dir=shm.SHM_DIR)
    os.ftruncate(fd, size)
    mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    os.close(fd)
    pattern = bytes(range(256)) * (size // 256)
    mapped[:] = pattern
    os.truncate(path, file_pages * mmap.PAGESIZE)
    base = shm._address(mapped)
    shm._reap(maps=[mapped])
    shm.settle()
    dropped = [(a - base, n) for a, n, advice, _ in calls if advice == shm._MADV_DONTNEED]
    steps = [(0, 3), (3, 3), (6, 2)] if file_pages == 8 else [(0, 3), (3, 2)]
    assert dropped == [(a * mmap.PAGESIZE, n * mmap.PAGESIZE) for a, n in steps]
    assert {name for *_, name in calls} == {shm.REAPER} and mapped.closed
    with open(path, "rb") as f:
        assert f.read() == pattern[:file_pages * mmap.PAGESIZE]


def test_a_file_is_never_reused_while_its_tensors_live():
    first, first_path = _fetch(_store(seed=1))
    kept = {layer: t.clone() for layer, t in first[0].items()}
    second, second_path = _fetch(_store(seed=2))
    assert _inode(first_path) != _inode(second_path)
    del second
    gc.collect()
    third, third_path = _fetch(_store(seed=3))  # takes the second's file, not the first's
    assert third_path != first_path and os.path.exists(first_path)
    for layer, t in first[0].items():
        assert t.view(torch.uint8).equal(kept[layer].view(torch.uint8))


def test_a_forked_child_keeps_its_rows_when_the_parent_fetches_again():
    # A DataLoader worker forked while the parent holds fetched tensors reads them later.
    first, first_path = _fetch(_store(seed=1))
    kept = {layer: t.clone() for layer, t in first[0].items()}
    ready_r, ready_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        same = False
        try:
            os.read(ready_r, 1)
            same = all(t.view(torch.uint8).equal(kept[layer].view(torch.uint8))
                       for layer, t in first[0].items())
            del first
            gc.collect()  # the child's release leaves the parent's file and pool alone
        finally:
            os.write(verdict_w, b"1" if same else b"0")
            os._exit(0)
    try:
        del first
        gc.collect()
        released_path_gone, pool_after_release = not os.path.exists(first_path), _pool()
        second, second_path = _fetch(_store(seed=2))
    finally:
        os.write(ready_w, b"x")
        verdict = os.read(verdict_r, 1)
        os.waitpid(pid, 0)
    assert verdict == b"1", "the child saw the second fetch's rows"
    assert released_path_gone and not pool_after_release  # a child may map it: never pooled
    assert os.path.exists(second_path)
    del second
    gc.collect()
    assert len(_pool()) == 1  # files mapped after the fork are pooled again


def test_the_pool_keeps_at_most_pool_files_and_pool_bytes(monkeypatch):
    monkeypatch.setattr(shm, "POOL_FILES", 1)
    held = [_fetch(_store(seed=seed)) for seed in range(3)]
    paths = [path for _, path in held]
    del held
    gc.collect()
    assert len(_pool()) == 1 and not any(os.path.exists(p) for p in paths)
    monkeypatch.setattr(shm, "POOL_FILES", 4)
    monkeypatch.setattr(shm, "POOL_BYTES", 1)
    got, path = _fetch(_store())  # takes the pooled file
    assert not _pool() and not shm._kept  # never back from the pool: the worker let it go
    del got
    gc.collect()
    shm.settle()
    assert not _pool() and not os.path.exists(path)  # over the byte cap: deleted


def test_pages_are_freed_on_a_thread_of_their_own_not_in_a_fetch_or_a_del(monkeypatch):
    """Closing the last mapping of a deleted file frees its pages (0.19 s for 4.8 GB in a 16 MB
    fetch on the H200): the worker's stale mappings and the client's oversized files go on a
    reaping thread."""
    closed, removed = [], []
    real_close, real_remove = shm._close, shm._remove
    monkeypatch.setattr(shm, "_close", lambda m: closed.append(
        threading.current_thread().name) or real_close(m))
    monkeypatch.setattr(shm, "_remove", lambda p: removed.append(
        (p, threading.current_thread().name)) or real_remove(p))
    first, first_path = _fetch(_store(seed=1))
    os.unlink(first_path)  # the client deleted it: the worker's mapping now holds its pages
    second, second_path = _fetch(_store(seed=2))
    shm.settle()
    assert closed == ["vllm-capture-reap"]
    monkeypatch.setattr(shm, "POOL_BYTES", 1)
    del second
    gc.collect()
    shm.settle()
    assert removed == [(second_path, "vllm-capture-reap")] and not os.path.exists(second_path)
    del first


def test_a_large_release_evicts_the_oldest_small_pooled_files_and_carries_the_next_large_fetch(
        monkeypatch):
    """Two small files in the pool (a touch fetch, or files a killed client left) must not turn
    away a large one: the least recently released make room."""
    monkeypatch.setattr(shm, "POOL_SLACK", 1)
    monkeypatch.setattr(shm, "POOL_SLACK_BYTES", 0)
    smalls = [_fetch(_store(width=4, steps=(1,), seed=seed)) for seed in range(2)]
    del smalls
    gc.collect()
    small_pool = _pool()
    assert len(small_pool) == shm.POOL_FILES == 2
    os.utime(os.path.join(shm.SHM_DIR, small_pool[0]), (0, 0))  # released long ago
    big, big_path = _fetch(_store(width=4096, steps=(64,), seed=3))
    inode = _inode(big_path)
    del big
    gc.collect()
    assert len(_pool()) == 2 and small_pool[0] not in _pool() and small_pool[1] in _pool()
    again, path = _fetch(_store(width=4096, steps=(64,), seed=4))
    assert _inode(path) == inode  # the large file, not a fresh one


def test_a_small_fetch_does_not_hold_a_much_larger_pooled_file(monkeypatch):
    monkeypatch.setattr(shm, "POOL_SLACK", 1)
    monkeypatch.setattr(shm, "POOL_SLACK_BYTES", 0)
    big, _ = _fetch(_store(width=4096, steps=(64,)))
    del big
    gc.collect()
    [pooled] = _pool()
    small, path = _fetch(_store(width=4, steps=(1,)))
    assert _pool() == [pooled] and os.path.getsize(path) < os.path.getsize(
        os.path.join(shm.SHM_DIR, pooled))


def test_at_exit_pooled_files_and_later_releases_are_deleted(monkeypatch):
    monkeypatch.setattr(shm, "_exiting", False)
    pooled, _ = _fetch(_store(seed=1))
    held, held_path = _fetch(_store(seed=2))
    del pooled
    gc.collect()
    assert len(_pool()) == 1
    shm._at_exit()
    assert not _pool()
    del held
    gc.collect()
    assert not _pool() and not os.path.exists(held_path)


def test_at_exit_a_worker_deletes_its_spare_and_a_client_the_spares_of_killed_workers(monkeypatch):
    monkeypatch.setattr(shm, "_exiting", False)
    shm.want_spare(1 << 20, owner=shm.client_id())
    left = _spare_settled()
    shm._spare = None  # its worker was killed: only the file is left
    shm.want_spare(1 << 20, owner=f"{os.getppid()}-0badc0de")
    live = _spare_settled()
    foreign = tempfile.mkstemp(prefix=f"{shm.ROWS}{os.getppid()}-0badc0de-", dir=shm.SHM_DIR)[1]
    # A client with this pid but another token: a forked child (or a twin in another pid
    # namespace sharing /dev/shm), whose replies may not yet be read.
    twin = tempfile.mkstemp(prefix=f"{shm.ROWS}{os.getpid()}-0badc0de-", dir=shm.SHM_DIR)[1]
    shm._at_exit()
    shm.settle()
    assert not os.path.exists(left.path) and not os.path.exists(live.path)
    assert os.path.exists(foreign) and os.path.exists(twin)  # other clients' rows
    os.unlink(foreign)
    os.unlink(twin)
    os.close(left.fd)
    left.mapped.close()


def test_a_pooled_file_another_worker_took_is_skipped(monkeypatch):
    got, _ = _fetch(_store(seed=1))
    del got
    gc.collect()
    [pooled] = _pool()
    real_rename = os.rename

    def raced(src, dst):
        if os.path.basename(src) == pooled:
            os.unlink(src)  # another worker renamed it first
        return real_rename(src, dst)

    monkeypatch.setattr(shm.os, "rename", raced)
    want = deserialize_captured(shm.write_reply(_reply(_store(seed=2)), shared=False)["layers"])
    got, path = _fetch(_store(seed=2))  # a new file instead
    _assert_same(got, want)


# ---- files a client leaves behind ----------------------------------------------------------------


def _gone_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_reply_files_are_named_for_the_client_that_fetches():
    probe = shm.client_probe()
    assert shm.client_owner(probe) == shm.client_id() and shm.client_owner(None) is None
    assert shm.client_id().startswith(f"{os.getpid()}-")
    for bad in ({"path": "/dev/shm/vllm-capture-probe-12-nothex00-x"}, {"path": "/tmp/x"}):
        assert shm.client_owner(bad) is None
    reply = shm.write_reply(_reply(_store()), owner=shm.client_owner(probe))
    assert os.path.basename(reply["shm_path"]).startswith(f"{shm.ROWS}{shm.client_id()}-")
    got = deserialize_captured(shm.read_replies([reply])[0]["layers"])
    del got, reply
    gc.collect()
    [pooled] = _pool()
    assert pooled.startswith(f"{shm.FREE}{os.getpid()}-")


def test_a_claimed_pooled_file_is_dated_now_so_no_sweep_takes_it_for_abandoned():
    probe = shm.client_probe()
    reply = shm.write_reply(_reply(_store()), owner=shm.client_owner(probe))
    shm.read_replies([reply])
    del reply
    gc.collect()
    [pooled] = _pool()
    os.utime(os.path.join(shm.SHM_DIR, pooled), (0, 0))  # released long ago
    reply = shm.write_reply(_reply(_store(seed=1)), owner=shm.client_owner(probe))
    assert _pool() == []  # the pooled file serves this reply
    assert time.time() - os.stat(reply["shm_path"]).st_mtime < shm.SWEEP_AGE_S / 6
    shm.read_replies([reply])


def test_the_files_of_a_gone_client_are_deleted_at_a_clients_fetch_once_a_minute(monkeypatch):
    monkeypatch.setattr(shm, "_last_sweep", float("-inf"))
    gone, live = _gone_pid(), os.getpid()
    names = {
        "gone": [f"{shm.ROWS}{gone}-a1", f"{shm.FREE}{gone}-b2", f"{shm.PROBE}{gone}-c3"],
        # Kept: the client lives; the file is too recent (its reply may be in flight); a name
        # without an owner (older releases); another program's file.
        "kept": [f"{shm.ROWS}{live}-d4", f"{shm.ROWS}{gone}-recent", f"{shm.ROWS}e5f6a7b8",
                 "other-program-1234-x"],
    }
    for group in names.values():
        for name in group:
            with open(os.path.join(shm.SHM_DIR, name), "wb") as f:
                f.write(b"x")
    for name in names["gone"] + names["kept"]:
        if "recent" not in name:
            os.utime(os.path.join(shm.SHM_DIR, name), (0, 0))
    probe = shm.client_probe()
    left = set(os.listdir(shm.SHM_DIR))
    assert not left & set(names["gone"])
    assert set(names["kept"]) <= left and os.path.basename(probe["path"]) in left
    # A long-lived client sweeps again, but at most once a minute (each sweep lists /dev/shm).
    later = os.path.join(shm.SHM_DIR, f"{shm.ROWS}{gone}-later")
    with open(later, "wb") as f:
        f.write(b"x")
    os.utime(later, (0, 0))
    shm.client_probe()
    assert os.path.exists(later)
    monkeypatch.setattr(shm, "_last_sweep", time.monotonic() - shm.SWEEP_AGE_S)
    shm.client_probe()
    assert not os.path.exists(later)


def test_a_forked_child_is_a_client_of_its_own():
    """Its replies are named for it, and its parent's exit deletes none of them."""
    parent_probe = shm.client_probe()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its id and probe, then leave without exit hooks
        try:
            probe = shm.client_probe()
            os.write(write, json.dumps([shm.client_id(), probe["path"],
                                        shm.client_owner(probe)]).encode())
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    child_id, child_probe, child_owner = json.loads(os.read(read, 4096))
    os.close(read)
    os.close(write)
    assert child_id.startswith(f"{pid}-") and child_id != shm.client_id()
    assert child_owner == child_id and child_probe != parent_probe["path"]
    os.unlink(child_probe)


# ---- the spare: a reply file populated while the rows arrive -----------------------------------

def _spare_settled() -> shm._Spare:
    spare = shm._spare
    thread = spare.thread
    if thread is not None:
        thread.join()
    return spare


def test_the_spare_is_populated_in_the_background_and_carries_the_next_fetch(monkeypatch):
    """A fetch the pool cannot serve writes into the spare's pages: none populated on its path."""
    calls = _recording_populate(monkeypatch)
    store = _store(width=4096, steps=(64,), seed=1)
    want = deserialize_captured(shm.write_reply(_reply(_store(width=4096, steps=(64,), seed=1)),
                                                shared=False)["layers"])
    shm.want_spare(store.bytes_stored, owner=shm.client_id())
    spare = _spare_settled()
    assert spare.ready >= store.bytes_stored and spare.ready % mmap.PAGESIZE == 0
    assert calls and {name for _, _, name in calls} == {"vllm-capture-spare"}
    assert os.path.basename(spare.path).startswith(f"{shm.ROWS}{os.getpid()}-")
    calls.clear()
    reply = shm.write_reply(_reply(store), owner=shm.client_id())
    assert reply["shm_path"] == spare.path and not calls and shm._spare is None
    assert os.path.getsize(spare.path) == spare.ready  # populated to its end, as every reply file
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_a_fetch_larger_than_the_spare_populates_only_the_rest(monkeypatch):
    calls = _recording_populate(monkeypatch)
    shm.want_spare(1 << 20, owner=shm.client_id())
    ready = _spare_settled().ready
    calls.clear()
    store = _store(width=4096, steps=(64,), seed=2)
    want = deserialize_captured(shm.write_reply(_reply(_store(width=4096, steps=(64,), seed=2)),
                                                shared=False)["layers"])
    reply = shm.write_reply(_reply(store), owner=shm.client_id())
    total = os.path.getsize(reply["shm_path"])
    assert total > ready and sum(length for _, length, _ in calls) == total - ready
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_a_fetch_larger_than_the_pool_cap_grows_the_spare_within_its_one_mapping(monkeypatch):
    """The spare's populating stops at the pool's cap; its mapping spans any reply /dev/shm can
    take, so a larger fetch populates the rest in place instead of mapping the file again."""
    monkeypatch.setattr(shm, "POOL_BYTES", 1 << 20)
    shm.want_spare(4 << 20, owner=shm.client_id())
    spare = _spare_settled()
    assert spare.ready == 1 << 20 and len(spare.mapped) >= 8 << 20
    calls = _recording_populate(monkeypatch)
    monkeypatch.setattr(shm, "_map_populated", None)  # never called
    store = _store(width=4096, steps=(64,), seed=3)
    want = deserialize_captured(shm.write_reply(_reply(_store(width=4096, steps=(64,), seed=3)),
                                                shared=False)["layers"])
    reply = shm.write_reply(_reply(store), owner=shm.client_id())
    total = os.path.getsize(spare.path)
    assert reply["shm_path"] == spare.path and sum(n for _, n, _ in calls) == total - (1 << 20)
    assert not shm._kept  # over the pool's cap: not kept
    _assert_same(deserialize_captured(shm.read_replies([reply])[0]["layers"]), want)


def test_a_fetch_stops_the_spare_growing_until_rows_arrive_again(monkeypatch):
    """While a fetch writes (here into a pooled file), the spare's populating, which holds the
    mmap lock the write's munmaps need, stops after its current step; the next report of stored
    rows resumes it."""
    first, _ = _fetch(_store(seed=1))
    del first
    gc.collect()
    assert _pool()
    real = shm._populate_range
    monkeypatch.setattr(shm, "SPARE_STEP", mmap.PAGESIZE)
    monkeypatch.setattr(shm, "_populate_range",
                        lambda address, length: time.sleep(0.01) or real(address, length))
    shm.want_spare(64 * mmap.PAGESIZE, owner=shm.client_id())
    spare = shm._spare
    reply = shm.write_reply(_reply(_store(seed=2)), owner=shm.client_id())
    assert reply["shm_path"] != spare.path  # the pooled file served it
    frozen = _spare_settled().ready  # at most the step under way when the fetch began
    assert frozen <= spare.target + mmap.PAGESIZE and frozen < 64 * mmap.PAGESIZE
    assert spare.thread is None
    shm.want_spare(64 * mmap.PAGESIZE, owner=shm.client_id())
    assert _spare_settled().ready >= 64 * mmap.PAGESIZE > frozen
    shm.read_replies([reply])


def test_no_spare_grows_while_a_pooled_file_could_carry_the_rows(monkeypatch):
    """Generate after generate of one size, the pool serves every fetch: the spare is not made,
    and it is made once the rows outgrow every pooled file."""
    monkeypatch.setattr(shm, "POOL_SLACK_BYTES", 0)
    first, _ = _fetch(_store(seed=1))
    del first
    gc.collect()
    (pooled,) = _pool()
    path = os.path.join(shm.SHM_DIR, pooled)
    size, inode = os.path.getsize(path), _inode(path)
    shm.want_spare(size, owner=shm.client_id())
    assert shm._spare is None
    reply = shm.write_reply(_reply(_store(seed=2)), owner=shm.client_id())
    assert _inode(reply["shm_path"]) == inode and not _pool()  # the pooled file, claimed
    shm.read_replies([reply])
    del reply
    gc.collect()
    shm.want_spare(size * shm.POOL_SLACK + 1, owner=shm.client_id())  # too small a file for these
    assert _spare_settled().ready >= size * shm.POOL_SLACK + 1


def test_a_spare_serves_only_its_client_and_goes_when_capture_stops():
    other = f"{os.getppid()}-0badc0de"
    shm.want_spare(1 << 20, owner=other)
    spare = _spare_settled()
    reply = shm.write_reply(_reply(_store()), owner=shm.client_id())
    assert reply["shm_path"] != spare.path and shm._spare is spare  # not this client's
    shm.read_replies([reply])
    shm.want_spare(1 << 20, owner=shm.client_id())  # a new client: the old spare is deleted
    shm.settle()
    assert not os.path.exists(spare.path) and shm._spare.owner == shm.client_id()
    mine = _spare_settled()
    shm.drop_spare()
    shm.settle()
    assert shm._spare is None and not os.path.exists(mine.path)


def test_the_spare_stops_growing_where_dev_shm_is_full(monkeypatch):
    monkeypatch.setattr(shm, "_populate_range", lambda address, length: errno.ENOSPC)
    shm.want_spare(1 << 20, owner=shm.client_id())
    spare = _spare_settled()
    assert spare.ready == spare.target == 0 and spare.thread is None
    assert shm._take_spare(shm.client_id(), 1 << 20) is None  # nothing populated: fetches do without
    shm.want_spare(2 << 20, owner=shm.client_id())
    assert shm._spare is spare and spare.thread is None  # no new try on every report


def test_a_much_smaller_fetch_leaves_the_spare_for_a_later_one(monkeypatch):
    """Like a pooled file: a one-layer fetch must not hold a spare sized for every layer."""
    monkeypatch.setattr(shm, "POOL_SLACK_BYTES", 0)
    shm.want_spare(8 << 20, owner=shm.client_id())
    spare = _spare_settled()
    small = shm.write_reply(_reply(_store()), owner=shm.client_id())
    assert small["shm_path"] != spare.path and shm._spare is spare
    big = shm.write_reply(_reply(_store(width=4096, steps=(64,))), owner=shm.client_id())
    assert big["shm_path"] == spare.path
    shm.read_replies([small, big])


def _blocks(*layers):
    """``(rows, offset)`` blocks standing in for layers of (rows, bytes per row)."""
    return [(SimpleNamespace(shape=(rows, 0), nbytes=rows * row_bytes), k)
            for k, (rows, row_bytes) in enumerate(layers)]


def _check_shares(blocks, shares, threads):
    """Each block's parts cover its rows once, in order; at most ``threads`` shares, whose
    bytes are about equal (within a row of the largest rows of each share's end)."""
    assert 0 < len(shares) <= threads
    for rows, offset in blocks:
        parts = [part for share in shares for r, o, part in share if o == offset]
        assert all(r is rows for share in shares for r, o, _ in share if o == offset)
        assert [a for a, _ in parts] == [0] + [b for _, b in parts[:-1]]
        assert parts[-1][1] == rows.shape[0]
    loads = [sum((b - a) * (r.nbytes // r.shape[0]) for r, _, (a, b) in share)
             for share in shares]
    largest_row = max(r.nbytes // r.shape[0] for r, _ in blocks)
    total = sum(r.nbytes for r, _ in blocks)
    assert sum(loads) == total
    assert max(loads) - total / len(shares) <= largest_row
    return loads


def test_a_reply_is_copied_in_shares_of_about_equal_bytes_one_per_thread():
    """Blocks are laid end to end and cut into one share per thread: a layer larger than a share
    is copied by several threads, small ones go whole, several to a share."""
    four_layers = _blocks(*[(18368, 4096)] * 4)
    shares = shm._shares(four_layers, 8)
    assert len(shares) == 8 and all(len(share) == 1 for share in shares)
    _check_shares(four_layers, shares, 8)
    last_token = _blocks(*[(64, 8192)] * 32)
    shares = shm._shares(last_token, 4)
    assert [len(share) for share in shares] == [8] * 4
    assert all(part == (0, 64) for share in shares for _, _, part in share)
    _check_shares(last_token, shares, 4)
    uneven = _blocks((5, 100), (1, 3), (400, 8), (2, 1000), (30, 30), (3, 7))
    for threads in (1, 2, 3, 5, 8, 64):
        _check_shares(uneven, shm._shares(uneven, threads), threads)
    one_row = _blocks((1, 10))
    assert shm._shares(one_row, 8) == [[(one_row[0][0], 0, (0, 1))]]
