"""The benchmark suite's pure parts (scenario data, planning, time budget, ratios, checks, files),
the engine-free fetch benchmark's row check, the engine-free step-path benchmark, and the
ablation's step timers by phase (across a fork, as in the engine core)."""

import gzip
import json
import math
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import report as R
from benchmarks import scenarios as S
from benchmarks.run import engine_log_facts, results_dir


# ---- scenario data ---------------------------------------------------------------------------

def test_model_configs_have_the_real_shapes():
    c8 = S.MODELS["8b"].config()
    assert (c8["hidden_size"], c8["num_hidden_layers"], c8["num_attention_heads"],
            c8["num_key_value_heads"], c8["intermediate_size"], c8["vocab_size"]) == \
        (4096, 32, 32, 8, 14336, 128256)
    c1 = S.MODELS["1b"].config()
    assert (c1["hidden_size"], c1["num_hidden_layers"], c1["num_key_value_heads"],
            c1["intermediate_size"]) == (2048, 16, 8, 8192)
    moe = S.MODELS["moe"].config()
    assert moe["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (moe["hidden_size"], moe["num_hidden_layers"], moe["num_attention_heads"],
            moe["num_key_value_heads"], moe["head_dim"], moe["num_experts"],
            moe["num_experts_per_tok"], moe["moe_intermediate_size"], moe["vocab_size"]) == \
        (2048, 48, 32, 4, 128, 128, 8, 768, 151936)
    assert "num_experts" not in c8
    json.dumps(moe)  # config.json must serialize


def test_1b_rows_shape_is_the_1b_but_its_mlp():
    """The CPU profiles' shape: the 1B's rows (what the fetch and the client handle), a cheap MLP."""
    rows, one_b = S.MODELS["1b-rows"].config(), S.MODELS["1b"].config()
    assert rows.pop("intermediate_size") == 128
    one_b.pop("intermediate_size")
    assert rows == one_b
    for stream in (S.HIDDEN, S.HEADS):
        assert S.MODELS["1b-rows"].width(stream) == S.MODELS["1b"].width(stream)


def test_extract_inputs_prompts_are_fixed_and_in_range():
    import argparse

    from benchmarks.extract_inputs import prompt_lines, word_range
    from vllm_capture.tiny_models import CORPUS

    vocabulary = {w for line in CORPUS for w in line.split()}
    lines = prompt_lines(200, (3, 8))
    assert lines == prompt_lines(200, (3, 8))  # two packages' runs read the same text
    assert lines != prompt_lines(200, (3, 8), seed=1)
    counts = [len(line.split()) for line in lines]
    assert min(counts) == 3 and max(counts) == 8
    assert {w for line in lines for w in line.split()} <= vocabulary
    assert word_range("20-120") == (20, 120) and word_range("7") == (7, 7)
    for bad in ("9-3", "0-4", "a", "3-x"):
        with pytest.raises(argparse.ArgumentTypeError):
            word_range(bad)


def test_widths_per_stream():
    m = S.MODELS["moe"]
    assert m.width(S.HIDDEN) == 2048 and m.width(S.HEADS) == 4096 and m.width(S.ROUTER) == 128


@pytest.mark.parametrize("n, want", [(32, [0, 10, 21, 31]), (16, [0, 5, 10, 15]), (4, [0, 1, 2, 3]),
                                     (2, [0, 1]), (48, [0, 16, 31, 47])])
def test_spread_layers(n, want):
    assert S.spread_layers(n) == want


def test_workload_rows_and_names():
    w = S.decode(64)
    assert (w.name, w.prompt_len, w.new_tokens, w.generated_tokens) == ("decode-c64", 32, 256, 64 * 256)
    assert w.positions_per_request == 32 + 255  # the last sampled token is never fed back
    p = S.prefill(256)
    assert (p.name, p.prompt_len, p.new_tokens) == ("prefill-c256", 2048, 8)


def test_capture_expected_rows_and_bytes():
    shape, w = S.MODELS["8b"], S.decode(64)
    last = S.SCENARIOS["hidden-last"].capture
    assert last.rows_per_layer(w) == 64 and last.num_layers(shape) == 32
    assert last.expected_bytes(shape, w) == 64 * 32 * 4096 * 2
    four = S.SCENARIOS["hidden-4l"].capture
    assert four.layer_ids(shape) == [0, 10, 21, 31]
    assert four.expected_bytes(shape, w) == 64 * 287 * 4 * 4096 * 2
    assert S.SCENARIOS["router-all"].capture.expected_bytes(S.MODELS["moe"], w) == 64 * 287 * 48 * 128 * 4


def test_every_capture_scenario_has_an_eager_twin():
    graph = {n for n, s in S.SCENARIOS.items() if s.engine == "capture-graph" and s.capture}
    for n in graph:
        twin = S.SCENARIOS[f"eager-{n}"]
        assert twin.engine == "capture-eager" and twin.capture == S.SCENARIOS[n].capture


# ---- suites and plans ------------------------------------------------------------------------

def test_quick_suite():
    suite = S.make_suite("quick")
    shape = S.MODELS[suite.model]
    assert suite.model == "1b" and [w.name for w in suite.workloads] == ["decode-c64"]
    assert suite.engines_for(shape) == ["vanilla-graph", "capture-graph"]
    names = [s.name for s in suite.scenarios_for(shape)]
    assert names == ["vanilla", "idle", "hidden-last", "hidden-4l"]
    # Under 3 minutes with start-up: the budget, and the grace before workers are stopped.
    assert suite.budget_s + suite.grace_s <= 200


def test_full_suite_moe_only_router_and_eager_trim():
    suite = S.make_suite("full", "8b")
    assert "router-all" not in [s.name for s in suite.scenarios_for(S.MODELS["8b"])]
    assert "router-all" in [s.name for s in suite.scenarios_for(S.MODELS["moe"])]
    assert [w.name for w in suite.workloads_for("capture-eager")] == ["decode-c64", "prefill-c64"]
    assert len(suite.workloads_for("capture-graph")) == len(suite.workloads)
    assert suite.workloads[0].name == "decode-c64"  # the first workload always runs
    assert suite.max_model_len >= 2048 + 8 and suite.max_num_seqs == 256


def test_plan_skips_captures_over_the_host_cap():
    suite = S.make_suite("full", "8b")
    plan, skips = S.plan_engine(suite, S.MODELS["8b"], "capture-graph")
    planned = {(w.name, s.name) for w, scens in plan for s in scens}
    assert ("decode-c64", "heavy") in planned  # 4.8 GB
    assert ("prefill-c64", "heavy") not in planned  # 34 GB
    assert {(s["workload"], s["scenario"]) for s in skips} == {("prefill-c64", "heavy"),
                                                              ("decode-c256", "heavy")}
    assert all("host cap" in s["reason"] for s in skips)


def test_engine_kwargs_differ_only_where_they_must():
    suite, shape = S.make_suite("full", "8b"), S.MODELS["8b"]
    van, cap, eag = (S.engine_kwargs(suite, shape, e) for e in ("vanilla-graph", "capture-graph", "capture-eager"))
    assert van["load_format"] == "dummy" and "enforce_eager" not in van and "capture_buffer_bytes" not in van
    assert {k: v for k, v in cap.items() if k != "capture_buffer_bytes"} == van
    assert eag["enforce_eager"] is True
    # the ring holds a full step of rows at every call site of every component
    per_row = 32 * (4096 * 2 + 12) * 2 * 2
    assert cap["capture_buffer_bytes"] >= per_row * suite.max_num_batched_tokens
    cpu = S.make_suite("tiny-cpu")
    kw = S.engine_kwargs(cpu, S.MODELS["tiny"], "vanilla-graph")
    assert kw["enforce_eager"] is True and "gpu_memory_utilization" not in kw and "load_format" not in kw


def test_graph_engines_run_side_by_side_when_the_weights_fit_twice():
    full = S.make_suite("full", "8b")
    assert S.MODELS["8b"].weight_bytes == pytest.approx(16.06e9, rel=0.01)  # Llama-3.1-8B: 8.03B params
    assert S.MODELS["moe"].weight_bytes == pytest.approx(61.1e9, rel=0.01)  # Qwen3-30B-A3B: 30.5B
    assert S.engine_groups(full, S.MODELS["8b"]) == [["capture-graph", "vanilla-graph"],
                                                     ["capture-eager"], ["vanilla-eager"]]
    assert S.engine_groups(full, S.MODELS["moe"]) == [[e] for e in full.engines_for(S.MODELS["moe"])]
    # side by side, the two engines share the memory one engine has alone
    for e in ("vanilla-graph", "capture-graph"):
        assert S.engine_kwargs(full, S.MODELS["8b"], e)["gpu_memory_utilization"] == pytest.approx(0.425)
    assert S.engine_kwargs(full, S.MODELS["8b"], "capture-eager")["gpu_memory_utilization"] == 0.85
    assert S.engine_kwargs(full, S.MODELS["moe"], "capture-graph")["gpu_memory_utilization"] == 0.85
    apart = S.engine_groups(replace(full, side_by_side=False), S.MODELS["8b"])
    assert all(len(g) == 1 for g in apart)
    cpu = S.make_suite("tiny-cpu")
    assert S.engine_groups(cpu, S.MODELS["tiny"])[0] == ["capture-graph", "vanilla-graph"]
    assert "gpu_memory_utilization" not in S.engine_kwargs(cpu, S.MODELS["tiny"], "capture-graph")


H100_BYTES, H200_BYTES = 81559 << 20, 143771 << 20  # NVML's totals of the cards lent


def test_memory_shortfall_names_the_engine_that_cannot_start_and_its_parts():
    """The 8B's three graph engines side by side do not fit an H100 (session 55: the capture
    engine's start failed with "No available memory for the cache blocks"); two do, and three fit
    an H200. The floor is the weights, the capture buffers, one max_model_len sequence's KV cache
    and a margin, against the engine's gpu_memory_utilization of the card."""
    shape = S.MODELS["8b"]
    with_control = S.select(S.make_suite("full", "8b"), workloads="decode-c64",
                            scenarios="vanilla,vanilla-b,idle,hidden-last")
    three = S.engine_groups(with_control, shape)[0]
    assert sorted(three) == ["capture-graph", "vanilla-graph", "vanilla-graph-b"]
    floor = S.engine_floor_bytes(with_control, shape, "capture-graph")
    kv_one_sequence = with_control.max_model_len * 32 * 2 * 8 * 128 * 2
    assert floor == {"weights": shape.weight_bytes,
                     "capture buffers": S.ring_buffer_bytes(shape, 8192),
                     "one sequence's KV cache": kv_one_sequence,
                     "activations and graphs": S.ENGINE_OVERHEAD_BYTES}
    assert S.engine_floor_bytes(with_control, shape, "vanilla-graph")["capture buffers"] == 0
    why = S.memory_shortfall(with_control, shape, three, H100_BYTES)
    assert why.startswith(f"capture-graph needs at least {sum(floor.values()) / S.GIB:.1f} GiB "
                          "(weights 15.0, capture buffers 8.4, one sequence's KV cache 0.1")
    assert "0.283" in why and "fewer engines side by side" in why
    share = S.engine_kwargs(with_control, shape, "capture-graph")["gpu_memory_utilization"]
    assert sum(floor.values()) > share * H100_BYTES  # what the message says, from its parts
    assert S.memory_shortfall(with_control, shape, three, H200_BYTES) is None
    without = S.select(with_control, scenarios="vanilla,idle,hidden-last")
    two = S.engine_groups(without, shape)[0]
    assert len(two) == 2 and S.memory_shortfall(without, shape, two, H100_BYTES) is None
    # Alone, an engine that does not fit can only move to a larger card.
    moe = S.make_suite("full", "moe")
    alone = S.memory_shortfall(moe, S.MODELS["moe"], ["capture-graph"], H100_BYTES)
    assert alone.endswith("run on a GPU with more memory")
    assert S.memory_shortfall(moe, S.MODELS["moe"], ["vanilla-graph"], H100_BYTES) is None
    # No GPU known, or engines without a share (CPU): nothing to check.
    assert S.memory_shortfall(with_control, shape, three, None) is None
    cpu = S.make_suite("tiny-cpu")
    assert S.memory_shortfall(cpu, S.MODELS["tiny"], ["capture-graph"], 1) is None


def test_a_group_that_does_not_fit_is_skipped_before_its_worker_starts(tmp_path, monkeypatch):
    """run_engines on an H100-sized GPU: the 8B's three engines are not started, each scenario is
    skipped naming the shortfall; the same run on an H200-sized GPU starts its worker."""
    from benchmarks import run

    jobs = []

    def worker(args, log, env, kill_at, on_line=None, events=None):
        jobs.append(json.loads(Path(args[1]).read_text()))
        log.write_text("")
        return 0

    monkeypatch.setattr(run, "run_subprocess", worker)
    (tmp_path / "work").mkdir()
    monkeypatch.setattr(run.tempfile, "mkdtemp", lambda prefix=None: str(tmp_path / "work"))
    for gpu_bytes in (H100_BYTES, H200_BYTES):
        monkeypatch.setattr(run.Nvml, "device", lambda self, b=gpu_bytes: {
            "gpu": "card", "driver": "1", "gpu_memory_bytes": b})
        suite = run.Suite(run.parse_args([
            "--suite", "full", "--model", "8b", "--workloads", "decode-c64", "--scenarios",
            "vanilla,vanilla-b,idle,hidden-last", "--out", str(tmp_path)]))
        suite.run_engines(tmp_path)
        if gpu_bytes == H100_BYTES:
            assert jobs == []
            assert {s["scenario"] for s in suite.skipped} == {"vanilla", "vanilla-b", "idle",
                                                               "hidden-last"}
            assert all(s["reason"].startswith("does not fit: capture-graph needs at least")
                       for s in suite.skipped)
            assert all(i["error"].startswith("not started: does not fit")
                       for i in suite.engines.values())
        else:
            assert len(jobs) == 1 and sorted(jobs[0]["engines"]) == sorted(
                ["vanilla-graph-b", "capture-graph", "vanilla-graph"])


def test_an_engine_cores_root_cause_joins_the_error_that_points_to_it(tmp_path, monkeypatch):
    """vLLM's LLM() raises "...See root cause above." where its engine core failed to start: the
    error recorded for the engine carries the core's last exception from the log."""
    import importlib.util
    import io

    from vllm.utils.system_utils import _add_prefix

    from benchmarks import run

    source = Path(importlib.util.find_spec("vllm.v1.engine.utils").origin).read_text()
    assert run.ROOT_CAUSE_ABOVE in source  # vLLM 0.26's own wording
    out = io.StringIO()
    for pid, line in [(7, "ERROR 12-06 17:20:01 [core.py:1] KeyError: 'earlier, another core'"),
                      (8, "INFO 12-06 17:21:33 [gpu_worker.py:560] Available KV cache memory: "
                          "-2.03 GiB"),
                      (8, "ERROR 12-06 17:21:33 [core.py:1330] ValueError: No available memory "
                          "for the cache blocks."),
                      (8, "INFO 12-06 17:21:34 [core.py:1313] EngineCore: exiting")]:
        f = io.StringIO()
        _add_prefix(f, "EngineCore", pid)
        f.write(line + "\n")
        out.write(f.getvalue())
    out.write("RuntimeError: Engine core initialization failed. See root cause above.\n")
    cause = "ValueError: No available memory for the cache blocks."
    assert run.engine_core_error(out.getvalue()) == cause
    assert run.engine_core_error("INFO nothing failed\n") is None

    raised = (f"RuntimeError: Engine core initialization failed. {run.ROOT_CAUSE_ABOVE} "
              "Failed core proc(s): {}")

    def worker(args, log, env, kill_at, on_line=None, events=None):
        log.write_text(out.getvalue())
        on_line({"engine": "vanilla-graph", "type": "engine", "init_s": 12.0})
        on_line({"engine": "capture-graph", "type": "error", "error": raised})
        return 1

    monkeypatch.setattr(run, "run_subprocess", worker)
    (tmp_path / "work").mkdir()
    monkeypatch.setattr(run.tempfile, "mkdtemp", lambda prefix=None: str(tmp_path / "work"))
    suite = run.Suite(run.parse_args(["--suite", "quick", "--scenarios", "vanilla,idle",
                                      "--out", str(tmp_path)]))
    bar = type("Bar", (), {"set_postfix_str": lambda *a: None, "update": lambda *a: None})()
    suite.run_group(["vanilla-graph", "capture-graph"], tmp_path, [], suite.end, bar)
    assert suite.engines["capture-graph"]["error"] == f"{raised} Root cause: {cause}"
    assert suite.engines["vanilla-graph"]["error"] == "worker exited with 1"


def test_cpu_groups_give_each_process_group_whole_cores_of_its_own():
    smt = [[c, c + 8] for c in range(8)]  # 8 physical cores, two threads each
    groups = S.cpu_groups(smt, 3)
    assert groups == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13]]
    assert S.cpu_groups([[c] for c in range(64)], 3) == [list(range(0, 4)), list(range(4, 8)),
                                                         list(range(8, 12))]  # at most 4 cores
    assert S.cpu_groups([[0], [1]], 2) == [[0], [1]]
    with pytest.raises(ValueError, match="2 physical cores for 3 groups"):
        S.cpu_groups([[0], [1]], 3)


