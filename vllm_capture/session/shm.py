"""Fetch payloads through shared memory when the client and the worker share a filesystem.

The RPC path carries rows as msgpack bytes through vLLM's engine-core sockets: several copies and
about 0.24 GB/s on the H200 host (a 64 MiB fetch took 0.28 s). When the worker can see a file the
client wrote in ``/dev/shm`` (same host, same mount namespace: checked, not assumed from the host
name), the rows of a fetch travel in one file there and the reply carries offsets instead.
Anything else (another host, a container with its own ``/dev/shm``, too little space) keeps the
bytes path, so a fetch never depends on this.

One copy end to end: the worker sizes the file from the byte counts the store computes before
copying (``FetchedRows.nbytes``), reserves and populates its pages (see below: a full tmpfs
fails there, not with a SIGBUS mid-copy), maps it and gathers every layer's rows straight from
the store's chunks into the mapping (``FetchedRows.copy_into``). The client maps the file privately
(``MAP_PRIVATE``, read and write: copy-on-write) and decodes each layer as a view of that mapping,
without copying.

So tensors decoded from such a reply view a private mapping of a ``/dev/shm`` file: the file's
memory (shared memory, counted against ``/dev/shm``'s size, never swapped without swap) stays until
the last tensor of that fetch (any layer, any view of one) is freed. Writing to a tensor is allowed
and private: it copies the pages written to. A caller that keeps a small part of a large fetch
should copy that part (``.clone()``) and drop the rest.

Fresh tmpfs pages are the fetch's cost: the kernel allocates and zeroes them at about 1 GB/s per
thread on the H200 host, where the gather itself runs at several GB/s. So the worker sizes the file
(``ftruncate``) and several threads populate ranges of its mapping at once
(``MADV_POPULATE_WRITE``, Linux 5.14+: a full tmpfs is an error there, not a SIGBUS mid-copy),
then copy the layers' rows in byte-balanced shares, one per thread (a layer larger than a share
is cut between threads; see ``_shares``). Older kernels reserve with ``posix_fallocate`` and
populate on one thread.

Files are reused, too. When the last tensor of a fetch is freed, the client renames its file to
``vllm-capture-free-*``, into a pool of at most ``POOL_FILES`` files and ``POOL_BYTES``: the least
recently released files make room, or are deleted. A worker's next reply that fits in a pooled
file claims it by renaming it back (atomic, so two workers never share one) and writes into pages
that already exist. The client deletes the files it pooled when it exits. The worker keeps its
mapping of each file it wrote (at most ``KEEP_MAPPINGS``), so a file back from the pool is written
through page tables that already exist, without populating it again (2.6-3x faster on the CPU VM
for 629 MB; 5x on the H200). A kept mapping holds its pages after the file is deleted, until the
worker's next reply closes the mappings of files that are gone. Files larger than the pool may hold
are not kept. Freeing pages costs about 0.1-0.2 s per GB, so mappings are closed, and oversized
released files deleted, on a thread of their own: never on a fetch's path or in the caller's
``del`` (on the H200, a 16 MB fetch took 0.19 s freeing the previous 4.8 GB one).

The spare goes one step further for a fetch the pool cannot serve: while a stream's rows arrive,
the worker populates a file of about the size its store holds, in the background, and the fetch
writes into it (see ``want_spare``).

A client is its pid and a random token (``client_id``; a forked child draws its own), and its
files carry both (``/dev/shm/vllm-capture-rows-<pid>-<token>-*``): a forked child's replies, or
those of a client with the same pid in another pid namespace sharing ``/dev/shm``, are never
taken for another client's (deleted at its exit, or written into its spare). A client killed (or
ended with ``os._exit``) while holding fetched rows, or with files pooled, leaves them behind
(rows, ``vllm-capture-free-<pid>-*``, its probe). A client's fetch deletes the files of clients
that are gone, once they are a minute old (at most once a minute).

Payload contract: a layer entry's ``"data"`` is replaced by ``"shm_offset"`` and ``"shm_nbytes"``
(ints) and the reply gains ``"shm_path"`` (str); :func:`read_reply` puts a writable view of the
mapped file back as ``"data"`` before the wire decoder runs (which keeps writable buffers
uncopied, see ``wire.deserialize_captured``).
"""

