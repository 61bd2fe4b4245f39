"""Parts of ``tests/gpu/gpu_checks.py`` that run without a GPU: a drain's gather (the check the
GPU's ``verify`` runs on CUDA) and the run-against-run comparison behind ``--identical``."""

import functools
import importlib.util
import json
from argparse import Namespace
from pathlib import Path

import torch


@functools.cache
def _checks():
    path = Path(__file__).parent / "gpu" / "gpu_checks.py"
    spec = importlib.util.spec_from_file_location("gpu_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rows_by_layer, positions, token_ids, offsets):
    return {"layers": rows_by_layer, "offsets": offsets,
            "positions": {k: positions for k in rows_by_layer},
            "token_ids": {k: token_ids for k in rows_by_layer}}


def test_matched_rows_names_each_layer_whose_rows_differ_and_the_first_row():
    matched_rows = _checks().matched_rows
    gen = torch.Generator().manual_seed(0)
    # Two prompts: rows 0-3 (positions 0-3) and rows 4-8 (positions 0-4).
    positions = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4])
    token_ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12, 13])
    offsets = [0, 4, 9]
    a = {layer: torch.randn(9, 6, generator=gen).to(torch.bfloat16) for layer in (0, 1, 2)}
    b = {layer: rows.clone() for layer, rows in a.items()}
    b[1][6, 2] += 1  # layer 1, second prompt, position 2
    b[1][7, 0] += 1
    b[2][2, 5] -= 2  # layer 2, first prompt, position 2

    report = matched_rows(_run(a, positions, token_ids, offsets),
                          _run(b, positions, token_ids, offsets))

    assert report["rows_compared"] == report["rows_total"] == 27
    assert not report["bit_identical"]
    assert report["max_abs_diff"] > 1.5
    assert report["differing_by_layer"] == {
        "1": {"rows": 2, "first": {"prompt": 1, "position": 2}},
        "2": {"rows": 1, "first": {"prompt": 0, "position": 2}},
    }
    run_a = _run(a, positions, token_ids, offsets)
    same = matched_rows(run_a, run_a)
    assert same["bit_identical"] and same["differing_by_layer"] == {}


def test_identical_fails_naming_the_layers_whose_rows_differ():
    checks = _checks()
    positions, token_ids = torch.tensor([0, 1, 2]), torch.tensor([4, 5, 6])
    rows = {0: torch.zeros(3, 4), 1: torch.ones(3, 4)}
    other = {0: rows[0].clone(), 1: rows[1].clone()}
    other[1][2, 3] = 2
    runs = [_run(r, positions, token_ids, [0, 3]) for r in (rows, other)]
    report = {"run_vs_nograph": {"hidden_states": checks.matched_rows(*runs)},
              "run_vs_eager": {"hidden_states": checks.matched_rows(*runs)}}
    fid = {"hidden_states": {"rows_checked": 3, "max_rel_rownorm": 0.0}}

    problems = checks.run_problems({}, report, fid, 0.1, identical=["nograph"])
    assert problems == ["run_vs_nograph hidden_states: not bit-identical (6 of 6 rows compared, "
                        "max abs diff 1.0; layer 1: 1 differing row(s), the first at prompt 0 "
                        "position 2)"]
    same = {"run_vs_nograph": {"hidden_states": checks.matched_rows(runs[0], runs[0])}}
    assert checks.run_problems({}, same, fid, 0.1, identical=["nograph"]) == []


def test_identical_says_whether_the_runs_kernels_could_make_the_difference(monkeypatch):
    """Runs that record their kernel mode: both on vLLM's defaults, the failure says those can
    round apart between engine starts; in different modes, it says so; both batch-invariant (or
    either mode unknown, a run saved before the mode was), nothing more. A run records the mode
    as vLLM reads the variable."""
    checks = _checks()
    positions, token_ids = torch.tensor([0, 1]), torch.tensor([4, 5])
    runs = [_run({0: torch.full((2, 3), v)}, positions, token_ids, [0, 2]) for v in (0.0, 1.0)]
    fid = {"hidden_states": {"rows_checked": 2, "max_rel_rownorm": 0.0}}

    def problem(this, other):
        report = {"run_vs_graph": {"hidden_states": checks.matched_rows(*runs)},
                  "graph": {} if other is None else {"batch_invariant": other}}
        graph = {} if this is None else {"batch_invariant": this}
        (only,) = checks.run_problems(graph, report, fid, 0.1, identical=["graph"])
        assert only.startswith("run_vs_graph hidden_states: not bit-identical (2 of 2 rows")
        return only

    assert problem(False, False).endswith(
        "both on vLLM's default kernels, which can round a bf16 step apart from one engine "
        "start to another: compare under VLLM_BATCH_INVARIANT=1")
    assert problem(True, False).endswith(
        "; the runs differ in VLLM_BATCH_INVARIANT (1 here, 0 there)")
    for modes in ((True, True), (None, False), (False, None)):
        assert problem(*modes).endswith("position 0)")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert checks.batch_invariant() is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert checks.batch_invariant() is False
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert checks.batch_invariant() is False


def test_matched_rows_stops_a_prompt_at_its_first_label_that_differs():
    """Greedy decoding can pick another token once numerics differ: rows from there on are not
    compared, and a difference past that point is not reported."""
    matched_rows = _checks().matched_rows
    positions = torch.tensor([0, 1, 2, 3])
    rows = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    other_rows = rows.clone()
    other_rows[3] += 1  # past the label that differs
    other_tokens = torch.tensor([1, 2, 9, 4])
    report = matched_rows(_run({0: rows}, positions, torch.tensor([1, 2, 3, 4]), [0, 4]),
                          _run({0: other_rows}, positions, other_tokens, [0, 4]))
    assert (report["rows_compared"], report["rows_total"]) == (2, 4)
    assert report["bit_identical"] and report["differing_by_layer"] == {}


def test_a_drain_gathers_pending_rows_in_the_given_order(tmp_path):
    """``CaptureGraphState.drain`` with an order, an enabled subset and rows past the ring's
    start, against the rows picked on the host: the check the GPU's ``verify`` runs on CUDA."""
    report = tmp_path / "drain_order.json"
    _checks().drain_order_check(Namespace(device="cpu", report=str(report)))
    cases = json.loads(report.read_text())["cases"]
    assert len(cases) == 6 and all(c["ok"] for c in cases)
    assert [c["direct"] for c in cases].count(True) == 2