def test_pin_moves_every_thread_of_a_process_onto_its_cpus():
    import os
    import subprocess
    import sys

    from benchmarks.run import physical_cores, pin

    cores = physical_cores()
    assert sorted(c for core in cores for c in core) == sorted(os.sched_getaffinity(0))
    # A child with a second thread started before the pin: both threads move.
    child = subprocess.Popen([sys.executable, "-c",
                              "import threading, time\n"
                              "threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
                              "print('ready', flush=True); time.sleep(30)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        target = cores[-1]
        pin([child.pid], target)
        tids = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(tids) == 2
        assert all(os.sched_getaffinity(t) == set(target) for t in tids)
    finally:
        child.kill()
        child.wait()


def test_engines_rotate_over_the_cpu_groups_rep_by_rep():
    groups = [[4, 5], [6, 7], [8, 9]]
    engines = ["capture-graph", "vanilla-graph", "vanilla-graph-b"]
    placed = [S.rotated_cpus(engines, groups, rep) for rep in range(6)]
    for cpus in placed:  # every rep: each engine on a group of its own
        assert sorted(map(tuple, cpus.values())) == sorted(map(tuple, groups))
    for e in engines:  # over twice as many reps as groups: each engine on every group, in a
        # forward (even) rep and in a reversed (odd) one
        assert sorted(tuple(placed[rep][e]) for rep in range(0, 6, 2)) == sorted(map(tuple, groups))
        assert sorted(tuple(placed[rep][e]) for rep in range(1, 6, 2)) == sorted(map(tuple, groups))
    assert S.rotated_cpus(engines, groups, 6) == placed[0]


def test_engines_table_names_the_cpus_of_pinned_engines():
    assert R._cpus([8, 0, 1, 2, 10, 9]) == "0-2,8-10" and R._cpus(None) == "-"


def test_plan_group_alternates_engines_within_each_workload():
    suite = S.select(S.make_suite("full", "8b"), workloads="decode-c64,prefill-c64")
    plan, skips = S.plan_group(suite, S.MODELS["8b"], ["vanilla-graph", "capture-graph"])
    assert [w.name for w, _ in plan] == ["decode-c64", "prefill-c64"]
    assert [s.name for s in plan[0][1]] == ["vanilla", "idle", "hidden-last", "hidden-4l", "heads-4l", "heavy"]
    assert "heavy" not in [s.name for s in plan[1][1]]
    assert [(s["workload"], s["scenario"]) for s in skips] == [("prefill-c64", "heavy")]


def test_engine_log_facts_from_the_log_lines_vllm_writes():
    """Each engine's KV cache tokens and how it got its compiled model, read from vLLM 0.26's own
    messages, each written through vLLM's per-process prefix as an engine core's stdout is: a
    line goes to the engine whose processes include its pid, whatever the order of the lines."""
    import importlib.util
    import io

    from vllm.utils.system_utils import _add_prefix

    def message(module: str, pattern: str) -> str:
        return re.search(pattern, Path(importlib.util.find_spec(module).origin).read_text()).group(1)

    compiled = message("vllm.compilation.backends", r'"(Compiling a graph for compile range %s takes %\.2f s)"')
    loaded_graph = message("vllm.compilation.backends",
                           r'"(Directly load the compiled graph\(s\) for compile range %s )"')
    loaded_aot = message("vllm.compilation.decorators", r'"(Directly load AOT compilation from path %s)"')
    kv = message("vllm.v1.core.kv_cache_utils", r'"(GPU KV cache size: %s tokens)"')
    out = io.StringIO()
    for pid, line in [(11, compiled % ("(1, 8192)", 10.9)), (22, kv % f"{900:,}"),
                      (22, loaded_aot % "/cache/model"), (55, loaded_graph % "(1, 8192)"),
                      (33, loaded_aot % "/cache/model"), (34, compiled % ("(1, 8192)", 3.0)),
                      (44, "Dynamo bytecode transform time: 1.67 s"), (33, kv % f"{1234567:,}"),
                      (11, kv % f"{1000:,}")]:
        f = io.StringIO()
        _add_prefix(f, "EngineCore", pid)
        f.write(f"INFO 12-02 00:26:24 [x.py:1] {line}\n")
        out.write(f.getvalue())
    out.write(compiled % ("(1, 8192)", 1.0) + "\n")  # no process prefix: nobody's
    out.write(kv % "77" + "\n")
    got = engine_log_facts(out.getvalue(), {"a": [11], "b": [22], "c": [33, 34], "d": [44],
                                            "e": [], "f": [55]})
    # c: one process loaded and another compiled (TP workers): it compiled.
    assert {e: f["compiled_model"] for e, f in got.items()} == {
        "a": "compiled", "b": "loaded", "c": "compiled", "d": None, "e": None, "f": "loaded"}
    assert {e: f["kv_cache_tokens"] for e, f in got.items()} == {
        "a": 1000, "b": 900, "c": 1234567, "d": None, "e": None, "f": None}


def test_warm_cache_runs_the_warmers_apart_and_reads_how_each_engine_got_its_model(tmp_path, monkeypatch):
    """The parent's side of --warm-cache, its worker faked: the warmers start in a worker of
    their own, unpinned and with nothing to run, and are kept out of the run's engines; every
    engine's processes' log lines say how it got its compiled model."""
    from benchmarks import run

    jobs = []

    def worker(args, log, env, kill_at, on_line=None, events=None):
        job = json.loads(Path(args[1]).read_text())
        jobs.append(job)
        said = "Compiling a graph for compile range (1, 8192) takes 9.00 s" if job["plan"] == [] \
            else "Directly load AOT compilation from path /cache/model"
        pids = {e: 100 * len(jobs) + i for i, e in enumerate(job["engines"])}
        log.write_text("".join(f"(EngineCore pid={pid}) INFO {said}\n" for pid in pids.values()))
        for e, pid in pids.items():
            on_line({"engine": e, "type": "engine", "init_s": 12.0})
            on_line({"engine": e, "type": "pids", "pids": [pid, pid + 50]})
        return 0

    monkeypatch.setattr(run, "run_subprocess", worker)
    (tmp_path / "work").mkdir()
    monkeypatch.setattr(run.tempfile, "mkdtemp", lambda prefix=None: str(tmp_path / "work"))
    suite = run.Suite(run.parse_args(["--suite", "quick", "--warm-cache", "--scenarios",
                                      "vanilla,idle", "--out", str(tmp_path)]))
    bar = type("Bar", (), {"set_postfix_str": lambda *a: None, "update": lambda *a: None})()
    group = ["capture-graph", "vanilla-graph"]
    suite.warm_cache(group, tmp_path, bar)
    assert (jobs[0]["engines"], jobs[0]["plan"], jobs[0]["pin_cpus"]) == (group, [], False)
    assert suite.warmers == {e: {"init_s": 12.0, "compiled_model": "compiled", "error": None}
                             for e in group}
    assert suite.engines == {}
    suite.run_group(group, tmp_path, [(S.decode(8), [])], suite.end, bar)
    assert jobs[1]["pin_cpus"]
    assert {e: i["compiled_model"] for e, i in suite.engines.items()} == dict.fromkeys(group, "loaded")
    assert "pids" not in suite.engines["vanilla-graph"]
    assert suite.report()["warm_cache"] == suite.warmers


def test_compile_warmers_one_engine_per_set_of_engine_arguments():
    named = S.select(S.make_suite("quick"), scenarios="vanilla,vanilla-b,idle,hidden-last")
    shape = S.MODELS["1b"]
    [group] = S.engine_groups(named, shape)
    # The control's arguments equal the baseline's: the first of the two fills the cache for both.
    assert S.compile_warmers(named, shape, group) == ["vanilla-graph-b", "capture-graph"]
    reversed_ = replace(named, baseline_first=True)
    assert S.compile_warmers(reversed_, shape, S.engine_groups(reversed_, shape)[0]) == [
        "vanilla-graph", "capture-graph"]
    full = S.make_suite("full", "1b")
    groups = S.engine_groups(full, shape)
    assert ["capture-eager"] in groups
    assert S.compile_warmers(full, shape, ["capture-eager"]) == []  # eager: nothing to compile
    assert S.compile_warmers(full, shape, ["vanilla-graph", "capture-graph"]) == [
        "vanilla-graph", "capture-graph"]


def test_select_engines_and_workloads():
    suite = S.select(S.make_suite("full", "8b"), engines="vanilla-graph,capture-graph",
                     workloads="decode-c64")
    assert suite.engines_for(S.MODELS["8b"]) == ["vanilla-graph", "capture-graph"]
    assert [w.name for w in suite.workloads] == ["decode-c64"]
    with pytest.raises(ValueError, match="--engines"):
        S.select(suite, engines="nope")
    with pytest.raises(ValueError, match="--workloads"):
        S.select(suite, workloads="decode-c3")
    # Trimmed from the full suite for time, run when named.
    full = S.make_suite("full", "8b")
    assert "prefill-c256" not in [w.name for w in full.workloads]
    named = S.select(full, workloads="prefill-c256,decode-c1")
    assert [(w.name, w.prompt_len) for w in named.workloads] == [("decode-c1", 32),
                                                                   ("prefill-c256", 2048)]
    assert named.max_num_seqs == 256
    two = S.select(full, scenarios="vanilla,hidden-last")
    assert two.scenarios == ("vanilla", "hidden-last")
    assert two.engines_for(S.MODELS["8b"]) == ["vanilla-graph", "capture-graph"]
    with pytest.raises(ValueError, match="--scenarios"):
        S.select(full, scenarios="hidden-everything")


def test_make_suite_rejects_unknown():
    with pytest.raises(ValueError):
        S.make_suite("huge")


# ---- time budget -----------------------------------------------------------------------------

def test_engine_deadline_keeps_startups_and_shares_the_rest():
    # 300 s left; two engines start in 50 s each; 200 s shared 1:3
    d = S.engine_deadline(0.0, 300.0, [50.0, 50.0], [1.0, 3.0])
    assert d == pytest.approx(50.0 + 200.0 * 0.25)
    # no spare time: the deadline is the start-up alone
    assert S.engine_deadline(0.0, 60.0, [50.0, 50.0], [1.0, 1.0]) == pytest.approx(50.0)


def test_engine_weight_counts_generates():
    suite, shape = S.make_suite("full", "1b"), S.MODELS["1b"]
    r, workloads = suite.reps, len(suite.workloads)
    assert S.engine_weight(suite, shape, "vanilla-graph") == workloads * (1 + r * 1)
    assert S.engine_weight(suite, shape, "capture-graph") == workloads * (1 + r * 5)
    assert S.engine_weight(suite, shape, "capture-eager") == 3.0 * 2 * (1 + r * 4)


def test_workload_fits():
    assert S.workload_fits(0.0, 100.0, 10.0, 10)
    assert not S.workload_fits(0.0, 100.0, 10.0, 11)


def test_layer_groups():
    assert S.layer_groups(list(range(8)), 100, 1000) == [None]
    assert S.layer_groups(list(range(8)), 300, 1000) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert S.layer_groups(list(range(3)), 5000, 1000) == [[0], [1], [2]]


# ---- ratios and checks -----------------------------------------------------------------------

def _m(scenario, tok_s, reps=(0, 1), fetch_s=0.0, engine=None, workload="decode-c64", **kw):
    out = []
    for rep in reps:
        gen_tokens = 1000
        out.append({"engine": engine or S.SCENARIOS[scenario].engine, "workload": workload,
                    "scenario": scenario, "rep": rep, "gen_s": gen_tokens / tok_s, "fetch_s": fetch_s,
                    "generated_tokens": gen_tokens, "prompt_tokens": 100, **kw})
    return out


def test_aggregate_medians():
    reps = [{"gen_s": s, "fetch_s": 0.5, "generated_tokens": 100, "rows": 10, "bytes": 1e9,
             "rows_expected": 10, "dropped": 0} for s in (1.0, 2.0, 4.0)]
    a = R.aggregate(reps)
    assert a["reps"] == 3 and a["tok_s"] == 50.0 and a["gen_s"] == 2.0 and a["tok_s_best"] == 100.0
    assert a["tok_s_e2e"] == pytest.approx(100 / 2.5)
    assert a["gbps"] == pytest.approx(1 / 2.5) and a["bytes_per_token"] == 1e7
    assert a["complete"] is True
    reps[1]["rows"] = 9
    assert R.aggregate(reps)["complete"] is False
    reps[1]["rows"], reps[2]["dropped"] = 10, 3
    assert R.aggregate(reps)["complete"] is False and R.aggregate(reps)["dropped"] == 3
    assert a["host_ms_per_step"] is None  # a vanilla engine has no capture timers


def test_aggregate_host_time_per_step():
    reps = [{"gen_s": 1.0, "generated_tokens": 100, "host_steps": steps,
             "host_begin_step_ms": 30.0, "host_end_step_ms": 10.0, "host_finish_requests_ms": 0.0,
             "host_harvest_ms": 50.0, "host_harvest_sync_ms": 20.0,
             "host_begin_repeat_ms": 12.0, "host_repeat_steps": steps - 20}
            for steps in (100, 50, 200)]
    a = R.aggregate(reps)
    assert a["host_ms_per_step"] == pytest.approx(0.4)  # median of 0.4, 0.8, 0.2
    assert a["repeat_ms_per_step"] == pytest.approx(0.15)  # median of 12/80, 12/30, 12/180
    assert a["harvest_ms_per_step"] == pytest.approx(0.5)
    assert a["harvest_sync_ms_per_step"] == pytest.approx(0.2)
    assert a["fetch_write_ms"] is None  # no fetch timers: a column of "-"


def test_aggregate_fetch_stages_are_medians_of_the_reps():
    reps = [{"gen_s": 1.0, "generated_tokens": 100, "fetch_s": 0.1, "host_fetch_finalize_ms": 1.0,
             "host_fetch_drain_ms": 0.5, "host_fetch_wait_ms": w, "host_fetch_serialize_ms": 3.0,
             "host_fetch_write_ms": 4.0 * w}
            for w in (2.0, 8.0, 5.0)]
    a = R.aggregate(reps)
    assert (a["fetch_finalize_ms"], a["fetch_drain_ms"], a["fetch_wait_ms"], a["fetch_serialize_ms"],
            a["fetch_write_ms"]) == (1.0, 0.5, 5.0, 3.0, 20.0)
    # Each rep's own figures, in run order, next to the medians.
    assert a["fetch_s_reps"] == [0.1, 0.1, 0.1]
    assert [stages[2] for stages in a["fetch_stages_ms_reps"]] == [2.0, 8.0, 5.0]
    assert a["fetch_stages_ms_reps"][1] == [1.0, 0.5, 8.0, 3.0, 32.0]


def test_summarize_ratios_to_vanilla_of_the_same_workload():
    ms = (_m("vanilla", 1000.0) + _m("idle", 995.0) + _m("hidden-4l", 950.0, fetch_s=0.1)
          + _m("vanilla", 500.0, workload="prefill-c64") + _m("idle", 250.0, workload="prefill-c64"))
    t = R.summarize(ms)
    assert t["decode-c64"]["idle"]["ratio"] == pytest.approx(0.995)
    four = t["decode-c64"]["hidden-4l"]
    assert four["ratio"] == pytest.approx(0.95)
    assert four["ratio_e2e"] == pytest.approx((1000 / (1000 / 950 + 0.1)) / 1000)
    assert t["prefill-c64"]["idle"]["ratio"] == pytest.approx(0.5)
    assert t["decode-c64"]["vanilla"]["engine"] == "vanilla-graph"
    # against idle on the same capture engine; other engines get none
    assert four["ratio_idle"] == pytest.approx(950 / 995)
    assert four["ratio_best"] == pytest.approx(950 / 1000)
    assert four["ratio_idle_e2e"] == pytest.approx((1000 / (1000 / 950 + 0.1)) / 995)
    assert t["decode-c64"]["vanilla"]["ratio_idle"] is None


def test_paired_ratio_pairs_reps_and_gives_a_t_interval():
    import numpy as np

    base_tok_s = [1000.0, 800.0, 1200.0, 900.0, 1100.0, 1000.0, 700.0, 1300.0, 950.0, 1050.0]
    rng = np.random.default_rng(0)
    own = np.exp(rng.normal(np.log(0.96), 0.03, size=10))  # each rep's ratio to its pair
    ms = [m for r, (b, k) in enumerate(zip(base_tok_s, own))
          for m in _m("vanilla", b, reps=(r,)) + _m("hidden-last", b * k, reps=(r,))]
    paired = R.summarize(ms)["decode-c64"]["hidden-last"]["ratio_paired_e2e"]
    logs = np.log(own)
    half = 2.262 * logs.std(ddof=1) / np.sqrt(10)  # Student's t, 9 degrees of freedom, 97.5%
    assert paired["pairs"] == 10
    assert paired["value"] == pytest.approx(np.exp(logs.mean()))
    assert paired["ci95"] == pytest.approx([np.exp(logs.mean() - half), np.exp(logs.mean() + half)])
    # Pairs by rep number, end to end (the fetch counts), and a lone pair has no interval.
    alone = R.paired_ratio(_m("vanilla", 1000.0, reps=(0, 1)),
                           _m("hidden-last", 1000.0, reps=(1, 5), fetch_s=1.0))
    assert alone == {"value": pytest.approx(0.5), "ci95": None, "pairs": 1}
    assert R.paired_ratio(_m("vanilla", 1000.0, reps=(0,)), _m("idle", 900.0, reps=(3,))) is None


def test_a_rep_of_several_generates_pairs_as_its_tokens_over_its_seconds():
    """``run.py --block 2``: each rep holds two generates of a scenario. A rep's pair is the
    block's tokens over the block's seconds (the fetches too), not one generate, nor the mean of
    the two generates' tok/s."""
    # Rep 0: vanilla 1 s + 3 s for 2,000 tokens (500 tok/s); capture 1 s + 1 s, a 2 s fetch
    # after the second (500 tok/s e2e). Rep 1: vanilla 2 s + 2 s; capture 2 s + 6 s (250 tok/s).
    def gen(scenario, rep, gen_s, fetch_s=0.0):
        return {"scenario": scenario, "rep": rep, "gen_s": gen_s, "fetch_s": fetch_s,
                "generated_tokens": 1000}

    base = [gen("vanilla", 0, 1.0), gen("vanilla", 0, 3.0), gen("vanilla", 1, 2.0),
            gen("vanilla", 1, 2.0)]
    own = [gen("hidden-last", 0, 1.0), gen("hidden-last", 0, 1.0, fetch_s=2.0),
           gen("hidden-last", 1, 2.0), gen("hidden-last", 1, 6.0)]
    paired = R.paired_ratio(base, own)
    assert paired["pairs"] == 2
    assert paired["value"] == pytest.approx((1.0 * 0.5) ** 0.5)


def test_a_block_runs_a_scenario_several_times_in_a_row(tmp_path):
    """Each measurement also names the scenario whose generate ran just before it."""
    run = _engine_run(tmp_path, ["vanilla", "idle"], reps=2)
    run.job["block"] = 2
    run.measure = lambda s, w, rep: {"type": "measure", "scenario": s.name, "rep": rep}
    run.run()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["rep"], e["scenario"], e["after"]) for e in events if e["type"] == "measure"] == [
        (0, "vanilla", None), (0, "vanilla", "vanilla"), (0, "idle", "vanilla"), (0, "idle", "idle"),
        (1, "idle", "idle"), (1, "idle", "idle"), (1, "vanilla", "idle"),
        (1, "vanilla", "vanilla")]


def test_report_gives_each_scenario_its_speed_by_the_scenario_before_it():
    ms = [*_m("vanilla", 1000.0, reps=(0,), after="vanilla"),
          *_m("vanilla", 800.0, reps=(1,), after="hidden-4l"),
          *_m("vanilla", 900.0, reps=(2,), after="hidden-4l"),
          *_m("hidden-4l", 700.0, reps=(0, 1), after="vanilla")]
    t = R.summarize(ms)
    assert t["decode-c64"]["vanilla"]["tok_s_by_after"] == {"vanilla": pytest.approx(1000.0),
                                                            "hidden-4l": pytest.approx(850.0)}
    md = R.markdown(_report(ms))
    assert "| scenario | after vanilla | after hidden-4l |" in md
    assert "| vanilla | 1000 | 850 |" in md and "| hidden-4l | 700 | - |" in md
    assert R.summarize(_m("vanilla", 1000.0))["decode-c64"]["vanilla"]["tok_s_by_after"] == {}


def test_thread_times_follow_each_thread_of_a_process():
    """A thread that spins shows its CPU time (under its OS name: a Python thread inherits its
    creator's); the process's first thread is ``<name> (main)``; a thread started between the
    snapshots counts from zero."""
    import threading

    from benchmarks.run import thread_time_spent, thread_times

    before = thread_times([os.getpid()])
    mains = [name for name, _, _ in before.values() if name.endswith(" (main)")]
    assert mains == [f"{Path(f'/proc/{os.getpid()}/comm').read_text().strip()} (main)"]

    spun, release = threading.Event(), threading.Event()

    def spin():
        end = time.thread_time() + 0.1
        while time.thread_time() < end:
            pass
        spun.set()
        release.wait()

    worker = threading.Thread(target=spin)
    worker.start()
    assert spun.wait(30)
    mid = thread_times([os.getpid()])  # the spinner is alive: its tid is seen
    release.set()
    worker.join()
    assert worker.native_id in mid and worker.native_id not in before
    spent = thread_time_spent(before, mid)
    others = sum(cpu for name, (cpu, _) in spent.items() if name not in mains)
    assert others >= 95.0  # ms: by its own clock it spun 100 ms of CPU before the snapshot
    assert thread_time_spent({1: ("a", 5_000_000, 1_000_000)},
                             {1: ("a", 7_000_000, 4_000_000), 2: ("b", 1_000_000, 0)}) == {
        "a": [2.0, 3.0], "b": [1.0, 0.0]}


def test_report_gives_each_capture_scenarios_replays_from_copies_and_idle_nodes_run():
    ms = [*_m("vanilla", 1000.0),
          *_m("idle", 990.0, reps=(0,), graph_replays=256, eager_forwards=1, copy_replays=256,
              idle_nodes_replayed=0),
          *_m("idle", 990.0, reps=(1,), graph_replays=256, eager_forwards=1, copy_replays=250,
              idle_nodes_replayed=192),
          *_m("idle", 990.0, reps=(2,), graph_replays=256, eager_forwards=1, copy_replays=252,
              idle_nodes_replayed=128),
          # A capture engine whose status has no graph copies (no driver): replays only.
          *_m("hidden-last", 970.0, graph_replays=256, eager_forwards=1)]
    t = R.summarize(ms)["decode-c64"]
    assert (t["idle"]["copy_replays"], t["idle"]["idle_nodes_replayed"]) == (252, 128)
    assert t["vanilla"]["copy_replays"] is None
    md = R.markdown(_report(ms))
    assert "| scenario | graph replays | launches from a copy | idle nodes run | eager forwards |" in md
    assert "| idle | 256 | 252 | 128 | 1 |" in md
    assert "| hidden-last | 256 | - | - | 1 |" in md
    assert "| vanilla | " not in md.split("graph replays | launches from a copy")[1]
    # Without replay counts (vanilla only), no table.
    assert "from a copy" not in R.markdown(_report(_m("vanilla", 1000.0)))