from __future__ import annotations

import atexit
import concurrent.futures
import ctypes
import errno
import mmap
import os
import secrets
import tempfile
import threading
import time
import weakref
from typing import Any

SHM_DIR = "/dev/shm"
PREFIX = "vllm-capture-"
# Leave room for everything else that uses /dev/shm (NCCL, vLLM's shared-memory broadcast).
FREE_SPACE_FACTOR = 2
# Layer offsets in a reply's file are multiples of this (bytes).
ALIGN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux
_MADV_POPULATE_WRITE = 23  # linux/mman.h
# Threads that populate a reply file's pages and copy its layers: one per POPULATE_BYTES of the
# file, at most WRITE_THREADS (a reply under 8 MB is written on the calling thread), from one
# kept pool (_writers). Populating 4 MB of fresh pages takes about 4 ms, copying them about 1.
WRITE_THREADS = min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)
POPULATE_BYTES = 4 << 20
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
ROWS, FREE, PROBE = PREFIX + "rows-", PREFIX + "free-", PREFIX + "probe-"
# Files of a client that is gone (killed, or ended with os._exit) are deleted by the next client
# to fetch on this host, once they are this old (a process of another pid namespace sharing
# /dev/shm may look gone; unlinking a file it already mapped costs it nothing).
SWEEP_AGE_S = 60.0
# The pool of files whose pages are kept for the next fetch: at most this many files and bytes
# (and a quarter of /dev/shm).
POOL_FILES = 2
POOL_BYTES = 4 << 30
# A pooled file serves a reply of at most POOL_SLACK times fewer bytes (plus POOL_SLACK_BYTES),
# so a small fetch does not hold a large file out of the pool.
POOL_SLACK = 4
POOL_SLACK_BYTES = 64 << 20

# Worker side: mappings of the reply files this process wrote, by (st_dev, st_ino), oldest first.
KEEP_MAPPINGS = POOL_FILES + 2
_kept: dict[tuple[int, int], mmap.mmap] = {}

# Freeing a file's pages (its last mapping closed, or the file deleted once unmapped) costs about
# 0.1-0.2 s per GB, so that work runs on threads of their own (munmap and unlink release the GIL):
# off the next fetch's path in the worker, and out of the caller's ``del`` in the client.
REAPER = "vllm-capture-reap"
# But one munmap of a large mapping holds the process's mmap lock throughout (75-200 ms per GB on
# the CPU VM), and every mmap or munmap of another thread waits for it: the store's allocations
# and frees, the spare, a new reply file. So a reaper drops a mapping's page tables UNMAP_STEP
# bytes at a time (MADV_DONTNEED: the data stays in the file), each call holding the lock for
# well under a millisecond, and closes it once nothing is mapped (on the CPU VM, while a 1 GiB
# mapping closed, an mmap on another thread waited at most 1.6 ms instead of 83 ms).
UNMAP_STEP = 8 << 20
_MADV_DONTNEED = 4  # linux/mman.h

_probe: dict[str, str] | None = None
_token = secrets.token_hex(4)  # with the pid, this process as a client (``client_id``)
_last_sweep = float("-inf")
_pooled: set[str] = set()  # files this client put in the pool, deleted at exit
_exiting = False
# Reply files whose rows this process's tensors view now, and those a fork shares with a child.
# A file a child may still map is never pooled: the next fetch would write into it, and the
# child's copy-on-write pages that it has not written show the file. A child leaves the files it
# inherited (and the pool) to its parent.
_mapped: set[str] = set()
_shared_with_child: set[str] = set()
_inherited: set[str] = set()


def _after_fork_in_parent() -> None:
    _shared_with_child.update(_mapped)


def _after_fork_in_child() -> None:
    global _probe, _token
    _inherited.update(_mapped)
    _mapped.clear()
    _pooled.clear()
    # A client of its own: its replies must not be named, nor deleted, as its parent's.
    _probe, _token = None, secrets.token_hex(4)


os.register_at_fork(after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)


def client_id() -> str:
    """This process as a client: ``<pid>-<token>``, the start of its files' names."""
    return f"{os.getpid()}-{_token}"


