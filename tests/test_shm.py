"""The shared-memory fetch path: the probe handshake, the file round trip and its refusals."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_capture.session import shm
from vllm_capture.session.wire import deserialize_captured, serialize_capture_layer

pytestmark = pytest.mark.skipif(not os.access(shm.SHM_DIR, os.W_OK), reason="no writable /dev/shm")


def _reply(rows_per_layer=(3, 0, 5), width=4, raw_data=True):
    layers = {}
    for layer, rows in enumerate(rows_per_layer):
        t = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width).to(torch.bfloat16) + layer
        meta = torch.tensor([[0, p, 10 + p] for p in range(rows)], dtype=torch.int32).reshape(rows, 3)
        layers[str(layer)] = serialize_capture_layer(t, meta, {0: "req-0"}, f"model.layers.{layer}",
                                                     raw_data=raw_data)
    return {"tp_rank": 0, "tp_size": 1, "layers": layers}


def _shm_files() -> set[str]:
    return {f for f in os.listdir(shm.SHM_DIR) if f.startswith(shm.PREFIX + "rows-")}


def test_rows_round_trip_through_shared_memory_and_the_file_is_removed():
    before = _shm_files()
    want = deserialize_captured(_reply(raw_data=False)["layers"])
    reply = shm.write_reply(_reply(), shm.RowsFile())
    assert "shm_path" in reply and all("data" not in v for v in reply["layers"].values())
    assert os.path.exists(reply["shm_path"])
    got = deserialize_captured(shm.read_replies([reply])[0]["layers"])
    assert _shm_files() == before
    for layer in want[0]:
        assert torch.equal(got[0][layer], want[0][layer])
        assert torch.equal(got[1][layer].positions, want[1][layer].positions)
        assert got[1][layer].req_ids == want[1][layer].req_ids


def test_the_worker_uses_shared_memory_only_when_it_reads_the_clients_probe(tmp_path):
    probe = shm.client_probe()
    assert shm.worker_sees(probe)
    assert not shm.worker_sees({**probe, "nonce": "0" * 32})  # another namespace's file
    assert not shm.worker_sees({"path": str(tmp_path / "x"), "nonce": probe["nonce"]})
    assert not shm.worker_sees(None) and not shm.worker_sees("probe")


def test_a_reply_without_rows_or_without_a_shared_dev_shm_carries_bytes():
    want = deserialize_captured(_reply(raw_data=False)["layers"])
    for reply in (shm.write_reply(_reply(rows_per_layer=(0, 0)), shm.RowsFile()),
                  shm.write_reply(_reply(), None)):
        assert "shm_path" not in reply
        assert all(type(v["data"]) is bytes for v in reply["layers"].values())
    got = deserialize_captured(reply["layers"])
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_a_reply_naming_a_foreign_file_or_a_bad_span_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unexpected shared-memory file"):
        shm.read_reply({"shm_path": "/etc/passwd", "layers": {}})
    reply = shm.write_reply(_reply(), shm.RowsFile())
    reply["layers"]["2"]["shm_nbytes"] += 1
    other = shm.write_reply(_reply(), shm.RowsFile())
    paths = [reply["shm_path"], other["shm_path"]]
    assert all(os.path.exists(p) for p in paths)
    with pytest.raises(ValueError, match="layer 2: shared-memory span"):
        shm.read_replies([reply, other])
    # Both files are gone although the first reply was bad.
    assert not any(os.path.exists(p) for p in paths)


def _session_with_rows(steps=5, requests=3, chunk_per_step=False, width=6, layers=3):
    """A CPU capture session whose hidden-states store holds ``steps`` decode steps of rows."""
    import types

    import numpy as np

    from vllm_capture.capture_graph.state import CaptureGraphState
    from vllm_capture.selection import BatchGeometry
    from vllm_capture.session.session import CaptureSession

    state = CaptureGraphState(device=torch.device("cpu"), capacity=64, acc_slots=8)
    for layer in range(layers):
        state.add_site("hidden_states", layer, f"layers.{layer}", width, torch.bfloat16)
    state.allocate()
    state.set_input_ids(torch.zeros(64, dtype=torch.int32))
    session = CaptureSession(state)
    session.enable_stream("hidden_states")
    ids = [f"r{i}" for i in range(requests)]
    for rid in ids:
        session.add_request(rid, [1, 2, 3], types.SimpleNamespace(extra_args={}, n=1))
    for step in range(steps):
        rows = 3 if step == 0 else 1
        qsl = np.arange(requests + 1, dtype=np.int32) * rows
        computed = np.full(requests, 0 if step == 0 else 2 + step, dtype=np.int64)
        session.begin_step(BatchGeometry(tuple(ids), qsl, computed, int(qsl[-1]),
                                         np.full(int(qsl[-1]), -1, dtype=np.int32)))
        for site in list(state.sites.values()):
            x = (torch.arange(int(qsl[-1]) * width, dtype=torch.float32).reshape(-1, width)
                 + 100 * step + 1000 * site.layer_id)
            state.handle(x.to(torch.bfloat16), None, site.counter)
        session.end_step()
        if chunk_per_step:
            session._wait_harvest()  # the store appends this step alone
    return session


# The store's three gathers: one chunk as stored; long spans concatenated; many short spans of
# many chunks scattered.
@pytest.mark.parametrize("steps,requests,chunk_per_step", [(1, 3, False), (40, 3, False),
                                                          (5, 10, True)])
def test_the_store_gathers_rows_straight_into_the_shared_file(steps, requests, chunk_per_step):
    want = deserialize_captured(
        _session_with_rows(steps, requests, chunk_per_step).fetch_stream("hidden_states"))
    rows_file = shm.RowsFile()
    data = _session_with_rows(steps, requests, chunk_per_step).fetch_stream(
        "hidden_states", raw_data=True, rows_out=rows_file.empty)
    staged = len(rows_file._blocks)
    reply = shm.write_reply({"layers": {str(k): v for k, v in data.items()}}, rows_file)
    assert staged == 3 and len(shm._RECYCLER._free) >= 3  # gathered in place; buffers handed back
    path = reply["shm_path"]
    got = deserialize_captured(shm.read_replies([reply])[0]["layers"])
    assert not os.path.exists(path)
    for layer in want[0]:
        assert want[0][layer].shape == (requests * (3 + steps - 1), 6)
        assert torch.equal(got[0][layer], want[0][layer])
        assert torch.equal(got[1][layer].positions, want[1][layer].positions)
        assert got[1][layer].req_ids == want[1][layer].req_ids


def test_without_room_in_dev_shm_the_rows_travel_as_bytes(monkeypatch):
    want = deserialize_captured(_session_with_rows().fetch_stream("hidden_states"))
    monkeypatch.setattr(shm, "_has_room", lambda nbytes: False)
    rows_file = shm.RowsFile()
    data = _session_with_rows().fetch_stream("hidden_states", raw_data=True, rows_out=rows_file.empty)
    before = _shm_files()
    reply = shm.write_reply({"layers": {str(k): v for k, v in data.items()}}, rows_file)
    assert "shm_path" not in reply and _shm_files() == before
    got = deserialize_captured(reply["layers"])
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_recycled_buffers_are_reused_best_fit_within_the_cap():
    recycler = shm._Recycler(keep_bytes=1000)
    small, large = recycler.take(100), recycler.take(600)
    assert small.numel() == 100 and large.numel() == 600
    recycler.give(small)
    recycler.give(large)
    assert recycler.take(50) is small  # the smallest that fits
    assert recycler.take(500) is large
    assert recycler.take(50).numel() == 50  # none free: a new one
    for b in (small, large, torch.empty(900, dtype=torch.uint8)):
        recycler.give(b)
    # largest first while the total stays within 1000 bytes: 900 and 100 are kept, 600 is let go
    assert sorted(b.numel() for b in recycler._free) == [100, 900]