def test_report_splits_each_generate_into_engine_iterations_and_the_rest():
    """Rep by rep against vanilla and idle: hidden-last's iterations as long as idle's and 20 ms
    more outside them (rep 1: 30, rep 0: 10); vanilla's own split is against idle only; a
    scenario without the split (an engine core spawned, not forked) reads none."""
    ms = [*_m("vanilla", 1000.0, engine_iterations_s=0.9),
          *_m("idle", 1000.0, engine_iterations_s=0.9),
          {**_m("hidden-last", 1000.0 / 1.01, reps=(0,), engine_iterations_s=0.9)[0]},
          {**_m("hidden-last", 1000.0 / 1.03, reps=(1,), engine_iterations_s=0.9)[0]},
          *_m("hidden-4l", 900.0)]
    t = R.summarize(ms)["decode-c64"]
    last = t["hidden-last"]
    assert last["iterations_s"] == pytest.approx(0.9)
    assert last["outside_iterations_ms"] == pytest.approx(120.0)
    for against in ("vanilla", "idle"):
        split = last["split_vs"][against]
        assert split["iterations"]["value"] == pytest.approx(1.0)
        assert split["outside_ms"]["ms"] == pytest.approx(20.0)
        assert split["outside_ms"]["reps"] == 2 and split["outside_ms"]["ci95"][0] < 20.0
    assert list(t["vanilla"]["split_vs"]) == ["idle"] and t["hidden-4l"]["split_vs"] == {}
    assert t["hidden-4l"]["iterations_s"] is None
    md = R.markdown(_report(ms))
    assert "| scenario | iterations s | outside ms | iterations vs vanilla | outside vs vanilla ms " \
        "| iterations vs idle | outside vs idle ms |" in md
    row = next(line for line in md.splitlines() if line.startswith("| hidden-last | 0.9000 |"))
    assert "| 120.0 | 1.000 (1.000-1.000) | +20.0 (" in row
    assert "| hidden-4l | - | - | - | - | - | - |" in md
    # No generate with the split: no table.
    assert "iterations s" not in R.markdown(_report(_m("vanilla", 1000.0)))