def client_probe() -> dict[str, str] | None:
    """A small file only this client could have written; None where /dev/shm is unusable."""
    global _probe
    if time.monotonic() - _last_sweep >= SWEEP_AGE_S:
        _sweep_abandoned()
    if _probe is not None and os.path.exists(_probe["path"]):
        return _probe
    if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
        return None
    nonce = secrets.token_hex(16)
    # File names carry the pid of the client they serve (probe, rows, pooled files), so that
    # whatever a client leaves behind can be told from what a live one holds.
    fd, path = tempfile.mkstemp(prefix=f"{PROBE}{client_id()}-", dir=SHM_DIR)
    with os.fdopen(fd, "w") as f:
        f.write(nonce)
    _probe = {"path": path, "nonce": nonce}
    return _probe


def _sweep_abandoned() -> None:
    """Delete the probe, rows and pooled files of clients that are gone (``SWEEP_AGE_S``)."""
    global _last_sweep
    _last_sweep = time.monotonic()
    try:
        files = _files(PROBE, ROWS, FREE)
    except OSError:
        return
    now = time.time()
    for path, info in files:
        pid = _owner_pid(os.path.basename(path))
        if pid is not None and not _alive(pid) and now - info.st_mtime >= SWEEP_AGE_S:
            _remove(path)


def _files(*prefixes: str) -> list[tuple[str, os.stat_result]]:
    """``(path, stat)`` of the files in ``SHM_DIR`` named ``prefix*`` for one of ``prefixes``
    (files that vanish meanwhile, claimed or deleted by another process, are left out); OSError
    when the directory cannot be listed."""
    found = []
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefixes):
            path = os.path.join(SHM_DIR, name)
            try:
                found.append((path, os.stat(path)))
            except OSError:
                continue
    return found


def _owner_pid(name: str) -> int | None:
    """The client pid a file name carries (``vllm-capture-rows-<pid>-...``), else None."""
    for prefix in (PROBE, ROWS, FREE):
        if name.startswith(prefix):
            pid = name[len(prefix):].split("-", 1)[0]
            return int(pid) if pid.isdigit() and len(name) > len(prefix) + len(pid) else None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def client_owner(probe: Any) -> str | None:
    """The ``client_id`` of the client that wrote ``probe`` (from its file name), for naming its
    files; None for anything else."""
    path = probe.get("path") if isinstance(probe, dict) else None
    if not isinstance(path, str) or not os.path.basename(path).startswith(PROBE):
        return None
    pid, token = (os.path.basename(path)[len(PROBE):].split("-") + ["", ""])[:2]
    if not (pid.isdigit() and len(token) == 8 and set(token) <= set("0123456789abcdef")):
        return None
    return f"{pid}-{token}"


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


# Parts of a reply file's write, timed for the caller (``write_reply(parts=...)``): finding and
# preparing the file (pool, spare or new; populating it; the worker adds its probe check),
# copying the rows, keeping the mapping, and letting go of the rows' sources once they are in
# the file; then the CPU time that letting go took (far below its wall time would mean it waited,
# on a lock or the GIL; on the H200 the two were equal: work).
WRITE_PARTS = ("file", "copy", "keep", "release", "release_cpu")


