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
    reply = shm.write_reply(_reply())
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
    for reply in (shm.write_reply(_reply(rows_per_layer=(0, 0))),
                  shm.write_reply(_reply(), shared=False)):
        assert "shm_path" not in reply
        assert all(type(v["data"]) is bytes for v in reply["layers"].values())
    got = deserialize_captured(reply["layers"])
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])


def test_a_reply_naming_a_foreign_file_or_a_bad_span_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unexpected shared-memory file"):
        shm.read_reply({"shm_path": "/etc/passwd", "layers": {}})
    reply = shm.write_reply(_reply())
    reply["layers"]["2"]["shm_nbytes"] += 1
    other = shm.write_reply(_reply())
    paths = [reply["shm_path"], other["shm_path"]]
    assert all(os.path.exists(p) for p in paths)
    with pytest.raises(ValueError, match="layer 2: shared-memory span"):
        shm.read_replies([reply, other])
    # Both files are gone although the first reply was bad.
    assert not any(os.path.exists(p) for p in paths)