def _iterations(head, early, steady, tail, steady_count=20):
    """A generate's iteration ms: one first, four early, ``steady`` ms spread over
    ``steady_count`` iterations (the middle one 1 ms longer than the rest), four last."""
    each = (steady - 1.0) / steady_count
    middle = [each] * steady_count
    middle[steady_count // 2] += 1.0
    return [head, *[early / 4] * 4, *middle, *[tail / 4] * 4]


def test_report_places_the_iterations_time_in_the_generate():
    """A generate's iterations summed by place (first, 1-4, steady, last 4) and the steady
    ones' median, checked against the parts picked out by hand; hidden-last against idle rep
    by rep: 2 ms more in its first iteration, 8 and 12 more in its steady ones (rep 0, 1), the
    rest level; a generate of too few iterations, or none, has no parts."""
    def rec(scenario, rep, head, steady):
        return {**_m(scenario, 1000.0 * 600 / steady, reps=(rep,))[0],
                "engine_iteration_ms": _iterations(head, 8, steady, 9)}

    ms = [*_m("vanilla", 1000.0), rec("idle", 0, 14, 600), rec("idle", 1, 15, 620),
          rec("hidden-last", 0, 16, 608), rec("hidden-last", 1, 17, 632),
          {**_m("hidden-4l", 900.0, reps=(0,))[0], "engine_iteration_ms": [5.0] * 9}]
    trace = ms[2]["engine_iteration_ms"]
    assert R.iteration_parts(trace) == pytest.approx(
        (trace[0], sum(trace[1:5]), sum(trace[5:-4]), sum(trace[-4:]), sorted(trace[5:-4])[10]))
    assert R.iteration_parts(trace) == pytest.approx((14, 8, 600, 9, 599 / 20))
    assert R.iteration_parts([5.0] * 9) is None and R.iteration_parts(None) is None
    t = R.summarize(ms)["decode-c64"]
    own = t["hidden-last"]["iteration_parts"]
    assert (own["generates"], own["steady_count"]) == (2, 20)
    assert (own["head"], own["steady"]) == pytest.approx((16.5, 620.0))
    delta = t["hidden-last"]["parts_vs"]["idle"]
    assert delta["reps"] == 2 and "vanilla" not in t["hidden-last"]["parts_vs"]
    assert delta["head"]["ms"] == pytest.approx(2.0)
    assert delta["head"]["ci95"] == pytest.approx([2.0, 2.0])
    assert delta["early"]["ms"] == pytest.approx(0.0) and delta["tail"]["ms"] == pytest.approx(0.0)
    assert delta["steady"]["ms"] == pytest.approx(10.0)
    assert delta["steady"]["ci95"][0] < 10.0 < delta["steady"]["ci95"][1]
    assert delta["steady_iteration"]["ms"] == pytest.approx(0.5)
    assert t["hidden-4l"]["iteration_parts"] is None and t["hidden-4l"]["parts_vs"] == {}
    assert R.parts_text(delta).startswith("head +2.0 (+2.0 to +2.0), iterations 1-4 +0.0 ")
    assert "a steady iteration +0.500 (" in R.parts_text(delta)
    md = R.markdown(_report(ms))
    assert "| hidden-last | 2 | 16.50 | 8.00 | 620.0 (20) | 9.00 | 30.950 |" in md
    row = next(line for line in md.splitlines() if line.startswith("| hidden-last | idle | 2 |"))
    assert "| +2.00 (+2.00 to +2.00) | +0.00 (" in row
    assert "steady iteration" not in R.markdown(_report(_m("vanilla", 1000.0)))


def test_report_gives_iteration_differences_a_generate_where_a_rep_runs_several():
    """``run.py --block 2``: each rep runs two generates of a scenario. hidden-last's generates
    take 2 and 4 ms more in their first iteration than idle's (rep 0) and 6 and 8 (rep 1), and 30
    and 50 ms more outside the engine's iterations (both reps): 3 and 7 ms a generate, 5 on
    average, and 40 ms outside, not the rep's sums (6, 14; 80)."""
    def rec(scenario, rep, head, outside_s=0.0):
        return {**_m(scenario, 1000.0 / (1.0 + outside_s), reps=(rep,))[0],
                "engine_iterations_s": 1.0, "engine_iteration_ms": _iterations(head, 8, 600, 9)}

    ms = [*_m("vanilla", 1000.0),
          rec("idle", 0, 14), rec("idle", 0, 14), rec("idle", 1, 14), rec("idle", 1, 14),
          rec("hidden-last", 0, 16, 0.03), rec("hidden-last", 0, 18, 0.05),
          rec("hidden-last", 1, 20, 0.03), rec("hidden-last", 1, 22, 0.05)]
    t = R.summarize(ms)["decode-c64"]
    delta = t["hidden-last"]["parts_vs"]["idle"]
    assert delta["reps"] == 2
    assert delta["head"]["ms"] == pytest.approx(5.0)
    assert delta["head"]["ci95"][0] < 5.0 < delta["head"]["ci95"][1]
    assert delta["steady"]["ms"] == pytest.approx(0.0)
    assert delta["steady_iteration"]["ms"] == pytest.approx(0.0)
    split = t["hidden-last"]["split_vs"]["idle"]
    assert split["outside_ms"]["ms"] == pytest.approx(40.0)
    assert split["iterations"]["value"] == pytest.approx(1.0)
    # The paired tok/s ratio still counts a rep's tokens over its seconds: 2,000 tokens in 2.08 s
    # against 2 s in both reps.
    assert R.paired_ratio([m for m in ms if m["scenario"] == "idle"],
                          [m for m in ms if m["scenario"] == "hidden-last"])["value"] == \
        pytest.approx(2.0 / 2.08)


def _head(ms, cpu_ms, mallocs=0, frees=0, retries=0, syncs=0, gc_ms=0.0, faults=0,
          preempted=0):
    counts = dict(zip(("num_device_alloc", "num_device_free", "num_alloc_retries",
                       "num_sync_all_streams"), (mallocs, frees, retries, syncs)))
    return {"seconds": ms / 1e3, "cpu_seconds": cpu_ms / 1e3,
            "process_cpu_seconds": 2 * cpu_ms / 1e3, "minor_faults": faults, "major_faults": 0,
            "voluntary_switches": 1, "involuntary_switches": preempted, "gc_seconds": gc_ms / 1e3,
            "allocator": counts, "allocator_at": dict.fromkeys(counts, 0)}


def test_report_keeps_each_generates_first_iteration_by_what_ran_before():
    """Idle's first iteration: 12 ms after idle, 22 ms and one cudaMalloc retry after
    hidden-last (medians of 12, 22 and 24: 22); the allocator calls from one head to the next on
    an engine go under the earlier generate's scenario, pooled over the rows that hold them."""
    def since(prev, mallocs):
        return {"scenario": prev, "num_device_alloc": mallocs, "num_device_free": 0,
                "num_alloc_retries": None, "num_sync_all_streams": 0}

    ms = [*_m("vanilla", 1000.0),
          {**_m("idle", 1000.0, reps=(0,))[0], "after": "idle", "engine_head": _head(12, 11.5),
           "engine_allocator_since": since("idle", 0),
           "engine_gc": {"seconds": 0.002, "count": 1, "full": 0}},
          {**_m("idle", 1000.0, reps=(1,))[0], "after": "hidden-last",
           "engine_head": _head(22, 21, mallocs=2, frees=1, retries=1, syncs=1, gc_ms=9.0,
                                faults=300, preempted=3),
           "engine_allocator_since": since("hidden-last", 4),
           "engine_gc": {"seconds": 0.012, "count": 3, "full": 1}},
          {**_m("hidden-last", 960.0, reps=(0,))[0], "after": "idle",
           "engine_head": _head(24, 23, retries=1), "engine_allocator_since": since("idle", 2)}]
    t = R.summarize(ms)["decode-c64"]
    head = t["idle"]["head"]
    assert (head["generates"], head["ms"], head["cpu_ms"]) == (2, 17.0, 16.25)
    assert head["process_cpu_ms"] == pytest.approx(32.5)
    assert (head["minor_faults"], head["involuntary_switches"]) == (150.0, 1.5)
    assert head["allocator"] == {"num_device_alloc": 1.0, "num_device_free": 0.5,
                                 "num_alloc_retries": 0.5, "num_sync_all_streams": 0.5}
    assert head["by_after"]["hidden-last"]["ms"] == 22.0
    assert head["by_after"]["hidden-last"]["gc_ms"] == pytest.approx(9.0)
    assert head["gc_ms"] == pytest.approx(4.5)
    assert head["generate_gc_ms"] == pytest.approx(7.0) and head["generate_gc_full"] == 0.5
    assert t["hidden-last"]["head"]["generate_gc_ms"] is None
    assert head["by_after"]["idle"]["allocator"]["num_alloc_retries"] == 0.0
    assert head["since_by_previous"]["hidden-last"] == {
        "generates": 1, "num_device_alloc": 4.0, "num_device_free": 0.0,
        "num_alloc_retries": None, "num_sync_all_streams": 0.0}
    assert t["vanilla"]["head"] is None
    text = R.head_text(head)
    assert text.startswith("17.0 ms (CPU 16.2, process 32.5, GC 4.5; faults 150, preempted 1.5), "
                           "cudaMalloc 1.0, cudaFree 0.5, retries 0.5, stream syncs 0.5 a "
                           "generate (2); GC in the generate 7.0 ms, 0.50 full")
    assert ("; after idle 12.0 ms, process CPU 23.0, GC 0.0, faults 0, retries 0.0; after "
            "hidden-last 22.0 ms, process CPU 42.0, GC 9.0, faults 300, retries 1.0") in text
    md = R.markdown(_report(ms))
    assert "| scenario | after | generates | ms | CPU ms | process CPU ms | GC ms | faults " \
        "| preempted | cudaMalloc | cudaFree | retries | stream syncs |" in md
    assert "| idle | hidden-last | 1 | 22.0 | 21.0 | 42.0 | 9.0 | 300 | 3.0 | 2.0 | 1.0 | 1.0 " \
        "| 1.0 |" in md
    assert "| hidden-last | all | 1 | 24.0 | 23.0 | 46.0 | 0.0 | 0 | 0.0 | 0.0 | 0.0 | 1.0 " \
        "| 0.0 |" in md
    assert "over the whole generate (means): idle 7.0 ms, 0.50 full." in md
    # "idle" as the earlier generate: one pair from idle's rows, one from hidden-last's.
    assert "| idle | 2 | 1.0 | 0.0 | - | 0.0 |" in md
    assert "| hidden-last | 1 | 4.0 | 0.0 | - | 0.0 |" in md
    # No generate with a head: no table.
    assert "first engine iteration" not in R.markdown(_report(_m("vanilla", 1000.0)))


def test_report_says_when_the_baseline_started_first():
    rep = _report(_m("vanilla", 1000.0))
    assert "--baseline-first" not in R.markdown(rep)
    assert "started with the baseline first** (`--baseline-first`)" in R.markdown(
        {**rep, "baseline_first": True})


def test_report_says_how_each_engine_got_its_compiled_model():
    rep = _report(_m("vanilla", 1000.0))
    rep["engines"]["vanilla-graph"]["compiled_model"] = "loaded"
    rep["engines"]["capture-graph"]["compiled_model"] = "compiled"
    md = R.markdown(rep)
    assert "| compiled model | error |" in md
    assert "| loaded from the cache |" in md.split("| vanilla-graph | 80 |")[1].splitlines()[0]
    assert "| compiled in its process |" in md.split("| capture-graph | 82 |")[1].splitlines()[0]
    assert "compile cache warmed first" not in md
    md = R.markdown({**rep, "warm_cache": {
        "vanilla-graph": {"init_s": 55.2, "compiled_model": "compiled", "error": None},
        "capture-graph": {"init_s": 44.0, "compiled_model": None, "error": "RuntimeError: x"}}})
    assert ("compile cache warmed first** (`--warm-cache`): vanilla-graph (init 55 s, compiled); "
            "capture-graph (init 44 s, -, RuntimeError: x) started and stopped") in md


def test_report_gives_capture_startup_parts_beside_each_engines_init():
    """run.py keeps capture's parts of an engine's start (``capture_startup_parts`` of its
    status, as startup.py reads them); the engines table gives them beside init s, and "-" for an
    engine without (vanilla, or a run from before they were kept)."""
    from benchmarks.startup import capture_startup_parts

    status = {"startup_ms": {"install": 118.4, "kernel_compile": 2904.2, "kernel_wait": 0.6},
              "graph_nodes": {"copy_ms": 79.3, "copies": 3}}
    parts = capture_startup_parts(status)
    assert parts == {"install": 118.4, "kernel_compile": 2904.2, "kernel_wait": 0.6,
                     "graph_copies": 79.3}
    assert status["startup_ms"] == {"install": 118.4, "kernel_compile": 2904.2, "kernel_wait": 0.6}
    assert capture_startup_parts({"startup_ms": {"install": 5.0}, "graph_nodes": None}) == \
        {"install": 5.0}  # off CUDA: no graphs to copy
    rep = _report(_m("vanilla", 1000.0))
    rep["engines"]["capture-graph"]["capture_startup_ms"] = parts
    md = R.markdown(rep)
    assert "| engine | init s | capture's parts of it, ms | KV cache tokens" in md
    assert md.split("| capture-graph | 82 |")[1].startswith(
        " install 118, kernel_compile 2904, kernel_wait 1, graph_copies 79 |")
    assert md.split("| vanilla-graph | 80 |")[1].startswith(" - |")


def test_report_gives_cpu_time_per_step_by_thread():
    def m(scenario, rep, main, harvest=None):
        engine = {"VLLM::EngineCor (main)": [main * 100, 0.5 * 100]}
        if harvest is not None:
            engine["vllm-capture-ha"] = [harvest * 100, 0.0]
        return _m(scenario, 1000.0, reps=(rep,), steps=100, engine_threads_ms=engine,
                  client_threads_ms={"python3 (main)": [1.0 * 100, 0.0]})

    ms = [*m("vanilla", 0, 2.0), *m("vanilla", 1, 2.2), *m("vanilla", 2, 2.4),
          *m("hidden-4l", 0, 2.5, 0.3), *m("hidden-4l", 1, 2.7), *m("hidden-4l", 2, 2.6, 0.1)]
    t = R.summarize(ms)["decode-c64"]
    assert t["vanilla"]["threads_ms_per_step"] == {
        "engine VLLM::EngineCor (main)": [pytest.approx(2.2), pytest.approx(0.5)],
        "client python3 (main)": [pytest.approx(1.0), pytest.approx(0.0)]}
    # The harvest thread missing from one rep counts as zero there: median of 0.3, 0, 0.1.
    assert t["hidden-4l"]["threads_ms_per_step"]["engine vllm-capture-ha"] == [
        pytest.approx(0.1), pytest.approx(0.0)]
    md = R.markdown(_report(ms))
    assert ("| scenario | engine VLLM::EngineCor (main) | client python3 (main) "
            "| engine vllm-capture-ha |") in md
    assert "| vanilla | 2.200 (0.500) | 1.000 (0.000) | 0.000 (0.000) |" in md
    assert "| hidden-4l | 2.600 (0.500) | 1.000 (0.000) | 0.100 (0.000) |" in md
    # Without thread times (older runs), no table.
    assert "CPU ms per step by thread" not in R.markdown(_report(_m("vanilla", 1000.0)))


def _reading(sm, rx, reasons=0, **kw):
    return {"sm_mhz": sm, "mem_mhz": 3200, "power_w": 500.0, "temp_c": 50, "util_gpu": 100,
            "util_mem": 60, "pcie_rx_mb_s": rx, "pcie_tx_mb_s": 1.0, "clock_reasons": reasons,
            **kw}


def test_gpu_sampler_reads_on_a_thread_until_the_block_ends():
    from benchmarks.run import GpuSampler

    script = [_reading(1980, 5.0), _reading(1755, 900.0, reasons=0x4), _reading(1980, 7.0, 0x1)]

    class FakeNvml:
        nv = object()  # NVML present
        calls = 0

        def sample(self):  # the script, then no reading (NVML failing: nothing kept)
            self.calls += 1
            return script[self.calls - 1] if self.calls <= len(script) else None

    nvml = FakeNvml()
    with GpuSampler(nvml, period_s=0.001) as gpu:
        deadline = time.time() + 5
        while nvml.calls < 5 and time.time() < deadline:
            time.sleep(0.001)
    calls = nvml.calls
    time.sleep(0.02)
    assert nvml.calls == calls  # the thread stopped with the block
    assert gpu.samples == script
    assert gpu.summary["sm_mhz"] == 1980 and gpu.summary["pcie_rx_mb_s"] == 7.0
    assert gpu.summary["clock_reasons"] == 0x5 and gpu.summary["samples"] == 3

    class NoNvml:
        nv = None

    with GpuSampler(NoNvml()) as none:
        pass
    assert none.summary is None and none._thread is None


def test_gpu_summary_takes_medians_and_ors_the_clock_reasons():
    from benchmarks.report import GPU_FIELDS, gpu_summary

    assert gpu_summary([]) is None
    out = gpu_summary([_reading(1980, 5.0), _reading(1500, 700.0, 0x8), _reading(1900, 9.0, 0x1)])
    assert out["sm_mhz"] == 1900 and out["pcie_rx_mb_s"] == 9.0 and out["power_w"] == 500.0
    assert out["clock_reasons"] == 0x9 and out["samples"] == 3
    assert set(out) == {*GPU_FIELDS, "clock_reasons", "samples"}


def test_report_gives_what_the_gpu_ran_at_by_scenario():
    from benchmarks.report import gpu_summary

    def m(scenario, rep, sm, rx, reasons=0):
        return _m(scenario, 1000.0, reps=(rep,),
                  gpu=gpu_summary([_reading(sm, rx, reasons), _reading(sm, rx, reasons)]))

    ms = [*m("vanilla", 0, 1980, 5.0), *m("vanilla", 1, 1970, 6.0),
          *m("idle", 0, 1980, 5.0), *m("idle", 1, 1700, 800.0, 0x4), *m("idle", 2, 1750, 900.0)]
    t = R.summarize(ms)["decode-c64"]
    assert t["idle"]["gpu"]["sm_mhz"] == 1750 and t["idle"]["gpu"]["pcie_rx_mb_s"] == 800.0
    assert t["idle"]["gpu"]["clock_reasons"] == 0x4
    assert t["vanilla"]["gpu"]["sm_mhz"] == 1975
    md = R.markdown(_report(ms))
    assert "| idle | 1750 | 3200 | 500 | 50 | 100 | 60 | 800 | 1 | 0x4 |" in md
    assert "| vanilla | 1975 | 3200 | 500 | 50 | 100 | 60 | 6 | 1 | 0x0 |" in md
    # Runs without NVML readings: no table.
    assert "The GPU during the generate" not in R.markdown(_report(_m("vanilla", 1000.0)))


@pytest.mark.parametrize("settle", [False, True])
def test_settle_waits_for_the_clients_reapers_outside_the_fetch_time(tmp_path, monkeypatch, settle):
    """``run.py --settle``: after the fetch, the client's and the worker's threads that let go of
    the reply's memory are waited for, timed apart (``settle_s``); without it they are left to
    run."""
    import torch

    from benchmarks.run import _settle_worker
    from vllm_capture.session import shm

    run = _engine_run(tmp_path, ["hidden-last"], reps=1)
    run.job["settle"] = settle
    waited = []
    monkeypatch.setattr(shm, "settle", lambda: waited.append(time.perf_counter()))

    class Engine:  # collective_rpc runs the function on "the worker": here, in this process
        def collective_rpc(self, method, *args):
            return [method(None, *args)]

    class Api:
        def fetch_captured(self, llm, stream, clear, layers):
            return {0: torch.zeros(4, 8, dtype=torch.bfloat16)}, {}, None

    run.api = Api()
    run.stream_layers = {S.HIDDEN: [0]}
    cap = S.SCENARIOS["hidden-last"].capture
    out = run.drain(Engine(), cap, S.decode(8))
    assert out["rows"] == 4 and out["bytes"] == 64
    assert len(waited) == 2 * settle and ("settle_s" in out) == settle  # client, then worker
    _settle_worker(None)
    assert len(waited) == 2 * settle + 1


def test_own_and_after_separates_a_captures_own_cost_from_the_next_generates():
    """Reps of vanilla, idle and hidden-last, reversed every other rep, each rep at its own
    speed: hidden-last 5% slower than idle, and the generate after it 2% slower."""
    import numpy as np

    from benchmarks.sequence import own_and_after, own_and_after_lines

    rng = np.random.default_rng(4)
    level = {"vanilla": 1.0, "idle": 1.01, "hidden-last": 1.01 * 1.05}
    ms, before = [], None
    for rep in range(40):
        drift = rng.uniform(0.8, 1.2)
        order = ["vanilla", "idle", "hidden-last"]
        for sc in order if rep % 2 == 0 else order[::-1]:
            seconds = drift * level[sc] * (1.02 if before == "hidden-last" else 1.0)
            seconds *= float(np.exp(rng.normal(0.0, 0.003)))
            ms += _m(sc, 1000.0 / seconds, reps=(rep,))
            before = sc
    fit = own_and_after(ms, "hidden-last")
    assert fit["own"]["cost"] == pytest.approx(0.05, abs=0.004)
    assert fit["after"]["cost"] == pytest.approx(0.02, abs=0.004)
    assert fit["own"]["ci95"][0] < fit["own"]["cost"] < fit["own"]["ci95"][1]
    assert fit["generates"] == len(ms) - 1
    # Two scenarios in turn: a rep's two generates follow the same kind, so "after" is the
    # rep's level; nothing to tell apart.
    pairs = [m for m in ms if m["scenario"] != "vanilla"]
    assert own_and_after(pairs, "hidden-last") is None
    assert own_and_after(ms, "hidden-4l") is None and own_and_after([], "idle") is None
    lines = own_and_after_lines({"a": ms, "b": pairs}, "hidden-last")
    assert lines[1].startswith("a: own +5.") and lines[2] == "b: -"
    assert lines[3].startswith("mean of 1 runs: own +5.")


def test_by_predecessor_groups_generates_by_the_engine_before_and_its_rows_captures():
    from benchmarks.sequence import by_predecessor, predecessor_lines

    order = [("vanilla", 1000.0), ("idle", 990.0), ("hidden-last", 900.0), ("idle", 980.0),
             ("hidden-4l", 800.0), ("idle", 970.0), ("vanilla", 1000.0), ("idle", 1010.0),
             ("idle", 960.0)]
    ms = [m for sc, tok_s in order for m in _m(sc, tok_s, reps=(0,))]
    ms.insert(0, _m("idle", 500.0, reps=(0,), workload="prefill-c64")[0])  # another workload
    groups = by_predecessor(ms, workload="decode-c64")
    # A reduction (hidden-last) is not a rows capture; hidden-4l is, from the generate after it.
    assert groups == {"other": pytest.approx([0.99]), "own": pytest.approx([0.98]),
                      "own+rows": pytest.approx([0.97, 0.96]), "other+rows": pytest.approx([1.01])}
    first = by_predecessor([*_m("idle", 990.0, reps=(0,)), *_m("vanilla", 1000.0, reps=(0,))])
    assert first == {"first": pytest.approx([0.99])} and by_predecessor([]) == {}
    assert by_predecessor(ms) == {}  # the first workload measured (prefill) has no baseline
    lines = predecessor_lines({"run": ms[1:]})
    assert lines[1] == lines[2].replace("pooled", "run")
    assert "own+rows 2x 0.965 (0.960-0.970)" in lines[1]


def test_releases_and_graph_probe_run_after_the_generates_counters(tmp_path):
    """``run.py --release-after-capture`` and ``--probe-graphs``: the releases run on a capture
    scenario's engine once its stream is stopped, the probe on every scenario's engine with the
    workload's batch, both after the counters the generate reports were read (the probe's
    replays are not the generate's)."""
    from benchmarks import engine_state as E

    run = _engine_run(tmp_path, ["vanilla", "hidden-last"], reps=1)
    run.job.update(release_after_capture=["graph-copies", "client"], probe_graphs=True)
    calls = []

    class Engine:
        def generate(self, *args, **kwargs):
            calls.append("generate")
            return []

        def collective_rpc(self, fn, kwargs=None):
            calls.append(fn.__name__)
            if fn is E.device_state:
                return [{"graph": {"gpu_us": 5484.0}, "tokens": kwargs["tokens"]}]
            return [fn(None, **(kwargs or {}))]

    class Api:
        def start_capture(self, llm, stream, **kw):
            calls.append("start")

        def fetch_captured(self, llm, stream, clear, layers):
            calls.append("fetch")
            return {}, {}, None

        def capture_status(self, llm, stream):
            calls.append("status")
            return {"graph_replays": len(calls)}

        def stop_capture(self, llm, stream):
            calls.append("stop")

    run.llms = {"capture-graph": Engine(), "vanilla-graph": Engine()}
    run.api, run.stream_layers = Api(), {S.HIDDEN: [0]}
    rec = run.measure(S.SCENARIOS["hidden-last"], S.decode(8), 0)
    assert calls == ["status", "start", "generate", "fetch", "status", "stop", "status",
                     "drop_graph_copies", "device_state"]
    assert rec["released"] == {"graph-copies": [0], "client": None}
    assert rec["graph_probe"] == {"graph": {"gpu_us": 5484.0}, "tokens": 8}
    assert rec["graph_replays"] == 6  # the counters read before the releases and the probe
    calls.clear()
    rec = run.measure(S.SCENARIOS["vanilla"], S.decode(8), 0)
    assert calls == ["generate", "device_state"] and "released" not in rec


def test_measure_reads_the_engine_iterations_begun_during_its_generate(tmp_path):
    """The engine's iterations add to the generate current when each began: two during the
    generate, and one begun during it that ends 50 ms after it returned, which ``measure``
    waits for; one begun after it is nobody's. A generate whose engine counted nothing
    (spawned, not forked) has no split."""
    import threading

    run = _engine_run(tmp_path, ["vanilla"], reps=1)
    clock = run.iterations

    def late_iteration(generate):
        time.sleep(0.05)
        clock.add(generate, 0.125)

    class Engine:
        def generate(self, *args, **kwargs):
            for seconds in (0.25, 0.5):
                clock.add(clock.begin(), seconds)
            threading.Thread(target=late_iteration, args=(clock.begin(),)).start()
            return []

    run.llms["vanilla-graph"] = Engine()
    t0 = time.perf_counter()
    rec = run.measure(S.SCENARIOS["vanilla"], S.decode(8), 0)
    assert time.perf_counter() - t0 >= 0.04
    assert (rec["engine_iterations_s"], rec["engine_iterations"]) == (0.875, 3)
    assert rec["engine_iteration_ms"] == [250.0, 500.0, 125.0]  # in the order they ended
    assert clock.current == -1
    clock.add(clock.begin(), 9.0)  # between generates: nobody's
    assert clock.read(0) == (0.875, 3)
    run.llms["vanilla-graph"] = type("Idle", (), {"generate": lambda *a, **k: []})()
    rec = run.measure(S.SCENARIOS["vanilla"], S.decode(8), 1)
    assert "engine_iterations_s" not in rec and run.generates_timed == 2
    # An iteration that never ends: the wait gives up.
    clock.start(5)
    clock.begin()
    t0 = time.perf_counter()
    clock.settle(5, timeout_s=0.05)
    assert 0.04 <= time.perf_counter() - t0 < 1.0


def test_measure_keeps_the_engines_allocator_calls_from_one_head_to_the_next(tmp_path,
                                                                            monkeypatch):
    """Each generate's head as the engine wrote it; the allocator calls from the end of an
    engine's last head to the start of this one's, under that generate's scenario (vanilla's
    generate in between, on its own engine, does not count); none without CUDA's counters."""
    from benchmarks import engine_iterations as EI

    run = _engine_run(tmp_path, ["vanilla"], reps=1)
    clock = run.iterations
    counters = iter([[10, 4, 0, 0], [12, 4, 1, 1], [99, 99, 9, 9], [99, 99, 9, 9],
                     [15, 6, 1, 1], [15, 6, 1, 1]])
    monkeypatch.setattr(EI, "allocator_counters", lambda: next(counters))

    class Engine:
        def generate(self, *args, **kwargs):
            for seconds in (0.02, 0.003, 0.003):
                generate = clock.begin()
                if clock.is_head(generate):
                    clock.open_head(generate, EI.allocator_counters())
                    clock.close_head(generate, seconds, [seconds / 2, seconds, 7, 0, 2, 1],
                                     EI.allocator_counters())
                clock.add(generate, seconds)
            return []

    run.llms = {"capture-graph": Engine(), "vanilla-graph": Engine()}
    run.api = type("Api", (), {"capture_status": lambda self, llm, stream: {}})()
    first = run.measure(S.SCENARIOS["idle"], S.decode(8), 0)
    assert first["engine_head"] == {
        "seconds": 0.02, "cpu_seconds": 0.01, "process_cpu_seconds": 0.02, "minor_faults": 7,
        "major_faults": 0, "voluntary_switches": 2, "involuntary_switches": 1, "gc_seconds": 0.0,
        "allocator": {"num_device_alloc": 2, "num_device_free": 0, "num_alloc_retries": 1,
                      "num_sync_all_streams": 1},
        "allocator_at": {"num_device_alloc": 10, "num_device_free": 4, "num_alloc_retries": 0,
                         "num_sync_all_streams": 0}}
    assert "engine_allocator_since" not in first
    assert first["engine_gc"] == {"seconds": 0.0, "count": 0, "full": 0}
    assert "engine_allocator_since" not in run.measure(S.SCENARIOS["vanilla"], S.decode(8), 0)
    second = run.measure(S.SCENARIOS["idle"], S.decode(8), 1)
    assert second["engine_allocator_since"] == {
        "scenario": "idle", "num_device_alloc": 3, "num_device_free": 2, "num_alloc_retries": 0,
        "num_sync_all_streams": 0}
    # Without CUDA the counters read None, and nothing is taken from them.
    monkeypatch.setattr(EI, "allocator_counters", lambda: [math.nan] * 4)
    third = run.measure(S.SCENARIOS["idle"], S.decode(8), 2)
    assert set(third["engine_head"]["allocator"].values()) == {None}
    assert "engine_allocator_since" not in third


@pytest.fixture
def gc_callbacks():
    """``gc.callbacks`` as it was, restored in place (the collector holds that list)."""
    import gc

    saved = list(gc.callbacks)
    yield
    gc.callbacks[:] = saved


def test_iteration_clock_counts_across_a_fork_and_patches_the_engine_step_once(monkeypatch,
                                                                              gc_callbacks):
    """The forked engine adds, the client reads; ``install`` patches vLLM's engine step once,
    and the patched step adds to the clock of the latest install."""
    from vllm.v1.engine.core import EngineCoreProc

    from benchmarks import engine_iterations as EI

    clock = EI.IterationClock(capacity=4)
    clock.start(3)
    pid = os.fork()
    if pid == 0:
        try:
            clock.add(clock.begin(), 0.5)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert clock.read(3) == (0.5, 1) and clock.read(2) is None
    with pytest.raises(ValueError, match="generate: 4 is outside"):
        clock.start(4)
    clock.start(3)  # a generate's sums start from zero
    assert clock.read(3) is None

    steps = []
    monkeypatch.setattr(EngineCoreProc, "_process_engine_step", lambda core: steps.append(core) or 7)
    monkeypatch.setattr(EI, "_clock", None)
    real_counters, counters = EI.allocator_counters, iter([[1, 0, 0, 0], [3, 1, 0, 0]])
    monkeypatch.setattr(EI, "allocator_counters", lambda: next(counters))
    EI.install(clock)
    patched = EngineCoreProc._process_engine_step
    assert patched(object()) == 7 and clock.read(3)[1] == 1
    assert clock.iterations(3) == [pytest.approx(clock.read(3)[0], rel=1e-6)]  # float32 kept
    head = clock.head(3)
    assert head["seconds"] == clock.read(3)[0] and 0 <= head["cpu_seconds"] < 1
    assert head["cpu_seconds"] <= head["process_cpu_seconds"] + 1e-3
    assert min(head[k] for k in ("minor_faults", "major_faults", "voluntary_switches",
                                 "involuntary_switches")) >= 0
    assert head["allocator"]["num_device_alloc"] == 2 and head["allocator_at"]["num_device_alloc"] == 1
    patched(object())  # not the first iteration: no counters read (next() would raise)
    assert clock.read(3)[1] == 2 and clock.head(3)["seconds"] == head["seconds"]
    other = EI.IterationClock(capacity=2)
    other.start(1)
    EI.install(other)
    assert EngineCoreProc._process_engine_step is patched
    monkeypatch.setattr(EI, "allocator_counters", real_counters)
    patched(object())
    assert other.read(1)[1] == 1 and clock.read(3)[1] == 2 and len(steps) == 3
    # On the CPU torch keeps no CUDA allocator counters: the head reads None for each.
    assert set(other.head(1)["allocator"].values()) == {None}


def test_iteration_clock_keeps_each_iteration_up_to_its_trace_limits(monkeypatch):
    """Each iteration's seconds in the order they ended, from the generate's start; past
    ``TRACE_ITERATIONS`` only the sums count, and generates past ``trace_generates`` keep none."""
    from benchmarks import engine_iterations as EI

    monkeypatch.setattr(EI, "TRACE_ITERATIONS", 3)
    clock = EI.IterationClock(capacity=4, trace_generates=2)
    for generate in (1, 2):
        clock.start(generate)
        for seconds in (0.5, 0.25, 0.125, 2.0):
            clock.add(clock.begin(), seconds)
    assert clock.iterations(1) == [0.5, 0.25, 0.125] and clock.read(1) == (2.875, 4)
    assert clock.iterations(2) is None and clock.read(2) == (2.875, 4)
    assert clock.iterations(0) is None  # nothing counted
    clock.start(1)
    clock.add(clock.begin(), 1.0)
    assert clock.iterations(1) == [1.0]


def test_head_usage_counts_the_calling_threads_faults_and_the_processs_cpu():
    """Pages touched on this thread count as its faults; pages touched on another thread do
    not, though its CPU time counts for the process."""
    import threading

    from benchmarks import engine_iterations as EI

    def touch(megabytes: int) -> None:
        block = bytearray(megabytes << 20)
        for i in range(0, len(block), 4096):
            block[i] = 1

    def delta(fn) -> dict:
        before = EI.head_usage()
        fn()
        return dict(zip(EI.HEAD_USAGE, (b - a for a, b in zip(before, EI.head_usage()))))

    mine = delta(lambda: touch(64))
    assert mine["minor_faults"] > 0 and mine["cpu_seconds"] > 0

    def elsewhere():
        worker = threading.Thread(target=touch, args=(64,))
        worker.start()
        worker.join()

    other = delta(elsewhere)
    assert other["minor_faults"] < mine["minor_faults"] / 4
    assert other["process_cpu_seconds"] > other["cpu_seconds"]


def test_engine_garbage_collections_count_for_the_generate_of_their_engine(monkeypatch,
                                                                          gc_callbacks):
    """A collection in an engine core counts for the generate current while that engine runs
    it, in its head apart; one in an engine whose last iteration was another generate's, one
    between generates, and the client's own count for nothing."""
    import gc

    from vllm.v1.engine.core import EngineCoreProc

    from benchmarks import engine_iterations as EI

    monkeypatch.setattr(EngineCoreProc, "_process_engine_step", lambda core: gc.collect())
    monkeypatch.setattr(EI, "_clock", None)
    monkeypatch.setattr(EI, "allocator_counters", lambda: [0, 0, 0, 0])
    clock = EI.IterationClock(capacity=4)
    EI.install(clock)
    patched = EngineCoreProc._process_engine_step
    clock.start(1)
    patched(object())  # the head: one full collection, inside it
    assert clock.collections(1) == {"seconds": 0.0, "count": 0, "full": 0}  # the client's own
    monkeypatch.setattr(EI, "_installer_pid", -1)  # this process now stands for an engine core
    clock.start(1)
    patched(object())
    patched(object())
    gc.collect(0)  # between this engine's iterations, its generate still current
    collected = clock.collections(1)
    assert (collected["count"], collected["full"]) == (3, 2) and collected["seconds"] > 0
    head = clock.head(1)["gc_seconds"]
    assert 0 < head < collected["seconds"]
    clock.start(2)  # another engine's generate: this engine's last iteration was generate 1's
    gc.collect()
    clock.stop()
    gc.collect()
    assert clock.collections(2)["count"] == 0 and clock.collections(1)["count"] == 3


def test_release_after_capture_names_a_known_release():
    from benchmarks.run import parse_args

    assert parse_args(["--release-after-capture", "graph-copies,wait"]).release_after_capture \
        == ["graph-copies", "wait"]
    assert parse_args([]).release_after_capture == []
    with pytest.raises(SystemExit):
        parse_args(["--release-after-capture", "graph-copies,replays"])


def test_block_must_be_a_number_of_generates():
    from benchmarks.run import parse_args

    assert parse_args(["--block", "3"]).block == 3
    assert parse_args([]).block == 1
    with pytest.raises(SystemExit):
        parse_args(["--block", "0"])


def test_pool_pairs_reps_within_their_run_and_gives_runs_an_interval_of_their_own():
    import numpy as np

    from benchmarks.pool import markdown, pool

    # Run 1: hidden-last at 0.9 of vanilla in every rep; run 2 at 1.0 (its vanilla 2x faster).
    run1 = {"measurements": _m("vanilla", 1000.0, reps=(0, 1)) + _m("hidden-last", 900.0, reps=(0, 1))
            + _m("idle", 950.0, reps=(0, 1))}
    run2 = {"measurements": _m("vanilla", 2000.0, reps=(0, 1)) + _m("hidden-last", 2000.0, reps=(0, 1))}
    p = pool([run1, run2], "decode-c64", "hidden-last", "vanilla")
    assert p["runs"] == [pytest.approx(0.9), pytest.approx(1.0)]  # rep 0 of run 2 pairs in run 2
    assert p["over_reps"]["pairs"] == 4
    assert p["over_reps"]["value"] == pytest.approx(np.sqrt(0.9))
    assert p["over_runs"]["pairs"] == 2
    half = 12.706 * np.std(np.log([0.9, 1.0]), ddof=1) / np.sqrt(2)  # t, 1 degree of freedom
    assert p["over_runs"]["ci95"] == pytest.approx([np.sqrt(0.9) * np.exp(-half),
                                                     np.sqrt(0.9) * np.exp(half)])
    # Against idle only where the run has it, and only for the idle engine's scenarios.
    assert pool([run1, run2], "decode-c64", "hidden-last", "idle")["runs"] == [
        pytest.approx(900 / 950), None]
    assert pool([run2], "decode-c64", "idle", "vanilla") is None
    md = markdown([run1, run2], ["a", "b"])
    assert "| decode-c64 | hidden-last | idle | 0.947 | - |" in md
    assert "| vanilla | idle |" not in md and "| decode-c64 | vanilla | vanilla |" not in md
    assert "| host |" not in md  # neither run records its CPUs
    run2["env"] = {"cpu": {"model": "Intel Xeon Processor", "family": "6", "model_number": "143",
                           "stepping": "8", "mhz": {"mean": 2100}}}
    host = markdown([run1, run2], ["a", "b"]).splitlines()[2]
    assert host == ("| host | cpu, gpu | - | - | Intel Xeon Processor 6/143/8, 2100 MHz "
                    "| - | - | - | - |")
    run1["env"] = {"gpu": "NVIDIA H200"}
    host = markdown([run1, run2], ["a", "b"]).splitlines()[2]
    assert host.startswith("| host | cpu, gpu | - | NVIDIA H200 | Intel Xeon Processor")


def test_pool_refuses_runs_on_different_gpus(tmp_path, capsys, monkeypatch):
    from benchmarks.pool import main

    folders = []
    for name, gpu in (("a", "NVIDIA H200"), ("b", "NVIDIA H100 80GB HBM3"), ("c", None)):
        folder = tmp_path / name
        folder.mkdir()
        env = {} if gpu is None else {"gpu": gpu}
        (folder / "results.json").write_text(json.dumps(
            {"suite": "quick", "model": "1b", "env": env,
             "measurements": _m("vanilla", 1000.0, reps=(0, 1)) + _m("idle", 990.0, reps=(0, 1))}))
        folders.append(str(folder))
    monkeypatch.setattr(sys, "argv", ["pool.py", folders[0], folders[1]])
    with pytest.raises(SystemExit) as exc:
        main()
    assert exc.value.code == 2 and "different GPUs" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["pool.py", folders[0], folders[2]])
    assert main() == 0  # a run that names no GPU pools with either


