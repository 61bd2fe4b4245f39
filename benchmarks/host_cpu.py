"""What the host's CPUs are: the 1B's steps wait on them, and its capture cost moved by several
percent from one H200 machine to the next (sessions 17-30), so every run records them.

    python3 benchmarks/host_cpu.py    # one line: model, MHz, caches, threads per core
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

# /proc/cpuinfo fields kept, by the name they are recorded under.
FIELDS = {"model name": "model", "cpu family": "family", "model": "model_number",
          "stepping": "stepping", "microcode": "microcode", "cache size": "cache"}


def describe(cpuinfo: str | None = None, sys_cpu: Path = Path("/sys/devices/system/cpu")) -> dict:
    """The first CPU's identity from ``/proc/cpuinfo`` (``cpuinfo``: its text), the mean and
    range of every CPU's current MHz, threads per core, and the first CPU's last-level cache;
    fields the host does not expose are left out."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    blocks = [b for b in cpuinfo.split("\n\n") if b.strip()]
    out: dict = {}
    mhz = []
    for n, block in enumerate(blocks):
        fields = dict(line.split(":", 1) for line in block.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        if n == 0:
            out.update({name: fields[key] for key, name in FIELDS.items() if key in fields})
            if "siblings" in fields and "cpu cores" in fields:
                out["threads_per_core"] = int(fields["siblings"]) // max(1, int(fields["cpu cores"]))
        if "cpu MHz" in fields:
            mhz.append(float(fields["cpu MHz"]))
    if mhz:
        out["mhz"] = {"mean": round(statistics.fmean(mhz)), "min": round(min(mhz)),
                      "max": round(max(mhz)), "cpus": len(mhz)}
    levels = sorted(sys_cpu.glob("cpu0/cache/index*"))
    if levels:
        try:
            last = max(levels, key=lambda p: int((p / "level").read_text()))
            out["last_level_cache"] = (f"L{(last / 'level').read_text().strip()} "
                                       f"{(last / 'size').read_text().strip()}")
        except (OSError, ValueError):
            pass
    out["affinity"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    thp = thp_mode()
    if thp is not None:
        out["transparent_hugepage"] = thp
    return out


def thp_mode(path: Path = Path("/sys/kernel/mm/transparent_hugepage/enabled")) -> str | None:
    """The kernel's transparent huge page mode (always, madvise or never): the client's copies
    into fresh memory ran 3x faster on huge pages (``client_copies.py``)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


if __name__ == "__main__":
    print("cpu", json.dumps(describe()))
