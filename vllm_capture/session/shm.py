"""Fetch payloads through shared memory when the client and the worker share a filesystem.

The RPC path carries rows as msgpack bytes through vLLM's engine-core sockets: several copies and
about 0.24 GB/s on the H200 host (a 64 MiB fetch took 0.28 s). When the worker can see a file the
client wrote in ``/dev/shm`` (same host, same mount namespace: checked, not assumed from the host
name), the worker writes the rows of a fetch into one file there and sends offsets instead; the
client maps the file, copies the rows out while decoding, and deletes it. Anything else (another host, a container with its own
``/dev/shm``, too little space) keeps the bytes path, so a fetch never depends on this.

A client killed between the reply and its read leaves that file behind
(``/dev/shm/vllm-capture-rows-*``; safe to delete when no capture client runs).

Payload contract: a layer entry's ``"data"`` is replaced by ``"shm_offset"`` and ``"shm_nbytes"``
(ints) and the reply gains ``"shm_path"`` (str); :func:`read_reply` puts the bytes back before
the wire decoder runs.
"""

from __future__ import annotations

import atexit
import mmap
import os
import secrets
import tempfile
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "vllm-capture-"
# Leave room for everything else that uses /dev/shm (NCCL, vLLM's shared-memory broadcast).
FREE_SPACE_FACTOR = 2

_probe: dict[str, str] | None = None


def client_probe() -> dict[str, str] | None:
    """A small file only this client could have written; None where /dev/shm is unusable."""
    global _probe
    if _probe is not None and os.path.exists(_probe["path"]):
        return _probe
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return None
    nonce = secrets.token_hex(16)
    fd, path = tempfile.mkstemp(prefix=PREFIX + "probe-", dir=SHM_DIR)
    with os.fdopen(fd, "w") as f:
        f.write(nonce)
    atexit.register(_remove, path)
    _probe = {"path": path, "nonce": nonce}
    return _probe


def worker_sees(probe: Any) -> bool:
    """Whether this process reads the client's probe file (same host and /dev/shm mount)."""
    if not isinstance(probe, dict):
        return False
    path, nonce = probe.get("path"), probe.get("nonce")
    if not (isinstance(path, str) and isinstance(nonce, str)
            and os.path.dirname(path) == SHM_DIR and os.path.basename(path).startswith(PREFIX)):
        return False
    try:
        with open(path) as f:
            return f.read() == nonce
    except OSError:
        return False


def write_reply(reply: dict[str, Any], shared: bool = True) -> dict[str, Any]:
    """Make a fetch reply msgpack-safe, in place: the layers' rows (numpy arrays from
    ``serialize_capture_layer(raw_data=True)``, or bytes) go into one shared-memory file when
    ``shared`` and there is room, into bytes otherwise."""
    layers = reply.get("layers") or {}
    total = sum(_nbytes(info["data"]) for info in layers.values())
    path = _write_file([info["data"] for info in layers.values()], total) if shared and total else None
    if path is None:
        for info in layers.values():
            if not isinstance(info["data"], bytes):
                info["data"] = memoryview(info["data"]).tobytes()
        return reply
    offset = 0
    for info in layers.values():
        info["shm_nbytes"] = _nbytes(info.pop("data"))
        info["shm_offset"] = offset
        offset += info["shm_nbytes"]
    reply["shm_path"] = path
    return reply


def _write_file(blocks: list, total: int) -> str | None:
    try:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < FREE_SPACE_FACTOR * total:
            return None
        fd, path = tempfile.mkstemp(prefix=PREFIX + "rows-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "wb") as f:
            for block in blocks:
                if _nbytes(block):
                    f.write(memoryview(block).cast("B"))
    except OSError:
        _remove(path)
        return None
    return path


def _nbytes(block) -> int:
    return memoryview(block).nbytes


def read_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """Put the row bytes of a shared-memory reply back into its layer entries (views of the
    file, mapped once; the decoder copies them out) and delete the file."""
    path = reply.pop("shm_path", None)
    if path is None:
        return reply
    if not (isinstance(path, str) and os.path.dirname(path) == SHM_DIR
            and os.path.basename(path).startswith(PREFIX + "rows-")):
        raise ValueError(f"capture reply names an unexpected shared-memory file {path!r}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # The mapping outlives the unlink below; it goes when the last view is dropped.
            data = memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)) if size else memoryview(b"")
    finally:
        _remove(path)
    for key, info in (reply.get("layers") or {}).items():
        start, nbytes = info.pop("shm_offset", None), info.pop("shm_nbytes", None)
        if not (isinstance(start, int) and isinstance(nbytes, int)
                and 0 <= start and 0 <= nbytes and start + nbytes <= len(data)):
            raise ValueError(f"capture layer {key}: shared-memory span ({start!r}, {nbytes!r}) "
                             f"outside the {len(data)}-byte file")
        info["data"] = data[start: start + nbytes]
    return reply


def read_replies(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`read_reply` for every rank's reply; every file is deleted even if one is bad."""
    error = None
    for reply in replies:
        try:
            read_reply(reply)
        except (OSError, ValueError) as exc:
            error = error or exc
    if error is not None:
        raise error
    return replies


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