def test_t_quantiles_past_the_table():
    """Student's t for a two-sided 95% interval (published values to 6 places), and the
    interval of 32 values uses t with 31 degrees of freedom, not the normal 1.96."""
    import numpy as np

    from benchmarks.report import mean_interval, t95

    for df, t in ((1, 12.706), (30, 2.042), (31, 2.039513), (40, 2.021075), (60, 2.000298),
                  (79, 1.990450), (120, 1.979930), (1000, 1.962339)):
        assert t95(df) == pytest.approx(t, abs=2e-6)
    values = [float(v % 7) for v in range(32)]
    mean, half = mean_interval(values)
    sd = float(np.std(values, ddof=1))
    assert half == pytest.approx(2.039513 * sd / math.sqrt(32), rel=1e-6)


def test_pool_gives_the_iteration_split_over_the_reps_of_runs_that_have_it():
    """Rep 0 of each run pairs within its run: hidden-last 20 ms more outside the engine's
    iterations than idle in run 1, 40 ms in run 2; a run without the split adds nothing."""
    from benchmarks.pool import markdown, pool

    def run(outside_s, split=True):
        own = _m("hidden-last", 1000.0 / (1.0 + outside_s), reps=(0,))
        idle = _m("idle", 1000.0, reps=(0,))
        if split:
            own[0]["engine_iterations_s"] = idle[0]["engine_iterations_s"] = 0.9
        return {"measurements": idle + own + _m("vanilla", 1000.0, reps=(0,))}

    p = pool([run(0.02), run(0.04), run(0.5, split=False)], "decode-c64", "hidden-last", "idle")
    assert p["split"]["outside_ms"]["ms"] == pytest.approx(30.0)
    assert p["split"]["outside_ms"]["reps"] == 2
    assert p["split"]["iterations"]["value"] == pytest.approx(1.0)
    assert pool([run(0.02)], "decode-c64", "hidden-last", "vanilla")["split"] is None
    md = markdown([run(0.02), run(0.04)], ["a", "b"])
    assert "| workload | scenario | against | engine iterations | outside them, ms | reps |" in md
    assert "| decode-c64 | hidden-last | idle | 1.000 (1.000-1.000) | +30.0 (" in md
    assert "engine iterations" not in markdown([run(0.02, split=False)], ["a"])


def test_pool_places_the_iterations_time_over_the_reps_of_runs_that_kept_it():
    """Rep 0 of each run pairs within its run: hidden-last's steady iterations 10 ms longer
    than idle's in run 1, 20 ms in run 2, its first iteration 2 ms longer in both; a run
    without the iterations adds nothing."""
    from benchmarks.pool import markdown, pool

    def run(extra_steady, kept=True):
        own = _m("hidden-last", 990.0, reps=(0,))
        idle = _m("idle", 1000.0, reps=(0,))
        if kept:
            own[0]["engine_iteration_ms"] = _iterations(16, 8, 600 + extra_steady, 9)
            idle[0]["engine_iteration_ms"] = _iterations(14, 8, 600, 9)
        return {"measurements": idle + own + _m("vanilla", 1000.0, reps=(0,))}

    p = pool([run(10), run(20), run(90, kept=False)], "decode-c64", "hidden-last", "idle")
    assert p["parts"]["reps"] == 2
    assert p["parts"]["steady"]["ms"] == pytest.approx(15.0)
    assert p["parts"]["head"]["ms"] == pytest.approx(2.0)
    assert pool([run(10)], "decode-c64", "hidden-last", "vanilla")["parts"] is None
    md = markdown([run(10), run(20)], ["a", "b"])
    assert "| decode-c64 | hidden-last | idle | head +2.0 (+2.0 to +2.0), " in md
    assert "steady +15.0 (" in md
    assert "by place" not in markdown([run(10, kept=False)], ["a"])


def test_pool_splits_reps_run_forward_from_reps_run_reversed():
    """Even reps ran the scenarios in the order given, odd reps reversed: each order's reps pool
    apart (here hidden-last reads 0.9 forward and 1.1 reversed, in both runs)."""
    from benchmarks.pool import markdown, pool

    def run(scale):
        return {"measurements": _m("vanilla", 1000.0 * scale, reps=(0, 1, 2, 3))
                + _m("hidden-last", 900.0 * scale, reps=(0, 2))
                + _m("hidden-last", 1100.0 * scale, reps=(1, 3))}

    p = pool([run(1.0), run(2.0)], "decode-c64", "hidden-last", "vanilla")
    assert p["forward"]["value"] == pytest.approx(0.9) and p["forward"]["pairs"] == 4
    assert p["reversed"]["value"] == pytest.approx(1.1) and p["reversed"]["pairs"] == 4
    assert p["over_reps"]["value"] == pytest.approx((0.9 * 1.1) ** 0.5)
    # A run started with the baseline first gave its reps another order: not in these columns.
    other = {"measurements": _m("vanilla", 1000.0, reps=(0, 1)) + _m("hidden-last", 500.0, reps=(0, 1)),
             "baseline_first": True}
    p = pool([run(1.0), run(2.0), other], "decode-c64", "hidden-last", "vanilla")
    assert p["forward"]["value"] == pytest.approx(0.9) and p["forward"]["pairs"] == 4
    assert p["reversed"]["value"] == pytest.approx(1.1) and p["reversed"]["pairs"] == 4
    assert "| 0.900 (0.900-0.900), 4 | 1.100 (1.100-1.100), 4 |" in markdown([run(1.0), run(2.0)],
                                                                          ["a", "b"])


def test_pool_weighs_the_two_start_orders_equally_where_runs_have_both():
    """Runs started in the default order and with --baseline-first pool apart, and their
    geometric mean weighs each order alike however many reps each has."""
    import numpy as np

    from benchmarks.pool import equal_weight, markdown, pool

    def run(ratio, reps, baseline_first, jitter=(1.0, 1.02)):
        ms = []
        for r in range(reps):
            j = jitter[r % 2]
            ms += _m("vanilla", 1000.0, reps=(r,)) + _m("idle", 1000.0 * ratio * j, reps=(r,))
        return {"measurements": ms, "baseline_first": baseline_first}

    default = [run(0.98, 8, False), run(0.98, 8, False), run(0.98, 8, False)]
    first = [run(1.02, 4, True)]
    p = pool(default + first, "decode-c64", "idle", "vanilla")
    assert p["default_order"]["pairs"] == 24 and p["baseline_first"]["pairs"] == 4
    assert p["default_order"]["value"] == pytest.approx(0.98 * 1.02 ** 0.5)
    assert p["baseline_first"]["value"] == pytest.approx(1.02 * 1.02 ** 0.5)
    # Equal weight: not 24 to 4, as the pool over reps is.
    assert p["both_orders"]["value"] == pytest.approx((0.98 * 1.02) ** 0.5 * 1.02 ** 0.5)
    assert p["over_reps"]["value"] < p["both_orders"]["value"]
    halves = [np.log(p[k]["ci95"][1] / p[k]["ci95"][0]) / 2 for k in ("default_order", "baseline_first")]
    lo, hi = p["both_orders"]["ci95"]
    assert np.log(hi / lo) / 2 == pytest.approx(np.hypot(*halves) / 2)
    assert equal_weight({"value": 0.9, "ci95": None, "pairs": 1},
                        {"value": 1.0, "ci95": [0.9, 1.1], "pairs": 3}) == {
        "value": pytest.approx(0.9 ** 0.5), "ci95": None, "pairs": 4}
    md = markdown(default + first, ["a", "b", "c", "d"])
    assert "| both orders, equal weight |" in md
    assert f"| {p['both_orders']['value']:.3f} (" in md.splitlines()[2]
    # One order only: no such columns, and no figure.
    assert pool(default, "decode-c64", "idle", "vanilla")["both_orders"] is None
    assert "both orders" not in markdown(default, ["a", "b", "c"])


def _engine_run(tmp_path, scenarios: list[str], reps: int):
    """An ``EngineRun`` of the capture and vanilla graph engines whose generates do nothing."""
    from benchmarks.run import EngineRun

    job = {"engines": ["capture-graph", "vanilla-graph"], "model": "tiny", "model_dir": "-",
           "engine_kwargs": {}, "plan": [(vars(S.decode(8)), scenarios)], "reps": reps,
           "deadline": 1e12, "hard_deadline": 1e12, "dtype_bytes": 2,
           "events": str(tmp_path / "events.jsonl")}
    run = EngineRun(job)

    class FakeLLM:
        def generate(self, *args, **kwargs):
            return []

    run.llms = {"capture-graph": FakeLLM(), "vanilla-graph": FakeLLM()}
    run.params = lambda w, max_tokens=None: None
    return run


def test_reps_run_scenarios_forward_then_backward(tmp_path):
    """Every other rep runs its scenarios in reverse (A B C, C B A, ...): a scenario's place in
    the rep, and the host's drift across it, weigh on every scenario alike."""
    run = _engine_run(tmp_path, ["vanilla", "idle", "hidden-last"], reps=4)
    order = []
    run.measure = lambda s, w, rep: order.append((rep, s.name)) or {"type": "measure"}
    run.run()
    forward = ["vanilla", "idle", "hidden-last"]
    assert order == [(r, n) for r in range(4) for n in (forward if r % 2 == 0 else forward[::-1])]


def test_each_measurement_names_the_cpus_its_engine_ran_on(tmp_path):
    run = _engine_run(tmp_path, ["vanilla", "idle"], reps=4)
    run.measure = lambda s, w, rep: {"type": "measure", "scenario": s.name, "rep": rep}
    run.engine_pids = {"capture-graph": [], "vanilla-graph": []}
    run.engine_cpu_groups = [[4, 5], [6, 7]]
    run.run()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    placed = [(e["rep"], e["scenario"], e["cpus"]) for e in events if e["type"] == "measure"]
    assert placed == [(0, "vanilla", [6, 7]), (0, "idle", [4, 5]),
                      (1, "idle", [4, 5]), (1, "vanilla", [6, 7]),
                      (2, "vanilla", [4, 5]), (2, "idle", [6, 7]),
                      (3, "idle", [6, 7]), (3, "vanilla", [4, 5])]
    # Not pinned: no CPUs named.
    run.engine_cpu_groups = []
    assert run.place(0) == {}


def test_report_gives_each_scenario_its_speed_by_cpu_group():
    ms = [*_m("vanilla", 1000.0, reps=(0,), cpus=[6, 7]), *_m("vanilla", 800.0, reps=(1,), cpus=[4, 5]),
          *_m("idle", 900.0, reps=(0,), cpus=[4, 5]), *_m("idle", 1100.0, reps=(1,), cpus=[6, 7])]
    t = R.summarize(ms)
    assert t["decode-c64"]["vanilla"]["tok_s_by_cpus"] == {"4-5": pytest.approx(800.0),
                                                           "6-7": pytest.approx(1000.0)}
    md = R.markdown(_report(ms))
    assert "| scenario | 4-5 | 6-7 |" in md and "| idle | 900 | 1100 |" in md
    assert R.summarize(_m("vanilla", 1000.0))["decode-c64"]["vanilla"]["tok_s_by_cpus"] == {}


def test_the_control_engine_runs_when_named():
    quick = S.make_suite("quick")
    assert S.CONTROL not in quick.scenarios and S.CONTROL not in S.make_suite("full").scenarios
    named = S.select(quick, scenarios="vanilla,vanilla-b,idle,hidden-last")
    shape = S.MODELS["1b"]
    # Started first, before capture: an edge of the first start would show in the control's ratio.
    assert S.engine_groups(named, shape) == [["vanilla-graph-b", "capture-graph", "vanilla-graph"]]
    # Reversed (--baseline-first): an edge of the later start would favour capture and the control.
    assert S.engine_groups(replace(named, baseline_first=True), shape) == [
        ["vanilla-graph", "capture-graph", "vanilla-graph-b"]]
    assert S.engine_groups(replace(S.make_suite("full"), baseline_first=True), S.MODELS["8b"])[0] == [
        "vanilla-graph", "capture-graph"]
    kw = S.engine_kwargs(named, shape, "vanilla-graph-b")
    assert kw == S.engine_kwargs(named, shape, "vanilla-graph")  # the same engine, twice
    assert kw["gpu_memory_utilization"] == round(named.gpu_memory_utilization / 3, 3)


def test_summarize_without_baseline_gives_no_ratio():
    t = R.summarize(_m("idle", 900.0))
    assert t["decode-c64"]["idle"]["ratio"] is None


def _checks(ms, link=None):
    return {(c["check"].split()[0], c["workload"]): c for c in R.evaluate(R.summarize(ms), link)}


def test_checks_thresholds():
    ms = (_m("vanilla", 1000.0) + _m("idle", 991.0) + _m("hidden-last", 960.0)
          + _m("hidden-4l", 905.0) + _m("eager-hidden-last", 300.0))
    c = _checks(ms)
    assert c[("idle", "decode-c64")]["passed"]
    assert not c[("last-token", "decode-c64")]["passed"]  # 0.96 < 0.97
    assert c[("4", "decode-c64")]["passed"]
    graph = c[("graph", "decode-c64")]
    assert graph["value"] == pytest.approx(3.2) and graph["passed"]
    assert ("router", "decode-c64") not in c  # not measured, not evaluated


def test_checks_fail_on_incomplete_rows():
    ms = _m("vanilla", 1000.0) + _m("hidden-4l", 990.0, rows=5, rows_expected=10)
    line = _checks(ms)[("4", "decode-c64")]
    assert not line["passed"] and "incomplete" in line["detail"]


def test_heavy_check_ratio_or_link_bound():
    # 1000 tok/s vanilla; heavy delivers 1e6 B/token -> needs 0.5 GB/s at half pace
    base = _m("vanilla", 1000.0)
    ok = _checks(base + _m("heavy", 600.0, bytes=1e9), link=50.0)[("heavy", "decode-c64")]
    assert ok["passed"] and "link-bound" not in ok["detail"]
    slow = _checks(base + _m("heavy", 300.0, bytes=1e9), link=50.0)[("heavy", "decode-c64")]
    assert not slow["passed"]
    # 1e9 B/token: half of vanilla's pace would need 500 GB/s > the 50 GB/s link -> link rule
    heavy = _m("heavy", 40.0, bytes=1e12)  # 40 tok/s x 1e9 B = 40 GB/s = 80% of the link
    bound = _checks(base + heavy, link=50.0)[("heavy", "decode-c64")]
    assert "link-bound" in bound["detail"] and bound["passed"]
    weak = _checks(base + _m("heavy", 20.0, bytes=1e12), link=50.0)[("heavy", "decode-c64")]
    assert not weak["passed"]


def test_check_text():
    line = {"check": "idle >= 0.99 x vanilla", "workload": "decode-c64", "value": 0.98,
            "threshold": 0.99, "passed": False, "detail": ""}
    assert R.check_text(line).startswith("FAIL  decode-c64")


# ---- files -----------------------------------------------------------------------------------

def _report(ms):
    table = R.summarize(ms)
    return {"suite": "quick", "model": "1b", "model_label": "Llama-3.2-1B", "date": "20260101-000000",
            "dry_run": False, "reps": 2, "env": {"command": "python3 benchmarks/run.py --suite quick"},
            "d2h": {"pinned_gbps": 54.6, "by_size_gbps": {"64": 50.0}, "pageable_gbps": 12.0},
            "engines": {"vanilla-graph": {"init_s": 80.0, "kv_cache_tokens": 1000, "nvml_engine": 2**30},
                        "capture-graph": {"init_s": 82.0, "kv_cache_tokens": 900, "nvml_engine": 2**30,
                                          "capture_allocation_bytes": 2**29}},
            "table": table, "checks": R.evaluate(table, 54.6), "skipped": [
                {"engine": "capture-graph", "workload": "decode-c64", "scenario": "heavy", "reason": "x"}],
            "measurements": ms}


def test_write_report_files(tmp_path):
    ms = _m("vanilla", 1000.0) + _m("idle", 995.0) + _m("hidden-4l", 950.0, fetch_s=0.1, rows=10,
                                                         bytes=1e6, rows_expected=10)
    rep = _report(ms)
    paths = R.write(rep, tmp_path)
    names = sorted(p.name for p in paths)
    assert {"results.json", "results.md"} <= set(names)
    for p in tmp_path.iterdir():
        assert re.fullmatch(r"[A-Za-z0-9._-]+", p.name)
    assert json.loads((tmp_path / "results.json").read_text())["table"]["decode-c64"]["idle"]["ratio"] == \
        pytest.approx(0.995)
    md = (tmp_path / "results.md").read_text()
    assert "## decode-c64" in md and "| idle | capture-graph |" in md and "PASS" in md
    assert "(-100)" in md  # KV cache tokens vs vanilla
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tok_s_ratio.png").read_bytes()[:4] == b"\x89PNG"


def test_load_reads_a_run_folder_plain_gzipped_or_by_file(tmp_path):
    """A fresh run's folder holds results.json; a committed one results.json.gz: both, and either
    file named directly, load to the report written."""
    rep = _report(_m("vanilla", 1000.0) + _m("idle", 995.0))
    fresh, committed = tmp_path / "fresh", tmp_path / "committed"
    R.write(rep, fresh)
    committed.mkdir()
    with gzip.open(committed / "results.json.gz", "wt") as f:
        f.write((fresh / "results.json").read_text())
    expected = json.loads((fresh / "results.json").read_text())
    for where in (fresh, committed, fresh / "results.json", committed / "results.json.gz"):
        assert R.load(where) == expected, where
    assert R.load(committed)["table"]["decode-c64"]["idle"]["ratio"] == pytest.approx(0.995)


def test_markdown_with_nothing_measured():
    rep = _report([])
    rep["checks"], rep["engines"] = [], {"vanilla-graph": {"error": "boom"}}
    md = R.markdown(rep)
    assert "none evaluated" in md and "boom" in md


def test_results_dir_is_two_levels_with_safe_names(tmp_path):
    d = results_dir(tmp_path, S.make_suite("full", "tiny-moe"), "20260101-120000")
    assert d.relative_to(tmp_path).parts == ("results", "20260101-120000-full-tiny-moe")