def write_reply(reply: dict[str, Any], shared: bool = True, owner: str | None = None,
                parts: dict[str, float] | None = None) -> dict[str, Any]:
    """Make a fetch reply msgpack-safe, in place: the layers' rows (``FetchedRows``, from
    ``StreamStore.serialize(raw_data=True)``) are copied once, into one shared-memory file named
    for the client ``owner`` (its ``client_id``, :func:`client_owner`), when ``shared`` and there
    is room;
    into bytes otherwise. ``parts`` gains the seconds of each of ``WRITE_PARTS`` spent."""
    layers = list((reply.get("layers") or {}).values())
    sizes = [info["data"].nbytes for info in layers]
    # Each layer starts on a cache line, so its rows are aligned for any wire dtype.
    offsets = [0] * len(sizes)
    for i in range(1, len(sizes)):
        offsets[i] = -(-(offsets[i - 1] + sizes[i - 1]) // ALIGN) * ALIGN
    total = offsets[-1] + sizes[-1] if sizes else 0
    path = None
    if shared and total:
        path = _write_file([info["data"] for info in layers], offsets, total, owner,
                           {} if parts is None else parts)
    if path is None:
        for info in layers:
            info["data"] = info["data"].tobytes()
        return reply
    t0, c0 = time.perf_counter(), time.thread_time()
    for info, offset, nbytes in zip(layers, offsets, sizes):
        del info["data"]
        info["shm_offset"], info["shm_nbytes"] = offset, nbytes
    reply["shm_path"] = path
    if parts is not None:
        parts["release"] = parts.get("release", 0.0) + time.perf_counter() - t0
        parts["release_cpu"] = parts.get("release_cpu", 0.0) + time.thread_time() - c0
    return reply


def _write_file(blocks: list, offsets: list[int], total: int, owner: str | None,
                parts: dict[str, float]) -> str | None:
    """A file for the client ``owner``, of at least ``total`` bytes (a pooled one, else the
    spare, else a new one), with each block's rows copied in at its offset, through one mapping;
    None (and no file) when there is not room. Adds the seconds of ``WRITE_PARTS`` to ``parts``."""
    t0 = time.perf_counter()
    prefix = f"{ROWS}{owner}-" if owner else ROWS
    spare = None
    _freeze_spare()
    path = _claim_pooled(total, prefix)
    if path is not None:
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            path = None
    if path is None and owner:
        spare = _take_spare(owner, total)
        if spare is not None:
            path, fd = spare.path, spare.fd
    if path is None:
        try:
            st = os.statvfs(SHM_DIR)
            if st.f_bavail * st.f_frsize < FREE_SPACE_FACTOR * total:
                return None
            fd, path = tempfile.mkstemp(prefix=prefix, dir=SHM_DIR)
        except OSError:
            return None
    threads = max(1, min(WRITE_THREADS, total // POPULATE_BYTES))
    pool = _writers() if threads > 1 else None
    mapped = None
    try:
        try:
            info = os.fstat(fd)
            key = (info.st_dev, info.st_ino)
            if spare is not None:
                mapped = spare.mapped
                _raise_first(_populate(spare.base, spare.ready, total, pool, threads))
                # Populated up to the file's end, like every reply file (see _Spare).
                size = max(spare.ready, total)
                os.ftruncate(fd, size)
            else:
                mapped = _kept.pop(key, None)
                if mapped is None or len(mapped) < total:
                    _reap(maps=[mapped] if mapped is not None else [])
                    mapped = None  # the reaper closes it
                    # The whole file: a pooled file larger than this reply may carry a larger one.
                    mapped = _map_populated(fd, max(total, info.st_size), pool, threads)
                size = max(total, info.st_size)
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        _each(pool, _copy_blocks,
              [(mapped, share) for share in _shares([(b, o) for b, o in zip(blocks, offsets)
                                                    if b.nbytes], threads)])
        t2 = time.perf_counter()
        _keep(key, mapped, size)
        for part, seconds in zip(WRITE_PARTS, (t1 - t0, t2 - t1, time.perf_counter() - t2)):
            parts[part] = parts.get(part, 0.0) + seconds
    except BaseException as exc:
        _close(mapped)
        _remove(path)
        if isinstance(exc, OSError):
            return None
        raise
    return path


_writer_pool: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None


def _writers() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that populate and copy reply files, kept from one fetch to the next: a pool
    made per fetch started its threads during the copy (on the CPU VM, 0.25 ms to start 4 and run
    a task on each, against 0.07 ms on kept ones). Made again in a forked child, whose copy of the
    pool has no threads."""
    global _writer_pool
    if _writer_pool is None or _writer_pool[0] != os.getpid():
        _writer_pool = (os.getpid(),
                        concurrent.futures.ThreadPoolExecutor(WRITE_THREADS, "vllm-capture-shm"))
    return _writer_pool[1]


# ---- the spare: a reply file populated while the rows arrive ----------------------------------
# Fresh pages are most of a large fetch's cost (about 1 GB/s per thread). While a stream's rows
# arrive, the worker populates a file of about the size its store holds, on a thread of its own
# (munmap and madvise release the GIL), so the next fetch the pool cannot serve writes into pages
# that exist. Its memory is what the fetch would take anyway, taken earlier; at most the pool's
# cap, and only for a client that fetched through shared memory before.
# Bytes populated per call: the longest a fetch waits for the thread, and the longest the call
# holds the process's mmap lock (about 2 ms), which an mmap or munmap on another thread (a large
# allocation or free by the engine) would wait for.
SPARE_STEP = 2 << 20
_spare: "_Spare | None" = None
_spare_lock = threading.Lock()


class _Spare:
    """One spare file, named for its client: sized to the largest reply ``/dev/shm`` could take
    but sparse (only populated pages take memory) and mapped once at that size, so neither its
    growth nor a reply larger than it grew remaps it. Pages are populated from the start:
    ``ready`` bytes so far, growing towards ``target``."""

    def __init__(self, owner: str, span: int):
        fd, self.path = tempfile.mkstemp(prefix=f"{ROWS}{owner}-", dir=SHM_DIR)
        try:
            os.ftruncate(fd, span)
            self.mapped = mmap.mmap(fd, span, flags=mmap.MAP_SHARED,
                                    prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            _remove(self.path)
            raise
        self.fd, self.owner, self.base = fd, owner, _address(self.mapped)
        self.ready = self.target = 0
        self.taken = False
        self.stuck = False  # a populate call failed: this spare grows no further
        self.thread: threading.Thread | None = None

    def grow(self) -> None:
        """The populating thread: ``SPARE_STEP`` at a time, until ``target`` or taken."""
        while True:
            with _spare_lock:
                if self.taken or self.ready >= self.target:
                    self.thread = None
                    return
                start, stop = self.ready, min(self.target, self.ready + SPARE_STEP)
            error = _populate_range(self.base + start, stop - start)
            with _spare_lock:
                if error:  # tmpfs full, or a kernel without MADV_POPULATE_WRITE
                    self.target, self.stuck = self.ready, True
                else:
                    self.ready = stop

    def discard(self) -> None:
        with _spare_lock:
            self.taken = True
            thread = self.thread
        if thread is not None:
            thread.join()
        os.close(self.fd)
        _reap(maps=[self.mapped], paths=[self.path])


def want_spare(nbytes: int, owner: str) -> None:
    """The worker's store holds ``nbytes`` for the client ``owner``: grow the spare to a quarter
    more (within the pool's cap and half the free space of ``/dev/shm``), in the background. A
    spare of another client is discarded. While a pooled file could carry those rows (generate
    after generate of one size), the spare does not grow: the fetch will not need it, and its
    populating would take memory and hold the mmap lock for nothing."""
    global _spare
    try:
        cap = _pool_cap()
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    target = min(cap, -(-(nbytes + nbytes // 4) // mmap.PAGESIZE) * mmap.PAGESIZE)
    with _spare_lock:
        old = _spare if _spare is not None and _spare.owner != owner else None
        if old is not None:
            _spare = None
        spare = _spare
    if old is not None:
        old.discard()
    if _pool_serves(nbytes):
        return
    if spare is None:
        if target <= 0:
            return
        try:
            # A reply needs twice its size free in /dev/shm (FREE_SPACE_FACTOR): none is larger.
            spare = _Spare(owner, max(cap, st.f_blocks * st.f_frsize // FREE_SPACE_FACTOR))
        except OSError:
            return
        with _spare_lock:
            if _spare is not None:  # another thread made one meanwhile
                extra, spare = spare, None
            else:
                _spare, extra = spare, None
        if extra is not None:
            extra.discard()
            return
    with _spare_lock:
        room = st.f_bavail * st.f_frsize // FREE_SPACE_FACTOR
        spare.target = max(spare.target, min(target, spare.ready + room))
        if spare.thread is None and not (spare.taken or spare.stuck) and spare.ready < spare.target:
            spare.thread = threading.Thread(target=spare.grow, name="vllm-capture-spare",
                                            daemon=True)
            spare.thread.start()


def _freeze_spare() -> None:
    """A fetch is writing: the spare stops growing after its current step, until rows arrive
    again (``want_spare``). The rows it grew for are leaving, and each of its populate calls
    holds the mmap lock for a step (about 2 ms), which every munmap of the write (freeing the
    rows' sources) would wait for."""
    with _spare_lock:
        if _spare is not None:
            _spare.target = _spare.ready


def drop_spare() -> None:
    """No stream is capturing: delete the spare (its pages are freed in the background)."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        spare.discard()


def _take_spare(owner: str, total: int) -> "_Spare | None":
    """The spare of ``owner``, for a reply of ``total`` bytes, once its thread has stopped (at most
    one step). Like a pooled file, it serves no reply ``POOL_SLACK`` times smaller (a fetch of one
    layer would hold the whole spare's memory)."""
    global _spare
    with _spare_lock:
        spare = _spare
        if (spare is None or spare.owner != owner or (spare.ready == 0 and spare.thread is None)
                or spare.ready > POOL_SLACK * total + POOL_SLACK_BYTES
                or total > len(spare.mapped)):
            return None
        _spare = None
        spare.taken = True
        thread = spare.thread
    if thread is not None:
        thread.join()
    if spare.ready == 0:  # its only step failed
        spare.discard()
        return None
    return spare


def _keep(key: tuple[int, int], mapped: mmap.mmap, size: int) -> None:
    """Keep the mapping of a file this worker wrote, for when the file comes back from the pool:
    writing through existing page tables skips populating them again. A file larger than the
    pool may hold never comes back, so its mapping is closed now, while the client still maps
    the file. Mappings of files that no longer exist are closed (their pages are freed then),
    and at most ``KEEP_MAPPINGS`` are kept. Closing runs in the background (:func:`_reap`). ``size``
    is the file's: a spare's mapping is longer."""
    try:
        live = {(info.st_dev, info.st_ino) for _, info in _files(ROWS, FREE)}
        cap = _pool_cap()
    except OSError:
        live, cap = set(), 0
    stale = []
    if size <= cap:
        _kept[key] = mapped
    else:
        stale.append(mapped)
    stale += [_kept.pop(old) for old in [k for k in _kept if k not in live]]
    while len(_kept) > KEEP_MAPPINGS:
        stale.append(_kept.pop(next(iter(_kept))))
    _reap(maps=stale)


def _reap(maps: list[mmap.mmap] = (), paths: list[str] = ()) -> None:
    """Close ``maps`` and delete ``paths`` on a thread of their own (see ``REAPER``)."""
    if not maps and not paths:
        return

    def work():
        for mapped in maps:
            _unmap(mapped)
        for path in paths:
            _remove(path)

    threading.Thread(target=work, name=REAPER, daemon=True).start()


def settle() -> None:
    """Wait until the mappings and files handed to :func:`_reap` are gone."""
    for thread in threading.enumerate():
        if thread.name == REAPER:
            thread.join()


def _pool_cap() -> int:
    """Bytes the pool may hold: ``POOL_BYTES``, at most a quarter of ``/dev/shm`` (OSError when
    it cannot be read)."""
    if POOL_FILES < 1:
        return 0
    st = os.statvfs(SHM_DIR)
    return min(POOL_BYTES, st.f_blocks * st.f_frsize // 4)


def _unmap(mapped: mmap.mmap) -> None:
    """Close ``mapped`` without holding the mmap lock for long (see ``UNMAP_STEP``). Only the
    part within the file's size can hold pages: a spare's mapping spans half of ``/dev/shm``."""
    try:
        base = _address(mapped)
        length = min(len(mapped), mapped.size())
    except (BufferError, ValueError, TypeError, OSError):  # closed already, or exported
        base = None
    if base is not None:
        for start in range(0, length, UNMAP_STEP):
            if _libc.madvise(base + start, min(UNMAP_STEP, length - start), _MADV_DONTNEED):
                break  # the close below unmaps the rest at once
    _close(mapped)


def _close(mapped: mmap.mmap | None) -> None:
    if mapped is None:
        return
    try:
        mapped.close()
    except BufferError:  # a view still held by an exception's traceback
        pass


def _shares(blocks: list[tuple], threads: int) -> list[list[tuple]]:
    """``(rows, offset)`` blocks as ``(rows, offset, part)`` copies (``part``: rows of
    ``FetchedRows.copy_into``) in at most ``threads`` shares of about equal bytes: the blocks laid
    end to end and cut into equal shares at row boundaries. So a layer larger than a share is
    copied by several threads (a 4-layer fetch of all positions kept four of eight busy), and
    small layers share one task: a last-token fetch of 8B's 32 layers is 32 blocks of 512 KB,
    whose copies took less time than handing each to a pool thread (on the CPU VM: 0.75 ms grouped
    against 1.01 ms a block each, on 2 threads)."""
    total = sum(rows.nbytes for rows, _ in blocks)
    count = max(1, min(threads, total))
    shares: list[list[tuple]] = [[] for _ in range(count)]
    before = 0  # bytes of the blocks before this one
    for rows, offset in blocks:
        row_bytes = rows.nbytes // rows.shape[0]
        start = 0
        while start < rows.shape[0]:
            share = min(count - 1, (before + start * row_bytes) * count // total)
            share_end = -(-(share + 1) * total // count)  # in bytes, from the first block's start
            stop = min(rows.shape[0], max(start + 1, -(-(share_end - before) // row_bytes)))
            shares[share].append((rows, offset, (start, stop)))
            start = stop
        before += rows.nbytes
    return [share for share in shares if share]


def _copy_blocks(mapped: mmap.mmap, blocks: list[tuple]) -> None:
    for rows, offset, part in blocks:
        rows.copy_into(memoryview(mapped)[offset: offset + rows.nbytes], part)


def _each(pool: concurrent.futures.Executor | None, fn, items: list[tuple]) -> list:
    """``fn(*item)`` for every item, on the pool's threads (here without a pool). Every call has
    finished when this returns or raises (the mapping they write to closes next)."""
    if pool is None:
        return [fn(*item) for item in items]
    futures = [pool.submit(fn, *item) for item in items]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]


def _map_populated(fd: int, total: int, pool: concurrent.futures.Executor | None,
                   threads: int) -> mmap.mmap:
    """A shared writable mapping of the file's first ``total`` bytes, every page allocated (a
    no-op for a pooled file's pages); OSError where tmpfs has no room. Through a mapping, a page
    the kernel cannot provide is a SIGBUS at the first write, not an error: hence reserving first.
    Populating up front, on several threads, beats a page fault per page during the copy."""
    if os.fstat(fd).st_size < total:
        os.ftruncate(fd, total)
    mapped = mmap.mmap(fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        failures = _populate(_address(mapped), 0, total, pool, threads)
        if failures and all(e in (errno.EINVAL, errno.ENOSYS) for e in failures):
            # A kernel without MADV_POPULATE_WRITE: reserve, then populate on one thread.
            mapped.close()
            os.posix_fallocate(fd, 0, total)
            return mmap.mmap(fd, total, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _raise_first(failures)
    except BaseException:
        mapped.close()
        raise
    return mapped


def _address(mapped: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mapped)
    base = ctypes.addressof(view)
    del view  # releases the buffer export, so the mapping can close
    return base


def _populate(base: int, start: int, stop: int, pool: concurrent.futures.Executor | None,
              threads: int) -> list[int]:
    """Populate bytes ``[start, stop)`` of the mapping at ``base`` (``start`` on a page), in one
    range per thread; the errnos of the ranges that failed."""
    if stop <= start:
        return []
    step = -(-(-(-(stop - start) // threads)) // mmap.PAGESIZE) * mmap.PAGESIZE
    ranges = [(base + at, min(step, stop - at)) for at in range(start, stop, step)]
    return [e for e in _each(pool, _populate_range, ranges) if e]


def _raise_first(failures: list[int]) -> None:
    if failures:
        code = next((e for e in failures if e not in (errno.EINVAL, errno.ENOSYS)), failures[0])
        raise OSError(code, f"populating the capture reply file: {os.strerror(code)}")


def _populate_range(address: int, length: int) -> int:
    """Allocate and map the pages of one range of a mapping; 0, or the errno of the failure."""
    if _libc.madvise(address, length, _MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def _serves(size: int, total: int) -> bool:
    """Whether a file of ``size`` bytes may carry a reply of ``total``: it holds it and is not
    ``POOL_SLACK`` times larger (plus ``POOL_SLACK_BYTES``)."""
    return total <= size <= POOL_SLACK * total + POOL_SLACK_BYTES


def _pool_serves(total: int) -> bool:
    """Whether a pooled file could carry a reply of ``total`` bytes now."""
    try:
        return any(_serves(info.st_size, total) for _, info in _files(FREE))
    except OSError:
        return False


def _claim_pooled(total: int, prefix: str) -> str | None:
    """Take the smallest pooled file that holds ``total`` bytes (renamed to ``prefix*``), or None."""
    try:
        pooled = _files(FREE)
    except OSError:
        return None
    fitting = sorted((info.st_size, path) for path, info in pooled
                     if _serves(info.st_size, total))
    for _, path in fitting:
        claimed = os.path.join(SHM_DIR, prefix + secrets.token_hex(8))
        try:
            os.rename(path, claimed)
            # A rename keeps the time of the file's last release: a sweep from a client that
            # cannot see this one's pid (another pid namespace) would take it for abandoned.
            os.utime(claimed)
        except OSError:
            continue  # another worker took it
        return claimed
    return None


def _release(path: str, size: int) -> None:
    """The last tensor of a fetch is gone: pool its file, evicting the pool's least recently
    released files to make room (a pool full of small files would otherwise turn away every large
    one, and files left by killed clients would hold it forever); delete it if a forked child may
    still map it, and in the background if it is larger than the pool may hold."""
    _mapped.discard(path)
    if path in _inherited:
        _inherited.discard(path)
        return
    if _exiting or path in _shared_with_child:
        _shared_with_child.discard(path)
        _remove(path)
        return
    try:
        cap = _pool_cap()
        if size > cap:
            _reap(paths=[path])
            return
        pooled = sorted((info.st_mtime, free, info.st_size) for free, info in _files(FREE))
        held = sum(p[2] for p in pooled)
        while pooled and (len(pooled) >= POOL_FILES or held + size > cap):
            _, oldest, oldest_size = pooled.pop(0)
            _remove(oldest)
            held -= oldest_size
        free = os.path.join(SHM_DIR, f"{FREE}{os.getpid()}-{secrets.token_hex(8)}")
        os.rename(path, free)
        os.utime(free)  # released now: the last to be evicted
        _pooled.add(free)
    except OSError:
        _remove(path)


def _at_exit() -> None:
    """A worker deletes its spare. A client deletes the files it pooled, and the spares of
    workers that did not (killed before their exit); files released after this are deleted, not
    pooled (``weakref.finalize`` runs its exit hook before or after this one, by registration
    order)."""
    global _exiting
    _exiting = True
    drop_spare()
    settle()
    for path in _pooled:
        _remove(path)
    if _probe is not None:  # made by this process (a forked child makes its own)
        _remove(_probe["path"])
    try:
        mine = _files(f"{ROWS}{client_id()}-")
    except OSError:
        mine = []
    for path, _ in mine:
        _remove(path)  # the rows of fetches this process held die with it


atexit.register(_at_exit)


def read_reply(reply: dict[str, Any]) -> dict[str, Any]:
    """Put the rows of a shared-memory reply back into its layer entries.

    The entries' ``"data"`` are writable views of one private (copy-on-write) mapping of the
    file: the decoder's tensors view it, and when the last of them is freed the mapping goes and
    the file returns to the pool (or is deleted)."""
    path = reply.pop("shm_path", None)
    if path is None:
        return reply
    if not (isinstance(path, str) and os.path.dirname(path) == SHM_DIR
            and os.path.basename(path).startswith(ROWS)):
        raise ValueError(f"capture reply names an unexpected shared-memory file {path!r}")
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Private and writable: the tensors viewing it are writable (numpy and torch do not
            # warn), and a write copies the page instead of reaching the file.
            mapped = (mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE) if size else None)
    except BaseException:
        _remove(path)
        raise
    if mapped is None:
        _remove(path)
        data = memoryview(bytearray())
    else:
        # Runs when the last view of the mapping is freed, or at exit.
        weakref.finalize(mapped, _release, path, size)
        _mapped.add(path)
        data = memoryview(mapped)
    for key, info in (reply.get("layers") or {}).items():
        start, nbytes = info.pop("shm_offset", None), info.pop("shm_nbytes", None)
        if not (isinstance(start, int) and isinstance(nbytes, int)
                and 0 <= start and 0 <= nbytes and start + nbytes <= len(data)):
            raise ValueError(f"capture layer {key}: shared-memory span ({start!r}, {nbytes!r}) "
                             f"outside the {len(data)}-byte file")
        info["data"] = data[start: start + nbytes]
    return reply


def read_replies(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`read_reply` for every rank's reply; every file is released even if one is bad."""
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
