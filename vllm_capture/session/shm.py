"""Fetch payloads through shared memory when the client and the worker share a filesystem.

The RPC path carries rows as msgpack bytes through vLLM's engine-core sockets: several copies and
about 0.24 GB/s on the H200 host (a 64 MiB fetch took 0.28 s). When the worker can see a file the
client wrote in ``/dev/shm`` (same host, same mount namespace: checked, not assumed from the host
name), the worker writes the rows of a fetch into one file there (:class:`RowsFile`) and the reply
sends offsets instead; the client maps the file, copies the rows out while decoding, and
deletes it. Anything else (another host, a container with its own
``/dev/shm``, too little space) keeps the bytes path, so a fetch never depends on this.

A client killed between the reply and its read leaves that file behind
(``/dev/shm/vllm-capture-rows-*``; safe to delete when no capture client runs).

Payload contract: a layer entry's ``"data"`` is replaced by ``"shm_offset"`` and ``"shm_nbytes"``
(ints) and the reply gains ``"shm_path"`` (str); :func:`read_reply` puts the bytes back before
the wire decoder runs.
"""

from __future__ import annotations

import atexit
import math
import mmap
import os
import secrets
import tempfile
import threading
from typing import Any

import numpy as np
import torch

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


class RowsFile:
    """The rows of one fetch on their way into one ``/dev/shm`` file (the worker side).

    The store gathers each layer's rows into a tensor from :meth:`empty`: a buffer recycled from
    earlier fetches, so its pages are already mapped. Fresh memory costs a page fault per 4 KiB
    on first touch, and a gather into fresh memory and then a copy into the file ran at about
    1 GB/s on the H200 host. :func:`write_reply` then writes every layer into the file with
    ``write`` calls (on this project's VM twice as fast as filling a mapping of the file) and
    hands the buffers back.
    """

    def __init__(self):
        self.size = 0
        self._blocks: list[tuple[int, np.ndarray, torch.Tensor | None]] = []  # offset, bytes, buffer

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor whose bytes go into the file (at the next free offset)."""
        nbytes = math.prod(shape) * dtype.itemsize
        buffer = _RECYCLER.take(nbytes)
        rows = buffer[:nbytes].view(dtype).view(shape)
        self._add(_bytes_of(rows.numpy() if dtype != torch.bfloat16 else rows.view(torch.int16).numpy()),
                  buffer)
        return rows

    def place(self, array) -> tuple[int, int]:
        """``(file offset, nbytes)`` of ``array``'s bytes: where :meth:`empty` put them, or a new
        span at the end (written from ``array`` itself)."""
        view = _bytes_of(array)
        if view.size == 0:
            return (0, 0)
        address = view.__array_interface__["data"][0]
        for offset, block, _ in self._blocks:
            base = block.__array_interface__["data"][0]
            if base <= address and address + view.size <= base + block.size:
                return offset + address - base, view.size
        return self._add(view, None), view.size

    def _add(self, block: np.ndarray, buffer: torch.Tensor | None) -> int:
        offset = -(-self.size // _ALIGN) * _ALIGN
        self._blocks.append((offset, block, buffer))
        self.size = offset + block.size
        return offset

    def write(self) -> str | None:
        """Write the file; its path, or None (nothing written) where /dev/shm has no room."""
        path = None
        try:
            if _has_room(self.size):
                fd, path = tempfile.mkstemp(prefix=PREFIX + "rows-", dir=SHM_DIR)
                with os.fdopen(fd, "wb") as f:
                    for offset, block, _ in self._blocks:
                        if block.size:
                            f.seek(offset)
                            f.write(memoryview(block))
        except OSError:
            if path is not None:
                _remove(path)
            path = None
        return path

    def release(self) -> None:
        """Hand the buffers back for the next fetch (nothing may use their tensors after this)."""
        for _, _, buffer in self._blocks:
            if buffer is not None:
                _RECYCLER.give(buffer)
        self._blocks = []


class _Recycler:
    """Host buffers kept between fetches (up to ``keep_bytes`` in all), reused best-fit."""

    def __init__(self, keep_bytes: int):
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # (tensors compare elementwise: pick by index, not by list.remove)
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            kept, total = [], 0
            for b in self._free:
                if total + b.numel() <= self.keep_bytes:
                    kept.append(b)
                    total += b.numel()
            self._free = kept


# Enough for the largest fetch the benchmark makes per call (1 GiB); larger ones allocate.
RECYCLE_BYTES = 1 << 30
_RECYCLER = _Recycler(RECYCLE_BYTES)
_ALIGN = 64


def _bytes_of(array) -> np.ndarray:
    """A flat uint8 view of an array's (or bytes') memory."""
    view = memoryview(array)
    return np.frombuffer(view.cast("B") if view.nbytes else b"", dtype=np.uint8)


def _has_room(nbytes: int) -> bool:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= FREE_SPACE_FACTOR * nbytes


def write_reply(reply: dict[str, Any], rows_file: RowsFile | None) -> dict[str, Any]:
    """Make a fetch reply msgpack-safe, in place. With ``rows_file``, each layer's rows
    (arrays from ``serialize_capture_layer(raw_data=True)``, or bytes) go into one shared-memory
    file and the reply carries their spans; without one, or where the file cannot be written,
    every layer's rows travel as bytes."""
    layers = reply.get("layers") or {}
    try:
        spans = {key: rows_file.place(info["data"]) for key, info in layers.items()} if rows_file else {}
        path = rows_file.write() if rows_file is not None and rows_file.size else None
        if path is None:
            for info in layers.values():
                if not isinstance(info["data"], bytes):
                    info["data"] = memoryview(info["data"]).tobytes()
            return reply
        for key, info in layers.items():
            del info["data"]
            info["shm_offset"], info["shm_nbytes"] = spans[key]
        reply["shm_path"] = path
        return reply
    finally:
        if rows_file is not None:
            rows_file.release()


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