def test_startup_phases_match_the_log_lines_vllm_writes():
    """startup.py reads the parts of a start from vLLM's log: its patterns must match what vLLM
    0.26 formats (the messages come from vLLM's own sources, filled in here)."""
    import importlib.util
    import inspect
    from pathlib import Path

    from benchmarks import startup
    from vllm.compilation.monitor import monitor_torch_compile

    def source(module: str) -> str:
        return Path(importlib.util.find_spec(module).origin).read_text()

    compile_line = inspect.signature(monitor_torch_compile).parameters["message"].default % 12.5
    init_line = re.search(r'"(init engine \(profile, create kv cache, warmup model\) took %\.2f s)"',
                          source("vllm.v1.engine.core")).group(1) % 41.25
    capture_line = re.search(r'"(Graph capturing finished in %\.0f secs, took %\.2f GiB)"',
                             source("vllm.v1.worker.gpu.model_runner")).group(1) % (3, 0.5)
    load_line = re.search(r'"(Model loading took %s GiB and %\.6f seconds)"',
                          source("vllm.v1.worker.gpu.model_runner")).group(1) % ("2.3", 4.5)
    dynamo_line = re.search(r'"(Dynamo bytecode transform time: %\.2f s)"',
                            source("vllm.compilation.backends")).group(1) % 6.25
    range_line = re.search(r'"(Compiling a graph for compile range %s takes %\.2f s)"',
                           source("vllm.compilation.backends")).group(1)
    pieces = "".join(f"INFO {range_line % (r, s)}\n"
                     for r, s in (("(1, 512)", 2.5), ("(513, 8192)", 1.25)))
    log = (f"INFO {load_line}\nINFO {dynamo_line}\n{pieces}INFO {compile_line}\n"
           f"INFO {capture_line}\nINFO {init_line}\n")
    found = {name: [float(v) for v in pattern.findall(log)] for name, pattern in startup.PHASES.items()}
    assert found == {"load_s": [4.5], "dynamo_s": [6.25], "inductor_s": [2.5, 1.25],
                     "compile_s": [12.5], "graph_capture_s": [3.0], "engine_init_s": [41.25]}


def test_startup_milestones_read_the_times_its_logging_config_stamps():
    """startup.py's engines log through LOGGING_CONFIG; a line formatted by it (vLLM's formatter)
    must give its step's time after the call, and the segments must add up to the start."""
    import logging

    from benchmarks import startup
    from vllm.logging_utils import NewLineFormatter

    fmt = startup.LOGGING_CONFIG["formatters"]["vllm"]
    formatter = NewLineFormatter(fmt["format"])
    t0 = 1_765_000_000.0
    messages = {"engine_core": "Initializing a V1 LLM engine (v0.26.0) with config: ...",
                "load_begin": "Loading model from scratch...",
                "load_end": "Model loading took 2.32 GiB and 1.5 seconds",
                "dynamo_end": "Dynamo bytecode transform time: 1.31 s",
                "compile_end": "torch.compile took 2.28 s in total",
                "profile_end": "Initial profiling/warmup run took 0.14 s",
                "kv_cache": "Available KV cache memory: 52.41 GiB",
                "graphs_end": "Graph capturing finished in 1 secs, took 0.15 GiB",
                "engine_init_end": "init engine (profile, create kv cache, warmup model) took 5 s"}
    assert list(messages) == list(startup.MILESTONES)
    lines = []
    for i, (name, message) in enumerate(messages.items()):
        record = logging.LogRecord("vllm.x", logging.INFO, "/x/core.py", 7, message, None, None)
        record.created = t0 + 0.25 * (i + 1) + 0.0004  # rounds to the millisecond below
        lines.append(f"(EngineCore pid=1) {formatter.format(record)}")
        lines.append(f"(EngineCore pid=1) {formatter.format(record)}")  # not the first: ignored
    got = startup.milestones("noise\n" + "\n".join(lines), t0)
    assert got == {name: 0.25 * (i + 1) for i, name in enumerate(messages)}
    split = startup.segments({"llm_s": 3.0, "milestones_s": got})
    assert split == {**{name: 0.25 for name in messages}, "return": 0.75}
    assert startup.segments({"llm_s": 3.0, "milestones_s": {"engine_core": 0.25}}) == {}
    starts = [{"kind": "vanilla", "cache": "warm", "llm_s": 3.0, "milestones_s": got},
              {"kind": "capture", "cache": "warm", "llm_s": 3.5,
               "milestones_s": {**got, "graphs_end": got["graphs_end"] + 0.5,
                                "engine_init_end": got["engine_init_end"] + 0.5}}]
    extra = startup.segments_over_vanilla(starts)["capture"]["warm"]
    assert extra == {**{name: 0.0 for name in messages}, "graphs_end": 0.5, "return": 0.0}


def test_startup_ratios_are_each_capture_kinds_median_over_vanillas():
    from benchmarks import startup

    def start(kind, cache, seconds):
        return {"kind": kind, "cache": cache, "llm_s": seconds}

    starts = [start("vanilla", "cold", 50.0), start("capture", "cold", 60.0),
              start("capture-before", "cold", 52.0), start("vanilla", "cold", 56.0),
              start("capture", "cold", 64.0), start("capture-before", "cold", None),
              start("vanilla", "warm", 10.0), start("capture", "warm", 9.0)]
    got = startup.over_vanilla(starts)
    assert got == {"capture": {"cold": pytest.approx(62.0 / 53.0), "warm": pytest.approx(0.9)},
                   "capture-before": {"cold": pytest.approx(52.0 / 53.0)}}


def test_startup_round_ratios_pair_each_round_and_the_pool_groups_by_gpu_and_model(tmp_path):
    """A round's ratio is its capture start over its vanilla start, not a median over rounds; the
    pool reads startup.json from folders and from a session's logs.tgz, names the GPU and host
    from the gpu.txt beside it, leaves capture-before out, and pools per GPU, model and cache."""
    import tarfile

    from benchmarks import startup, startup_pool

    def start(r, kind, cache, seconds):
        return {"round": r, "kind": kind, "cache": cache, "llm_s": seconds}

    # Round 0: capture twice vanilla's time; round 1: equal, vanilla 4x slower than round 0's.
    starts = [start(0, "vanilla", "warm", 10.0), start(0, "capture", "warm", 20.0),
              start(0, "capture-before", "warm", 30.0), start(1, "capture", "warm", 40.0),
              start(1, "vanilla", "warm", 40.0), start(1, "vanilla", "cold", 60.0)]
    by_round = startup.round_ratios(starts)
    assert by_round == {"capture": {"warm": [2.0, 1.0]}, "capture-before": {"warm": [3.0]}}
    assert startup.over_vanilla(starts)["capture"]["warm"] == pytest.approx(30.0 / 25.0)
    unnamed = [{k: v for k, v in s.items() if k != "round"} for s in starts[:2]]
    assert startup.round_ratios(unnamed) == {"capture": {"warm": [2.0]}}  # before --rounds

    def write(folder: Path, model: str, gpu: str, starts: list[dict]) -> None:
        folder.mkdir(parents=True)
        (folder / "startup.json").write_text(json.dumps({"model": model, "starts": starts}))
        cpu = json.dumps({"model_number": "207"})
        (folder / "gpu.txt").write_text(f"{gpu}, 580.159.04, 143771 MiB\nvllm 0.26.0\ncpu {cpu}\n")

    write(tmp_path / "a" / "startup", "1b", "NVIDIA H200", starts)
    write(tmp_path / "b" / "startup-1b", "1b", "NVIDIA H200",
          [start(0, "vanilla", "warm", 10.0), start(0, "capture", "warm", 10.5),
           start(0, "vanilla", "cold", 50.0), start(0, "capture", "cold", 45.0)])
    write(tmp_path / "b" / "startup-8b", "8b", "NVIDIA H200",
          [start(0, "vanilla", "warm", 12.0), start(0, "capture", "warm", 13.08)])
    write(tmp_path / "c" / "startup", "1b", "NVIDIA H100 80GB HBM3",
          [start(0, "vanilla", "warm", 10.0), start(0, "capture", "warm", 10.0)])
    archive = tmp_path / "session" / "logs.tgz"
    archive.parent.mkdir()
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "b", arcname=".")
    runs = [*startup_pool.load(str(tmp_path / "a")), *startup_pool.load(str(archive)),
            *startup_pool.load(str(tmp_path / "c" / "startup" / "startup.json"))]
    assert [(r["name"].split("/")[-1], r["gpu"], r["cpu"], r["model"]) for r in runs] == [
        ("startup", "NVIDIA H200", "207", "1b"), ("startup-1b", "NVIDIA H200", "207", "1b"),
        ("startup-8b", "NVIDIA H200", "207", "8b"),
        ("startup", "NVIDIA H100 80GB HBM3", "207", "1b")]
    assert runs[1]["name"] == "session/startup-1b"
    pooled = {(p["gpu"], p["model"], p["cache"]): p for p in startup_pool.pooled(runs)}
    h200_warm = pooled[("NVIDIA H200", "1b", "warm")]
    assert h200_warm["rounds"] == 3 and h200_warm["over_bound"] == 1
    assert h200_warm["pooled"]["value"] == pytest.approx((2.0 * 1.0 * 1.05) ** (1 / 3))
    low, high = h200_warm["pooled"]["ci95"]
    assert low < h200_warm["pooled"]["value"] < high
    assert pooled[("NVIDIA H200", "1b", "cold")]["pooled"] == {"value": pytest.approx(0.9),
                                                              "ci95": None, "pairs": 1}
    assert pooled[("NVIDIA H200", "8b", "warm")]["pooled"]["value"] == pytest.approx(1.09)
    assert pooled[("NVIDIA H100 80GB HBM3", "1b", "warm")]["pooled"]["value"] == 1.0
    table = startup_pool.markdown(runs)
    assert "| session/startup-1b | NVIDIA H200 | 207 | 1b | 0.900 | 1.050 |" in table
    with pytest.raises(SystemExit, match="no startup.json"):
        startup_pool.load(str(tmp_path / "session"))


def test_hook_tracing_traces_the_stack_plain_and_with_each_kind_of_site():
    """benchmarks/hook_tracing.py: the instrumented stacks carry capture's classes where it says
    (layers for hidden states, o_proj for heads), and every kind is traced once a rep."""
    from benchmarks import hook_tracing
    from vllm_capture.session.components import ATTENTION_HEADS, HIDDEN_STATES

    both = hook_tracing.instrumented(2, (HIDDEN_STATES, ATTENTION_HEADS))
    heads = hook_tracing.instrumented(2, (ATTENTION_HEADS,))
    assert [type(m).__name__ for m in (both.layers[1], both.layers[1].o_proj)] == [
        "CapturedLayer", "CapturedLinear"]
    assert [type(m).__name__ for m in (heads.layers[0], heads.layers[0].o_proj)] == [
        "Layer", "CapturedLinear"]
    seconds = hook_tracing.measure(layers=2, reps=2)
    assert list(seconds) == ["plain", "hidden", "heads", "both"]
    assert all(len(v) == 2 and min(v) > 0 for v in seconds.values())


def run_startup_script(*args: str):
    """benchmarks/startup.py in a fresh process (its argument checks run before any engine)."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "startup.py"
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=60)


def test_startup_package_before_must_hold_the_package(tmp_path):
    proc = run_startup_script("--package-before", str(tmp_path))
    assert proc.returncode == 2 and "--package-before" in proc.stderr
    assert "holds no vllm_capture/ package" in proc.stderr


def test_startup_gpu_share_must_be_a_share():
    for share in ("0", "1.5"):
        proc = run_startup_script("--gpu-memory-utilization", share)
        assert proc.returncode == 2, share
        assert "--gpu-memory-utilization: a share in (0, 1]" in proc.stderr


def test_reduction_fetch_checks_the_rows_it_fetches():
    """benchmarks/reduction_fetch.py drives the worker's last-token fetch path without an engine
    and stops if a fetched row is not the last step's activation."""
    from benchmarks import reduction_fetch

    bench = reduction_fetch.Bench(layers=3, width=5, requests=4, prompt=3)
    stages = bench.run(steps=2, early=1)  # one request a step before the others
    assert stages["fetch_store"] > 0  # the closing reductions, stored by the fetch itself
    assert stages["worker"] > 0 and stages["client"] > 0
    last = bench.step  # a corrupted readout must not pass the check

    def wrong_step(req_ids, first, rows):
        return last(req_ids, first, rows) + 1

    bench.step = wrong_step
    with pytest.raises(SystemExit, match="not the last step's rows"):
        bench.run(steps=1)


def test_step_host_times_the_step_path_and_counts_plan_copies():
    """benchmarks/step_host.py drives the step path as the runner wrappers do: a last-token stream
    copies its plan once for the first decode step and never again; so does a row stream, whose
    later steps set the device plan's step count (20 steps of 4 rows stay within its ring)."""
    from benchmarks import step_host

    import torch

    cpu = torch.device("cpu")
    last = step_host.measure(layers=2, width=8, requests=4, steps=20, reduce="last", device=cpu)
    assert last["plan_uploads"] == 1
    assert last["begin_end_us"] > 0
    rows = step_host.measure(layers=2, width=8, requests=4, steps=20, reduce="all", device=cpu)
    assert (rows["plan_uploads"], rows["plan_steps"]) == (1, 19)


def test_step_host_first_steps_time_each_of_a_generates_first_steps():
    """--first-steps: each of a generate's six first steps is timed (every generate's requests
    are new, so each plans its prefill again), and the step named is profiled."""
    from benchmarks import step_host

    import torch

    out = step_host.measure_first_steps(layers=2, width=8, requests=8, generates=3,
                                        device=torch.device("cpu"), cprofile_step="prefill1")
    steps = out["step_us"]
    assert list(steps) == ["prefill0", "prefill1", "decode0", "decode1", "decode2", "decode3"]
    assert all(v > 0 for v in steps.values())
    # each step's median and the sum are rounded to 0.1 us apiece: up to 0.05 off each
    assert out["first_steps_us"] == pytest.approx(sum(steps.values()),
                                                  abs=0.05 * (len(steps) + 1) + 1e-9)
    assert "_open_tracks" in out["cprofile"]  # the prefill step opens the new requests' tracks


# ---- one eager capture launch's host time -----------------------------------------------------

def test_ablation_rejects_a_switch_interval_that_python_would_not_take(monkeypatch, capsys):
    """--switch-interval is checked before any engine starts, naming the option."""
    from benchmarks import harvest_ablation

    before = sys.getswitchinterval()
    monkeypatch.setattr(sys, "argv", ["harvest_ablation.py", "--out", "/nonexistent",
                                      "--switch-interval", "0"])
    with pytest.raises(SystemExit) as exc:
        harvest_ablation.main()
    assert exc.value.code == 2
    assert "--switch-interval: must be > 0 seconds, got 0.0" in capsys.readouterr().err
    assert sys.getswitchinterval() == before


def test_eager_launch_times_the_launch_its_checks_and_the_op_and_checks_the_rows():
    import torch

    from benchmarks import eager_launch

    out = eager_launch.measure(tokens=96, width=40, segments=6, calls=5, rounds=2,
                               device=torch.device("cpu"))
    assert out["rows_right"]  # each request's last row reduced into its slot
    assert not out["triton"]  # off CUDA: the torch reference
    assert 0 < out["check_us"] <= out["launch_us"]
    assert out["rest_us"] == round(out["launch_us"] - out["check_us"], 2)
    assert out["op_us"] is not None and out["op_us"] > 0
    from vllm_capture.kernels import ops
    assert ops._handler is None  # the no-op handler is taken back
    with pytest.raises(ValueError, match="--segments must divide --tokens"):
        eager_launch.measure(tokens=96, width=40, segments=7, calls=1, rounds=1,
                             device=torch.device("cpu"))


# ---- the ablation's step by phase -----------------------------------------------------------

class _Step:
    """Stands in for the engine classes whose methods ``harvest_ablation.PhaseTimers`` wraps."""

    def schedule(self, n):
        return n + 1

    def step(self):
        return self.schedule(1)

    def step_with_queue(self):
        raise RuntimeError("failed step")

    def iteration(self, naps):
        self.step()
        for _ in range(naps):
            self.nap()

    def nap(self):
        time.sleep(0.002)

    def wait_for_work(self, generate_begins):
        """The engine core's input loop: waiting (and serving RPCs) when a generate begins."""
        time.sleep(0.05)
        generate_begins()
        time.sleep(0.002)


def test_phase_timers_count_every_call_in_the_forked_engine_and_add_same_named_methods():
    from benchmarks.harvest_ablation import PhaseTimers

    here = __name__
    timers = PhaseTimers((
        (here, "_Step", "step", "step"),
        (here, "_Step", "step_with_queue", "step"),  # one row for the engine's one step method
        (here, "_Step", "schedule", "schedule"),
        (here, "_Step", "no_such_method", "absent"),
        ("vllm_capture.no_such_module", "Engine", "step", "missing"),
    ))
    assert timers.names == ["step", "schedule", "absent", "missing"]
    before = timers.read()
    pid = os.fork()
    if pid == 0:  # the engine core, forked after the patch: its calls land in the parent's pages
        try:
            for _ in range(3):
                _Step().step()
            with pytest.raises(RuntimeError):
                _Step().step_with_queue()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert _Step().schedule(1) == 2  # the wrapper returns what the method returns
    spent = timers.spent(before, timers.read())
    assert set(spent) == {"step", "schedule"}  # phases nobody ran are left out
    assert spent["step"]["calls"] == 4  # a call that raised is timed too
    assert spent["schedule"]["calls"] == 3 + 1
    assert spent["step"]["ms"] >= 0 and spent["schedule"]["ms"] >= 0


def test_phase_timers_time_each_of_a_generates_first_iterations_apart():
    from benchmarks.harvest_ablation import PhaseTimers

    here = __name__
    timers = PhaseTimers(((here, "_Step", "iteration", "iteration"),
                          (here, "_Step", "step", "step"),
                          (here, "_Step", "nap", "nap")), first=2)
    _Step().iteration(3)  # an earlier generate's
    timers.new_generate()
    pid = os.fork()
    if pid == 0:  # the engine core: two naps in its first iteration, none in its second
        try:
            for naps in (2, 0, 1):
                _Step().iteration(naps)  # its step inside it ends no iteration
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    first = timers.first_iterations()
    assert len(first) == 2  # the third iteration ran, but only two are kept
    ran = ({"iteration", "step", "nap"}, {"iteration", "step"})
    for it, names in zip(first, ran):
        assert set(it) == names | {f"{name}_cpu" for name in names}
    assert first[0]["nap"] >= 4.0 and first[0]["iteration"] >= first[0]["nap"] + first[0]["step"]
    assert first[1]["iteration"] < first[0]["nap"]
    # On the thread's CPU clock a nap (a sleep) is next to nothing: the wait shows as wall time.
    assert 0 <= first[0]["nap_cpu"] < first[0]["nap"] / 4
    assert first[0]["iteration_cpu"] < first[0]["iteration"] - 3.0
    assert timers.read()["nap"][1] == 3 + 2 + 1  # the totals count on
    timers.new_generate()
    assert timers.first_iterations() == []  # no iteration of the next generate yet
    # An engine without the outer loop (in this process): each step is an iteration.
    _Step().step()
    _Step().step()
    assert [set(it) for it in timers.first_iterations()] == [{"step", "step_cpu"}] * 2


def test_phase_timers_count_a_call_from_the_generates_start():
    """The engine core waits for a generate's first request in one call of its input loop (and
    serves the RPCs that come first in it, such as a stream's start): only the part after the
    generate began is the generate's, in its first iteration and in the totals."""
    from benchmarks.harvest_ablation import PhaseTimers

    here = __name__
    timers = PhaseTimers(((here, "_Step", "wait_for_work", "input"),
                          (here, "_Step", "step", "step")), first=2)
    before = timers.read()
    _Step().wait_for_work(timers.new_generate)  # 50 ms before the generate, 2 ms in it
    _Step().step()
    first = timers.first_iterations()
    assert 2.0 <= first[0]["input"] < 40.0
    assert 2.0 <= timers.spent(before, timers.read())["input"]["ms"] < 40.0


def test_first_iterations_by_phase_pairs_each_rep_with_idles_and_prints_them(capsys):
    from benchmarks.harvest_ablation import first_iterations_by_phase, print_first_iterations

    idle = [{"first_iterations": [{"iteration": 14.0}, {"iteration": 20.0, "output_wait": 12.0}]},
            {"first_iterations": [{"iteration": 13.0}, {"iteration": 19.0, "output_wait": 11.0}]},
            {"first_iterations": [{"iteration": 15.0}]}]  # its second iteration not read
    last = [{"first_iterations": [{"iteration": 14.5}, {"iteration": 27.0, "output_wait": 18.0,
                                                        "capture_begin_step": 1.0}]},
            {"first_iterations": [{"iteration": 13.0}, {"iteration": 26.0, "output_wait": 18.0,
                                                        "capture_begin_step": 1.2}]},
            {"first_iterations": [{"iteration": 16.0}, {"iteration": 30.0}]}]
    by_phase = first_iterations_by_phase(last, idle)
    assert [it["reps"] for it in by_phase] == [3, 2]
    assert by_phase[0]["ms"] == {"iteration": 14.5}
    assert by_phase[0]["ms_vs_idle"] == {"iteration": 0.5}  # median of +0.5, 0, +1
    assert by_phase[1]["ms"] == {"iteration": 26.5, "output_wait": 18.0, "capture_begin_step": 1.1}
    assert by_phase[1]["ms_vs_idle"] == {"iteration": 7.0, "output_wait": 6.5,
                                         "capture_begin_step": 1.1}  # idle ran none: 0
    summary = {"idle": {"first_iterations": first_iterations_by_phase(idle, idle)},
               "hidden-last": {"first_iterations": by_phase}}
    print_first_iterations(summary, ("idle", "hidden-last"))
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines[:2] == [["iteration", "0", "(ms)", "idle", "hidden-last"],
                         ["iteration", "14.000", "+0.500"]]
    assert lines[2] == ["iteration", "1", "(ms)", "idle", "hidden-last"]
    assert lines[3:] == [["iteration", "19.500", "+7.000"], ["output_wait", "11.500", "+6.500"],
                         ["capture_begin_step", "0.000", "+1.100"]]


