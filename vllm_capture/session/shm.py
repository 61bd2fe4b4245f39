"""Fetch payloads through shared memory when the client and the worker share a filesystem.

The RPC path carries rows as msgpack bytes through vLLM's engine-core sockets: several copies and
about 0.24 GB/s on the H200 host (a 64 MiB fetch took 0.28 s). When the worker can see a file the
client wrote in ``/dev/shm`` (same host, same mount namespace: checked, not assumed from the host
name), the rows of a fetch travel in one file there and the reply carries offsets instead.
Anything else (another host, a container with its own ``/dev/shm``, too little space) keeps the
bytes path, so a fetch never depends on this.

One copy end to end: the worker sizes the file from the byte counts the store computes before
copying (``FetchedRows.nbytes``), reserves its pages (``posix_fallocate``: a full tmpfs fails
there, not with a SIGBUS mid-copy), maps it and gathers every layer's rows straight from the
store's chunks into the mapping (``FetchedRows.copy_into``). The client maps the file privately
(``MAP_PRIVATE``, read and write: copy-on-write), deletes it at once, and decodes each layer as a
view of that mapping, without copying.

So tensors decoded from such a reply view a private mapping of a deleted ``/dev/shm`` file: the
file's memory (shared memory, counted against ``/dev/shm``'s size, never swapped without swap)
stays until the last tensor of that fetch (any layer, any view of one) is freed. Writing to a
tensor is allowed and private: it copies the pages written to. A caller that keeps a small part
of a large fetch should copy that part (``.clone()``) and drop the rest.

A client killed between the reply and its read leaves that file behind
(``/dev/shm/vllm-capture-rows-*``; safe to delete when no capture client runs).

Payload contract: a layer entry's ``"data"`` is replaced by ``"shm_offset"`` and ``"shm_nbytes"``
(ints) and the reply gains ``"shm_path"`` (str); :func:`read_reply` puts a writable view of the
mapped file back as ``"data"`` before the wire decoder runs (which keeps writable buffers
uncopied, see ``wire.deserialize_captured``).
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
# Layer offsets in a reply's file are multiples of this (bytes).
ALIGN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux

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
    """Make a fetch reply msgpack-safe, in place: the layers' rows (``FetchedRows``, from
    ``StreamStore.serialize(raw_data=True)``) are copied once, into one shared-memory file, when
    ``shared`` and there is room; into bytes otherwise."""
    layers = list((reply.get("layers") or {}).values())
    sizes = [info["data"].nbytes for info in layers]
    # Each layer starts on a cache line, so its rows are aligned for any wire dtype.
    offsets = [0] * len(sizes)
    for i in range(1, len(sizes)):
        offsets[i] = -(-(offsets[i - 1] + sizes[i - 1]) // ALIGN) * ALIGN
    total = offsets[-1] + sizes[-1] if sizes else 0
    path = None
    if shared and total:
        path = _write_file([info["data"] for info in layers], offsets, total)
    if path is None:
        # Gathered into one scratch buffer reused across layers (its pages are faulted in once),
        # then copied into the reply's bytes.
        scratch = memoryview(bytearray(max(sizes, default=0)))
        for info, nbytes in zip(layers, sizes):
            info["data"].copy_into(scratch[:nbytes])
            info["data"] = scratch[:nbytes].tobytes()
        return reply
    for info, offset, nbytes in zip(layers, offsets, sizes):
        del info["data"]
        info["shm_offset"], info["shm_nbytes"] = offset, nbytes
    reply["shm_path"] = path
    return reply


def _write_file(blocks: list, offsets: list[int], total: int) -> str | None:
    """A new file of ``total`` bytes with each block's rows copied in at its offset, through one
    mapping; None (and no file) when there is not room for it."""
    try:
        st = os.statvfs(SHM_DIR)
        if st.f_bavail * st.f_frsize < FREE_SPACE_FACTOR * total:
            return None
        fd, path = tempfile.mkstemp(prefix=PREFIX + "rows-", dir=SHM_DIR)
    except OSError:
        return None
    try:
        try:
            # Reserve the pages first: through a mapping, a full tmpfs is a SIGBUS, not an error.
            # Populating the mapping up front beats a page fault per page during the copy.
            os.posix_fallocate(fd, 0, total)
            mapped = mmap.mmap(fd, total, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        try:
            for block, offset in zip(blocks, offsets):
                if block.nbytes:
                    block.copy_into(memoryview(mapped)[offset: offset + block.nbytes])
        finally:
            try:
                mapped.close()
            except BufferError:  # a view still held by an exception's traceback
                pass
    except OSError:
        _remove(path)
        return None
    except BaseException:
        _remove(path)
        raise
    return path


def read_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """Put the rows of a shared-memory reply back into its layer entries and delete the file.

    The entries' ``"data"`` are writable views of one private (copy-on-write) mapping of the
    file, which outlives the file: the decoder's tensors view it, and it is unmapped when the
    last of them is freed."""
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
            # Private and writable: the tensors viewing it are writable (numpy and torch do not
            # warn), and a write copies the page instead of reaching the file.
            data = (memoryview(mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                                         prot=mmap.PROT_READ | mmap.PROT_WRITE))
                    if size else memoryview(bytearray()))
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