def test_nodes_check_reads_the_graph_registry_idle_and_while_capturing():
    from benchmarks.harvest_ablation import SUFFIX_SWITCHES, nodes_check

    # 30 graphs, 32 sites each; idle, all but the pinned site's nodes are left out.
    idle = {"graphs": 30, "nodes": 960, "nodes_left_out": 930}
    hidden_on = {**idle, "nodes_left_out": 450}  # the 16 hidden sites' nodes launched
    assert nodes_check((), idle, hidden_on) is None  # as shipped
    assert nodes_check(SUFFIX_SWITCHES["-nonodes"], idle, idle) is None
    assert nodes_check(SUFFIX_SWITCHES["-bare"], idle, idle) is None  # the step path skipped too
    wrong = nodes_check(SUFFIX_SWITCHES["-nonodes"], idle, hidden_on)
    assert wrong == ("450 capture nodes left out while capturing, 930 with every site idle; "
                     "the graph patch did not reach the engine")
    assert nodes_check(SUFFIX_SWITCHES["-nohost"], idle, idle).endswith("reached the engine")
    assert nodes_check(SUFFIX_SWITCHES["-nonodes"], None, None) is None  # no registry (CPU)


def test_print_phase_table_lists_each_cases_difference_from_idle(capsys):
    from benchmarks.harvest_ablation import print_phase_table

    summary = {"idle": {"phase_ms_per_step": {"step": 3.38, "schedule": 0.72}},
               "hidden-last": {"phase_ms_per_step_vs_idle": {"step": 0.111, "schedule": 0.012}}}
    print_phase_table(summary, ("idle", "hidden-last"))
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["phase", "(ms/step)", "idle", "hidden-last"]
    assert lines[1].split() == ["step", "3.3800", "+0.1110"]
    assert lines[2].split() == ["schedule", "0.7200", "+0.0120"]


def test_sequence_lists_generates_in_run_order_against_the_baselines_median():
    from benchmarks.report import gpu_summary
    from benchmarks.sequence import sequence_lines

    ms = [*_m("idle", 1000.0, reps=(0,), cpus=[4, 5, 6, 7], copy_replays=287,
              idle_nodes_replayed=0, gpu=gpu_summary([_reading(1980, 5.0, 0x1)]),
              graph_probe={"graph": {"gpu_us": 5484.26, "host_launch_us": 7.1}}),
          *_m("vanilla", 1000.0, reps=(0,), cpus=[8, 9, 10, 11]),
          *_m("vanilla", 1020.0, reps=(1,)), *_m("idle", 975.0, reps=(1,)),
          *_m("vanilla", 900.0, reps=(0,), workload="prefill-c64")]
    lines = sequence_lines(ms)
    assert lines[0] == "decode-c64: generates in run order; ratio to vanilla's median (1010 tok/s)"
    rows = [line.split() for line in lines[2:]]
    assert [r[:5] for r in rows] == [["0", "idle", "0", "4-7", "1000"],
                                     ["1", "vanilla", "0", "8-11", "1000"],
                                     ["2", "vanilla", "1", "-", "1020"],
                                     ["3", "idle", "1", "-", "975"]]
    assert rows[0][5:] == ["0.990", "287", "0", "5484.3", "1980", "500", "5", "1", "0x1"]
    assert rows[3][5:] == ["0.965", "-", "-", "-", "-", "-", "-", "-", "-"]
    assert len(sequence_lines(ms, "prefill-c64")) == 3
    assert sequence_lines([]) == []


def test_after_capture_line_gives_the_gpus_readings():
    from benchmarks.after_capture import _gpu_text
    from benchmarks.report import gpu_summary

    assert _gpu_text(None) == ""
    assert _gpu_text(gpu_summary([_reading(1980, 812.4, 0x4)])) == (
        "  [1980 MHz 500 W PCIe rx 812 tx 1 MB/s reasons 0x4]")
    assert _gpu_text(gpu_summary([_reading(1980, None)])) == (  # a field NVML could not read
        "  [1980 MHz 500 W PCIe rx - tx 1 MB/s reasons 0x0]")


def test_nvml_sample_reads_each_field_and_leaves_out_what_fails():
    import types

    from benchmarks.run import Nvml

    def unsupported(*args):
        raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")

    nv = types.SimpleNamespace(
        NVML_CLOCK_SM=0, NVML_CLOCK_MEM=1, NVML_TEMPERATURE_GPU=0, NVML_PCIE_UTIL_TX_BYTES=0,
        NVML_PCIE_UTIL_RX_BYTES=1,
        nvmlDeviceGetClockInfo=lambda h, clock: {0: 1980, 1: 3201}[clock],
        nvmlDeviceGetPowerUsage=lambda h: 512_000,  # mW
        nvmlDeviceGetTemperature=lambda h, sensor: 48,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=97, memory=55),
        nvmlDeviceGetPcieThroughput=lambda h, c: 1500 if c else unsupported(),  # KB/s
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda h: 0x4)
    nvml = Nvml.__new__(Nvml)
    nvml.nv, nvml.handle = nv, object()
    assert nvml.sample() == {"sm_mhz": 1980, "mem_mhz": 3201, "power_w": 512.0, "temp_c": 48,
                             "util_gpu": 97, "util_mem": 55, "pcie_rx_mb_s": 1.5,
                             "pcie_tx_mb_s": None, "clock_reasons": 0x4}
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 0x1  # the newer name, where present
    assert nvml.sample()["clock_reasons"] == 0x1
    nvml.nv = None
    assert nvml.sample() is None


def test_after_capture_summary_reads_each_label_against_before_and_vanilla():
    from benchmarks.after_capture import summarize

    runs = [{"round": 0, "label": "before", "engine": "capture", "tok_s": t} for t in (100, 102, 98)]
    runs += [{"round": 0, "label": "before", "engine": "vanilla", "tok_s": 100}]
    runs += [{"round": 0, "label": "after", "engine": "capture", "tok_s": t} for t in (97, 98)]
    runs += [{"round": 0, "label": "after", "engine": "vanilla", "tok_s": t} for t in (100, 110)]
    runs += [{"round": 1, "label": "before", "engine": "capture", "tok_s": 50},
             {"round": 1, "label": "host-cache", "engine": "capture", "tok_s": 45}]
    s = summarize(runs)
    assert s[0]["before"] == {"tok_s": 100, "vs_before": 1.0, "vs_vanilla": 1.0}
    assert s[0]["after"] == {"tok_s": 98, "vs_before": 0.975, "vs_vanilla": round(97.5 / 105, 4)}
    # A round is read against its own before; without a vanilla engine there is no such ratio.
    assert s[1]["host-cache"] == {"tok_s": 45, "vs_before": 0.9, "vs_vanilla": None}


@pytest.mark.parametrize("argv, field", [
    (["--releases", "wait,nap"], "--releases: unknown nap"),
    (["--releases", "vanilla-generate"], "--releases: vanilla-generate needs --beside-vanilla"),
    (["--beside-vanilla", "--in-process"], "--beside-vanilla needs each engine"),
    (["--vanilla-between", "none", "--releases", "wait"], "--vanilla-between: none needs"),
])
def test_after_capture_refuses_releases_it_cannot_run(monkeypatch, capsys, argv, field):
    from benchmarks import after_capture

    monkeypatch.setattr(sys, "argv", ["after_capture.py", "--out", "-", *argv])
    with pytest.raises(SystemExit):
        after_capture.main()
    assert field in capsys.readouterr().err


@pytest.mark.parametrize("argv, field", [
    (["--steps", "capture,nap"], "--steps: unknown nap"),
    (["--capture", "idle"], "--capture: a capture scenario"),
])
def test_slow_state_refuses_steps_it_cannot_run(monkeypatch, capsys, argv, field):
    from benchmarks import slow_state

    monkeypatch.setattr(sys, "argv", ["slow_state.py", "--out", "-", *argv])
    with pytest.raises(SystemExit):
        slow_state.main()
    assert field in capsys.readouterr().err


def test_slow_state_worker_steps_do_nothing_off_cuda():
    from types import SimpleNamespace

    import torch

    from benchmarks import slow_state

    if torch.cuda.is_available():
        pytest.skip("a GPU host runs these for real (gpu_session.sh slow-state)")
    worker = SimpleNamespace()
    for name in slow_state.WORKER_TRIGGERS:
        assert slow_state.trigger(worker, name, mb=32, chunk_mb=16) is None
    assert slow_state.second_context(worker, work=True) is None
    assert set(slow_state.DEFAULT_STEPS) <= set(slow_state.STEPS)


def test_full_graph_desc_picks_the_full_graph_of_the_decode_batch():
    from collections import namedtuple
    from types import SimpleNamespace

    from vllm.config import CUDAGraphMode

    from benchmarks.graph_replay import full_graph_desc, runner_graphs

    Desc = namedtuple("Desc", "cg_mode num_tokens")  # a hashable stand-in for vLLM's descriptor
    pw64 = Desc(CUDAGraphMode.PIECEWISE, 64)
    full32 = Desc(CUDAGraphMode.FULL, 32)
    full64 = Desc(CUDAGraphMode.FULL, 64)
    graphs = {pw64: "pw", full32: "f32", full64: "f64"}
    assert full_graph_desc(graphs, 64) is full64
    assert full_graph_desc(graphs, 16) is None
    runner = SimpleNamespace(cudagraph_manager=SimpleNamespace(graphs=graphs))
    wrapper = SimpleNamespace(worker=SimpleNamespace(model_runner=runner))
    assert runner_graphs(wrapper) is graphs  # collective_rpc's wrapper, or the worker itself
    assert runner_graphs(wrapper.worker) is graphs
    assert runner_graphs(SimpleNamespace(model_runner=SimpleNamespace())) is None  # V1 runner


# ---- step_alternation: a switch's cost, iteration against neighbouring iteration ---------------

def _alternating_rows(generate: int, costs: dict[str, float], base_us: float, rng,
                      noise_us: float = 30.0, iterations: int = 256, first: int = 0,
                      switch: str = "both", period: int = 2):
    """One capture generate's log rows (duration, host, nodes, step, generate, switch) with the
    costs (us) that ``fit_generate`` should find, the switches as the engine alternates them."""
    from benchmarks import step_alternation as SA

    rows, prev = [], (0.0, 0.0)
    alternate = SA.SWITCHES[switch]
    for i in range(iterations):
        on = SA.switches_of(first + i, period)
        host, nodes = (float(o or not a) for o, a in zip(on, alternate))
        step = SA.PLANNED if i < 2 else (SA.REPEATED if host else SA.SKIPPED)
        if step == SA.PLANNED:
            host = 1.0
        us = (base_us + costs["host"] * host + costs["host_before"] * prev[0]
              + costs["nodes"] * nodes + costs["nodes_before"] * prev[1]
              + rng.normal(0.0, noise_us))
        rows.append((us * 1e-6, host, nodes, step, generate, SA.SWITCH_NAMES.index(switch)))
        prev = (host, nodes)
    return rows


def _idle_rows(generate: int, us: float, rng, noise_us: float = 5.0, iterations: int = 256):
    from benchmarks import step_alternation as SA

    none = SA.SWITCH_NAMES.index("none")
    return [(rng.normal(us, noise_us) * 1e-6, 0.0, 1.0, SA.NO_STEP, generate, none)
            for _ in range(iterations)]


def test_load_log_reads_a_log_or_its_gzipped_twin(tmp_path):
    """A committed log is kept gzipped: its .npy path (as the READMEs' commands name it) reads
    the .npy.gz beside it, byte for byte the array saved; a plain .npy is read as it is."""
    import gzip
    import io

    import numpy as np

    from benchmarks import step_alternation as SA

    rows = np.array(_idle_rows(0, 2800.0, np.random.default_rng(0), iterations=5))
    plain = tmp_path / "plain" / "step_alternation.npy"
    plain.parent.mkdir()
    np.save(plain, rows)
    packed = tmp_path / "packed" / "step_alternation.npy"
    packed.parent.mkdir()
    buf = io.BytesIO()
    np.save(buf, rows * 2)
    (packed.parent / "step_alternation.npy.gz").write_bytes(gzip.compress(buf.getvalue()))
    assert SA.log_exists(plain) and SA.log_exists(packed)
    assert not SA.log_exists(tmp_path / "none.npy")
    assert np.array_equal(SA.load_log(plain), rows)
    assert np.array_equal(SA.load_log(packed), rows * 2)
    assert np.array_equal(SA.load_log(packed.with_name("step_alternation.npy.gz")), rows * 2)
    with pytest.raises(FileNotFoundError):
        SA.load_log(tmp_path / "none.npy")


def test_switch_patterns_let_each_switch_and_the_one_before_be_told_apart():
    """Over the patterns, each switch is on half the time; the iteration before is on as often
    as off whatever this one is, but for the nodes after the nodes (three in four); the
    regression's columns are independent."""
    import numpy as np

    from benchmarks.step_alternation import switches_of

    assert [switches_of(k, period=3) for k in (0, 2, 3, 5, 6)] == [
        (True, True), (True, True), (False, True), (False, True), (True, False)]
    on = np.array([switches_of(k) for k in range(64)], dtype=float)
    host, nodes = on[:, 0], on[:, 1]
    assert host.mean() == nodes.mean() == 0.5
    for this, before in ((host, np.roll(host, 1)), (host, np.roll(nodes, 1)),
                         (nodes, np.roll(host, 1)), (host, nodes)):
        for state in (0.0, 1.0):
            assert before[this == state].mean() == 0.5
    nodes_before = np.roll(nodes, 1)
    assert (nodes_before[nodes == 1].mean(), nodes_before[nodes == 0].mean()) == (0.75, 0.25)
    x = np.column_stack([np.ones(64), host, np.roll(host, 1), nodes, np.roll(nodes, 1)])
    assert np.linalg.matrix_rank(x) == 5


def test_fit_generate_finds_each_switchs_cost_in_its_iteration_and_the_next():
    import numpy as np

    from benchmarks.step_alternation import fit_generate

    rng = np.random.default_rng(0)
    costs = {"host": 40.0, "host_before": 12.0, "nodes": 20.0, "nodes_before": -6.0}
    rows = np.array(_alternating_rows(1, costs, 2800.0, rng, first=3))
    rows[[50, 90, 130], 0] += 0.05  # the host's 50 ms stalls: above the 99th percentile
    fit = fit_generate(rows)
    assert fit["base"] == pytest.approx(2800.0, abs=12)
    for term, cost in costs.items():
        assert fit[term] == pytest.approx(cost, abs=12), term
    # Too few steady iterations to fit: none.
    assert fit_generate(rows[:30]) is None


def test_fit_generate_fits_the_switch_that_alternated_and_takes_the_other_as_base():
    import numpy as np

    from benchmarks.step_alternation import fit_generate

    rng = np.random.default_rng(5)
    costs = {"host": 40.0, "host_before": 0.0, "nodes": 25.0, "nodes_before": 5.0}
    host_only = fit_generate(np.array(_alternating_rows(1, costs, 2800.0, rng, switch="host",
                                                        period=8)))
    assert set(host_only) == {"base", "host", "host_before"}
    assert host_only["base"] == pytest.approx(2800.0 + 25.0 + 5.0, abs=12)  # the nodes on
    assert host_only["host"] == pytest.approx(40.0, abs=12)
    nodes_only = fit_generate(np.array(_alternating_rows(1, costs, 2800.0, rng, switch="nodes")))
    assert set(nodes_only) == {"base", "nodes", "nodes_before"}
    assert nodes_only["nodes"] == pytest.approx(25.0, abs=12)
    # Nothing alternated: nothing to fit.
    assert fit_generate(np.array(_alternating_rows(1, costs, 2800.0, rng, switch="none"))) is None


def test_analyse_reads_capture_generates_against_the_idle_generates_beside_them():
    import numpy as np

    from benchmarks import step_alternation as SA

    rng = np.random.default_rng(1)
    costs = {"host": 40.0, "host_before": 0.0, "nodes": 0.0, "nodes_before": 0.0}
    rows = []
    for g in range(6):
        rows += (_alternating_rows(g, costs, 2900.0, rng, noise_us=5.0) if SA.is_capture(g)
                 else _idle_rows(g, 2800.0, rng))
    summary = SA.analyse(np.array(rows))
    assert summary["idle_generates"] == 3 and list(summary["switches"]) == ["both"]
    out = summary["switches"]["both"]
    assert out["capture_generates"] == out["fitted_generates"] == 3
    assert out["host"]["us"] == pytest.approx(40.0, abs=3)
    assert out["host_total"]["us"] == pytest.approx(40.0, abs=4)
    assert out["base_vs_idle"]["us"] == pytest.approx(100.0, abs=4)
    assert out["all_on_vs_idle"]["us"] == pytest.approx(140.0, abs=6)
    # Whole generates: the host on half the iterations, so 2800 / (2900 + 20), nearly.
    assert out["generate_vs_idle"]["value"] == pytest.approx(2800 / 2920, rel=0.003)
    # The median steady iteration: as many with the host on as off, between 2900 and 2940.
    assert 95 <= out["iteration_vs_idle"]["us"] <= 145
    assert out["iterations"]["planned"] == 6 and out["iterations"]["capture"] == 3 * 256
    assert "wall_vs_idle" not in out and SA.wall_lines(out) == []


def test_analyse_reads_the_clients_wall_time_and_the_time_outside_the_iterations():
    """The client's generate times beside the iterations: capture 30 ms a generate more outside
    the engine's iterations than idle (an untimed idle generate left out); its iterations 20 ms
    shorter."""
    import numpy as np

    from benchmarks import step_alternation as SA

    rng = np.random.default_rng(4)
    costs = {"host": 0.0, "host_before": 0.0, "nodes": 0.0, "nodes_before": 0.0}
    rows, walls = [], np.full(8, np.nan)
    for g in range(7):
        us, outside_s = (2800.0 - 20e3 / 256, 0.080) if SA.is_capture(g) else (2800.0, 0.050)
        mine = (_alternating_rows(g, costs, us, rng, noise_us=1.0, switch="none")
                if SA.is_capture(g) else _idle_rows(g, us, rng, noise_us=1.0))
        rows += mine
        walls[g] = sum(r[0] for r in mine) + outside_s
    walls[4] = np.nan  # not timed: generate 3 and 5 have one timed idle generate beside each
    out = SA.analyse(np.array(rows), walls=walls)["switches"]["none"]
    assert out["outside_vs_idle"]["us"] == pytest.approx(30e3, abs=50)
    assert out["outside_vs_idle"]["generates"] == 3
    idle_s, capture_s = 256 * 2800e-6, 256 * 2800e-6 - 20e-3
    assert out["generate_vs_idle"]["value"] == pytest.approx(idle_s / capture_s, rel=1e-3)
    assert out["wall_vs_idle"]["value"] == pytest.approx((idle_s + 0.05) / (capture_s + 0.08),
                                                         rel=1e-3)
    assert out["wall_vs_idle"]["pairs"] == 3
    lines = SA.wall_lines(out)
    assert lines[0].startswith(f"iterations {idle_s / capture_s:.3f} (")
    assert f"client {(idle_s + 0.05) / (capture_s + 0.08):.3f} (" in lines[0]
    assert lines[1].startswith("outside the iterations +30.00 ms a generate (")


def test_analyse_reads_each_switch_kind_of_one_run_apart():
    """Capture generates taking --switch both,none in turn: each kind against the idle
    generates beside its own; the plain ones have nothing to fit."""
    import numpy as np

    from benchmarks import step_alternation as SA

    rng = np.random.default_rng(3)
    costs = {"host": 40.0, "host_before": 0.0, "nodes": 0.0, "nodes_before": 0.0}
    rows = []
    for g in range(8):
        if not SA.is_capture(g):
            rows += _idle_rows(g, 2800.0, rng)
        elif (g // 2) % 2 == 0:
            rows += _alternating_rows(g, costs, 2800.0, rng, noise_us=5.0)
        else:  # as shipped: 120 us an iteration more
            rows += _alternating_rows(g, {**costs, "host": 120.0}, 2800.0, rng, noise_us=5.0,
                                      switch="none")
    summary = SA.analyse(np.array(rows))
    both, none = summary["switches"]["both"], summary["switches"]["none"]
    assert (both["capture_generates"], both["fitted_generates"]) == (2, 2)
    assert (none["capture_generates"], none["fitted_generates"]) == (2, 0)
    assert both["host"]["us"] == pytest.approx(40.0, abs=3)
    assert none["host"] is None and none["base_vs_idle"] is None
    assert none["iteration_vs_idle"]["us"] == pytest.approx(120.0, abs=3)
    assert none["generate_vs_idle"]["value"] == pytest.approx(2800 / 2920, rel=0.002)
    assert both["generate_vs_idle"]["value"] == pytest.approx(2800 / 2820, rel=0.002)


def test_check_switches_names_a_kind_whose_iterations_did_otherwise():
    import numpy as np

    from benchmarks import step_alternation as SA

    rng = np.random.default_rng(6)
    costs = {"host": 0.0, "host_before": 0.0, "nodes": 0.0, "nodes_before": 0.0}
    good = _idle_rows(0, 2800.0, rng) + _alternating_rows(1, costs, 2800.0, rng, switch="host") \
        + _idle_rows(2, 2800.0, rng) + _alternating_rows(3, costs, 2800.0, rng, switch="none")
    assert SA.check_switches(np.array(good)) is None
    # A "host" generate whose graphs went out without nodes: the replay patch did more than asked.
    bad = np.array(good)
    bad[300, 2] = 0.0
    assert "--switch host asks" in SA.check_switches(bad)
    # A "both" generate that never skipped the step path: the step patch did not reach it.
    never = np.array(_idle_rows(0, 2800.0, rng)
                     + _alternating_rows(1, costs, 2800.0, rng, switch="nodes"))
    never[never[:, 4] == 1, 5] = SA.SWITCH_NAMES.index("both")
    assert "--switch both asks" in SA.check_switches(never)
    assert SA.parse_switches("both,none") == ["both", "none"]
    with pytest.raises(ValueError, match="sometimes not among"):
        SA.parse_switches("both,sometimes")


def test_iteration_log_keeps_the_generate_an_iteration_started_in_across_a_fork():
    """The forked engine writes, the client reads; an iteration that ends after the client
    stopped the log still counts for the generate it began in, with what it switched; past its
    capacity, nothing."""
    from benchmarks.step_alternation import REPEATED, SWITCH_NAMES, IterationLog

    log = IterationLog(capacity=3)
    log.start_generate(5, "nodes")
    pid = os.fork()
    if pid == 0:
        try:
            started_in, switch = log.generate, log.switch
            log.append(0.002, True, False, REPEATED, started_in, switch)
            log.stop()  # the client, meanwhile
            log.append(0.003, True, True, REPEATED, started_in, switch)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert log.count == 2 and log.generate == -1
    assert log.rows[:2, 4].tolist() == [5.0, 5.0]
    assert log.rows[:2, 5].tolist() == [SWITCH_NAMES.index("nodes")] * 2
    assert log.rows[:2, 0].tolist() == [0.002, 0.003]
    for _ in range(3):
        log.append(0.001, False, False, REPEATED, 6)
    assert log.count == 3


def test_step_alternation_refuses_a_cpu_and_analyses_a_saved_log_anywhere(tmp_path, monkeypatch,
                                                                           capsys):
    import numpy as np
    import torch

    from benchmarks import step_alternation as SA

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["step_alternation.py", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="runs on a GPU"):
        SA.main()
    for args, message in ((["--period", "0"], "--period: 0 is not a number of iterations"),
                          (["--switch", "both,never"], "--switch: never not among")):
        monkeypatch.setattr(sys, "argv", ["step_alternation.py", "--out", str(tmp_path), *args])
        with pytest.raises(SystemExit):
            SA.main()
        assert message in capsys.readouterr().err
    # A log of session 29 (five columns: no switch column), its capture generates as shipped.
    rng = np.random.default_rng(2)
    costs = {"host": 30.0, "host_before": 0.0, "nodes": 0.0, "nodes_before": 0.0}
    rows = _idle_rows(0, 2800.0, rng, iterations=64)
    rows += _alternating_rows(1, costs, 2800.0, rng, noise_us=2.0, iterations=64, switch="none")
    np.save(tmp_path / "log.npy", np.array(rows)[:, :5])
    # The client's generate times beside it (runs since session 31): 10 ms more outside.
    np.save(tmp_path / SA.WALLS, np.array([sum(r[0] for r in rows[:64]) + 0.02,
                                           sum(r[0] for r in rows[64:]) + 0.03]))
    # The engine's CPU samples beside it, gzipped as gpu_session.sh brings them back: the
    # capture generate's steady iterations 4 ms longer, in one function; its first ones 1 ms
    # shorter.
    import gzip

    with gzip.open(tmp_path / (SA.SAMPLES + ".gz"), "wt") as f:
        for generate, head, extra in ((0, 10, 0), (1, 9, 4)):
            for part, samples, mine in (("head", head, {}), ("steady", 100 + extra, {"b.py:g": extra})):
                f.write(json.dumps({"label": SA.sample_label(generate, 0 if part == "head" else 9),
                                    "samples": samples, "interval_s": 0.001,
                                    "self": {"a.py:f": samples - extra, **mine},
                                    "inclusive": {"a.py:f": 100}}) + "\n")
    monkeypatch.setattr(sys, "argv", ["step_alternation.py", "--out", str(tmp_path / "again"),
                                      "--analyse", str(tmp_path / "log.npy"), "--switch", "none"])
    assert SA.main() == 0
    printed = capsys.readouterr().out
    assert "\ncpu none steady: all +4.0 ms a generate, of 100 ms beside (1 pairs)\n" in printed
    assert "\ncpu none head: all -1.0 ms a generate, of 10 ms beside (1 pairs)\n" in printed
    assert "\nwall none: outside the iterations" not in printed  # one pair: no interval
    assert "\nwall none: iterations " in printed
    summary = json.loads((tmp_path / "again" / "step_alternation.json").read_text())
    assert summary["idle_generates"] == 1 and list(summary["switches"]) == ["none"]
    plain = summary["switches"]["none"]
    assert (plain["capture_generates"], plain["fitted_generates"]) == (1, 0)
    assert plain["iteration_vs_idle"] is None  # one generate: no interval over generates
    assert plain["generate_vs_idle"]["pairs"] == 1
    steady = plain["cpu_samples"]["steady"]
    assert steady["all"] == {"ms": 4.0, "ci95": None}
    assert steady["self"][0]["function"] == "b.py:g" and steady["self"][0]["ms"] == 4.0
    assert SA.sample_label(-1, 0) is None and SA.sample_label(3, SA.FIRST_STEADY) == "3:steady"
    assert SA.sample_label(3, SA.FIRST_STEADY - 1) == "3:head"


# ---- cpu_samples: the main thread's CPU by function --------------------------------------------

def _spin(seconds: float) -> None:
    """Keep this thread on a CPU for ``seconds`` of its CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _spin_longer(seconds: float) -> None:
    _spin(seconds)


def _step(work, seconds: float) -> None:
    work(seconds)


def test_cpu_sampler_counts_the_main_threads_functions_under_their_label(tmp_path):
    from benchmarks import cpu_samples as C

    path = tmp_path / "samples.jsonl"
    sampler = C.Sampler(path, interval_s=0.002, root=_step.__code__)
    sampler.start()
    try:
        sampler.set_label(1)
        _step(_spin, 0.3)
        sampler.set_label(None)
        _spin(0.1)  # not counted
        sampler.set_label(2)
        _step(_spin_longer, 0.15)
    finally:
        sampler.stop()
    samples = C.read_samples(path)
    assert set(samples) == {1, 2}
    spin, longer = (C.code_key(f.__code__) for f in (_spin, _spin_longer))
    assert spin.endswith("test_benchmarks.py:_spin")
    first, second = samples[1], samples[2]
    # 0.3 s of CPU in 2 ms samples: about 150, of which the sampled thread's own nearly all.
    assert 60 <= first["samples"] <= 400 and first["samples"] > second["samples"] > 20
    assert first["self"][spin] >= 0.8 * first["samples"]
    # Inclusive: the functions below the root (the root and the test above it are not).
    assert first["inclusive"][spin] >= 0.8 * first["samples"]
    assert second["inclusive"][longer] >= 0.8 * second["samples"]
    assert second["inclusive"][spin] >= 0.8 * second["samples"]
    assert C.code_key(_step.__code__) not in first["inclusive"]
    # Each label keeps the process's CPU time under it: about 0.3 s and 0.15 s here.
    assert 0.25 <= first["cpu_s"] <= 0.6 and 0.12 <= second["cpu_s"] <= 0.4
    # Stopped: the timer is off and the handler gone, so nothing more is counted or written.
    lines = path.read_text().count("\n")
    _spin(0.05)
    assert path.read_text().count("\n") == lines == 2


def test_cpu_sampler_counts_a_sample_taken_while_it_writes_under_the_new_label(tmp_path,
                                                                             monkeypatch):
    """A signal can arrive while a label's counts are written (session 30's first run on the CPU
    VM's engine died of it: 'dictionary changed size during iteration')."""
    from benchmarks import cpu_samples as C

    sampler = C.Sampler(tmp_path / "samples.jsonl")
    sampler.set_label("a")
    sampler._on_sample(0, sys._getframe())
    by_key = C._by_key

    def interrupted(counts):
        sampler._on_sample(0, sys._getframe())  # the handler, while "a" is being written
        return by_key(counts)

    monkeypatch.setattr(C, "_by_key", interrupted)
    sampler.set_label("b")
    monkeypatch.setattr(C, "_by_key", by_key)
    sampler.set_label(None)
    samples = C.read_samples(tmp_path / "samples.jsonl")
    assert samples["a"]["samples"] == 1 and samples["b"]["samples"] == 2


def test_cpu_samples_compare_each_run_with_those_beside_it():
    from collections import Counter

    from benchmarks import cpu_samples as C

    def record(f: int, g: int) -> dict:
        return {"samples": f + g, "interval_s": 0.002, "self": Counter({"f": f, "g": g}),
                "inclusive": Counter({"f": f})}

    # Idle runs 0, 2, 4; capture runs 1 and 3 spend 10 and 20 more samples in g alone.
    samples = {0: record(100, 10), 1: record(100, 20), 2: record(100, 10), 3: record(100, 30),
               4: record(100, 10)}
    out = C.compare(samples, [(1, [0, 2]), (3, [2, 4]), (5, [4, 6])], top=1)
    assert out["pairs"] == 2  # run 5 was never sampled
    assert out["all"]["ms"] == 30.0 and out["all"]["ci95"][0] < 30.0 < out["all"]["ci95"][1]
    assert out["beside_ms"] == 220.0
    (g,) = out["self"]
    assert g["function"] == "g" and g["ms"] == 30.0
    # g holds 10 of every 110 samples beside: a CPU 30 ms slower overall would add 2.7 ms there.
    assert g["share_beside"] == round(10 / 110, 4)
    assert g["if_proportional_ms"] == round(10 / 110 * 30.0, 3)
    assert out["inclusive"][0]["function"] == "f" and out["inclusive"][0]["ms"] == 0.0
    assert C.compare(samples, [(7, [8])]) is None
    # The largest difference either way first: run 0 against runs 1 and 3 spends 15 fewer in g.
    (g,) = C.compare(samples, [(0, [1, 3])], top=1)["self"]
    assert g["function"] == "g" and g["ms"] == -30.0
    lines = C.table(out)
    assert lines[0].startswith("all +30.0 ms (") and lines[0].endswith("of 220 ms beside (2 pairs)")
    assert lines[1].startswith("g: +30.0 ms (") and "9.1% of the samples beside" in lines[1]
    assert lines[1].endswith("(in proportion +2.7 ms)") and C.table(None) == []
    # With each label's CPU time, a sample counts that over its samples (4 ms here: the tick),
    # not the interval asked.
    timed = {k: {**r, "cpu_s": 0.004 * r["samples"]} for k, r in samples.items()}
    out = C.compare(timed, [(1, [0, 2]), (3, [2, 4])], top=1)
    assert out["all"]["ms"] == 60.0 and out["beside_ms"] == 440.0
    assert out["self"][0]["ms"] == 60.0
    assert C.ms_per_sample({"samples": 10, "interval_s": 0.001, "cpu_s": 0.05}) == 5.0
    assert C.ms_per_sample({"samples": 10, "interval_s": 0.001, "cpu_s": None}) == 1.0


# ---- host_cpu: what the host's CPUs are --------------------------------------------------------

def test_host_cpu_reads_the_first_cpus_identity_every_cpus_mhz_and_the_last_cache(tmp_path):
    from benchmarks import host_cpu

    def cpu(n: int, mhz: float) -> str:
        return (f"processor\t: {n}\nmodel name\t: Intel Xeon Processor\ncpu family\t: 6\n"
                f"model\t\t: 143\nstepping\t: 8\nmicrocode\t: 0x2b0004b1\ncpu MHz\t\t: {mhz}\n"
                f"cache size\t: 107520 KB\nsiblings\t: 16\ncpu cores\t: 8\n")

    for level, size in ((1, "48K"), (2, "2048K"), (3, "107520K")):
        index = tmp_path / "cpu0" / "cache" / f"index{level}"
        index.mkdir(parents=True)
        (index / "level").write_text(f"{level}\n")
        (index / "size").write_text(f"{size}\n")
    out = host_cpu.describe(cpu(0, 2100.0) + "\n" + cpu(1, 3000.5) + "\n", tmp_path)
    assert {k: out[k] for k in ("model", "family", "model_number", "stepping", "cache")} == {
        "model": "Intel Xeon Processor", "family": "6", "model_number": "143", "stepping": "8",
        "cache": "107520 KB"}
    assert out["threads_per_core"] == 2 and out["last_level_cache"] == "L3 107520K"
    assert out["mhz"] == {"mean": 2550, "min": 2100, "max": 3000, "cpus": 2}
    # A host that exposes less: what it has.
    bare = host_cpu.describe("processor\t: 0\nmodel name\t: AMD EPYC\n", tmp_path / "none")
    assert bare["model"] == "AMD EPYC" and "mhz" not in bare and "last_level_cache" not in bare


def test_host_cpu_reads_the_transparent_huge_page_mode(tmp_path):
    from benchmarks import host_cpu

    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    assert host_cpu.thp_mode(enabled) == "madvise"
    enabled.write_text("[always] madvise never\n")
    assert host_cpu.thp_mode(enabled) == "always"
    assert host_cpu.thp_mode(tmp_path / "absent") is None


def test_client_copies_times_both_copies_with_and_without_huge_pages(monkeypatch, capsys):
    import json

    from benchmarks import client_copies
    import vllm_capture.host_pages as host_pages

    threshold = host_pages.MIN_BYTES
    monkeypatch.setattr(sys, "argv", ["client_copies.py", "--rows", "300", "--layers", "2",
                                      "--width", "16", "--batches", "2", "--reps", "2"])
    assert client_copies.main() == 0
    out = json.loads(capsys.readouterr().out)
    assert {"group_rows_huge", "group_rows_small", "concat_huge", "concat_small"} <= set(out)
    assert host_pages.MIN_BYTES == threshold  # the module's threshold is given back


def test_profile_step_reads_each_labelled_engine_iteration_apart():
    """A stand-in engine core that multiplies matrices on its second call and adds on the others;
    after one call the counter is set back to 0 and three are profiled (torch's profiler, CPU):
    ``first_iterations`` finds each labelled step, the products in iteration 0 (the second
    call) only, each iteration's calls within its own time, and every op's calls."""
    from types import SimpleNamespace

    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import profile_step as P

    a = torch.randn(384, 384)

    class Core:
        def __init__(self):
            self.calls = 0

        def step_fn(self):
            self.calls += 1
            if self.calls % 3 == 2:
                for _ in range(4):
                    torch.mm(a, a)
            else:
                torch.add(a, 1.0)
            return self.calls

    core = Core()
    counter = P.label_iterations(core)
    assert core.step_fn() == 1 and counter == [1]
    counter[0] = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        results = [core.step_fn() for _ in range(3)]
    assert results == [2, 3, 4]  # the wrapped step's own results
    # On a GPU the profiler also lists each range as a device-side annotation of the same name,
    # after the host's, on the stream's thread and spanning only its kernels (here its last
    # microsecond): first_iterations must keep the host's.
    events = list(prof.events())
    events += [SimpleNamespace(name=e.name, device_type=DeviceType.CUDA, thread=e.thread + 1000,
                               time_range=SimpleNamespace(start=e.time_range.end - 1,
                                                          end=e.time_range.end),
                               self_cpu_time_total=0.0, device_time_total=0.0)
               for e in events if e.name.startswith(P.ITERATION_LABEL)]
    first = P.first_iterations(events, count=5, top=3)
    assert [it["iteration"] for it in first] == [0, 1, 2]
    mm = [it for it in first if "aten::mm" in it["self_ms"]]
    assert [it["iteration"] for it in mm] == [0]  # calls 2 (k=0), 3, 4: only call 2 multiplies
    assert "aten::add" in first[1]["self_ms"] and "aten::add" in first[2]["self_ms"]
    for it in first:
        assert 0 < sum(it["self_ms"].values()) <= it["ms"] + 1e-3
        assert len(it["longest"]) <= 3 and it["device_ms"] == 0.0
    assert first[0]["longest"][0][0] == "aten::mm"
    assert first[0]["ms"] > max(first[1]["ms"], first[2]["ms"])
    # Every op by name with its calls, beyond the top three: the four products in iteration 0,
    # one add in each of the others, and the top names' ms the same as self_ms's.
    assert first[0]["ops"]["aten::mm"][1] == 4 and "aten::add" not in first[0]["ops"]
    assert first[1]["ops"]["aten::add"][1] == 1 and first[2]["ops"]["aten::add"][1] == 1
    for it in first:
        assert {name: ms for name, (ms, _) in it["ops"].items() if name in it["self_ms"]} == \
            it["self_ms"]


# ---- fused_store_probe: what Inductor generates for a traced store ------------------------------

def test_fused_store_probe_reads_launches_and_stores_from_inductors_code():
    """The probe's reading of Inductor's generated code, on Inductor's own (CPU) output: a
    residual add + RMSNorm compiled with and without a traced store of the sum into a ring of
    its own makes the same launches, and only the store's names ``index_put``."""
    import logging

    import torch

    from benchmarks.fused_store_probe import LAUNCH, GeneratedCode

    h, r = torch.randn(6, 32), torch.randn(6, 32)
    ring, rows = torch.zeros(16, 32), torch.tensor([3, 15, 15, 0, 15, 7])

    def norm(h, r):
        x = h + r
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def norm_storing(h, r):
        ring.index_put_((rows,), h + r)
        return norm(h, r)

    read = {}
    logger = logging.getLogger("torch._inductor")
    for name, fn in (("plain", norm), ("storing", norm_storing)):
        code = GeneratedCode()
        torch._dynamo.reset()
        torch._logging.set_logs(output_code=True)
        logger.addHandler(code)
        try:
            out = torch.compile(fn, fullgraph=True)(h, r)
        finally:
            logger.removeHandler(code)
            torch._logging.set_logs()
        assert torch.allclose(out, norm(h, r), atol=1e-5)
        read[name] = (code.launches, sorted(n for n in code.names if "index_put" in n))
        assert code.modules == 1 and len(code.module_launches[0]) == code.launches
    assert read["plain"][0] >= 1 and read["storing"][0] == read["plain"][0]
    assert read["plain"][1] == [] and read["storing"][1]
    assert torch.equal(ring[[3, 0, 7]], (h + r)[[0, 3, 5]])
    # A custom op Inductor leaves opaque (the capture op) is a launch too; its definition is not.
    call = "    torch.ops.vllm_capture.capture.default(buf3, None, arg7_1)\n"
    assert LAUNCH.findall(call + "def call(args):\n") == ["torch.ops.vllm_capture.capture.default"]
