"""``vllm-capture extract / inspect / demo`` on a real (CPU) vLLM engine with the tiny Llama.

One engine serves the whole module (start-up is about a minute on CPU); ``main()`` receives it
through ``llm_factory``. Bad-input tests pass a factory that fails if called: they must be
rejected before any engine starts, and write nothing.

``vllm-capture demo`` also runs as a subprocess, the console entry point ``make demo`` uses (it
starts its own engine: under a minute more).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.engine_support import shutdown_llm
from vllm_capture import tiny_models
from vllm_capture.cli import DEMO_ENGINE, UsageError, extract, main
from vllm_capture.dataset import DatasetError, load_dataset
from vllm_capture.selection import SelectSpec

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "one two three",
    "red green blue yellow black white orange purple",
    "monday tuesday wednesday",
    "north south east west up down left right",
    "a capture of hidden states from every layer of the model",
    "router logits choose which experts see each token",
    "seven eight nine ten",
    "chunked prefill spreads a long prompt over several steps",
    "the ring buffer is drained after every step without blocking",
]
OWN_SELECT = {"prompt_positions": [0, 1]}  # prompt 3's own selection
COMPONENTS = ["hidden_states", "attention_heads"]
MAX_TOKENS = 3
BATCH = 4


def no_engine(*args, **kwargs):
    raise AssertionError("the engine must not start for this input")


@pytest.fixture(scope="module")
def tiny(tiny_model, tiny_dir):
    mp = pytest.MonkeyPatch()
    # `demo` builds tiny_models.build("llama"): point it at the folder the engine loads.
    mp.setenv("VLLM_CAPTURE_TINY_DIR", str(tiny_dir))
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    path = tiny_model("llama")
    assert tiny_models.build("llama") == path
    yield path
    mp.undo()


@pytest.fixture(scope="module")
def llm(tiny):
    import vllm_capture as vc
    from vllm import envs

    # The bit-identity checks compare runs of the same batches, so each batch must be scheduled
    # the same way every time. With the engine core in its own process, generate() sends its
    # requests one by one and the core may start a step before the rest arrive (a 4-prompt
    # batch prefilled as [9] then [3, 8, 3] tokens, or [9, 3] then [8, 3]); other GEMM row
    # counts round float32 differently. In-process, generate() queues every request first.
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.setattr(torch, "set_num_threads", torch.set_num_threads)  # the in-process worker replaces it
    engine = vc.LLM(str(tiny), capture_components=tuple(COMPONENTS), **DEMO_ENGINE)
    yield engine
    shutdown_llm(engine)
    del engine
    gc.collect()
    mp.undo()
    envs.disable_envs_cache()  # the in-process engine core froze vLLM's env vars in this process


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    with open(path, "w") as f:
        for i, text in enumerate(PROMPTS):
            rec = {"id": f"p{i}", "prompt": text}
            if i == 3:
                rec["select"] = OWN_SELECT
            f.write(json.dumps(rec) + "\n")
    return path


def extract_args(tiny, prompts_file, out, *extra):
    return ["extract", str(tiny), str(prompts_file), "--out", str(out),
            "--components", ",".join(COMPONENTS), "--select", "all",
            "--max-tokens", str(MAX_TOKENS), "--batch-size", str(BATCH), "--shard-rows", "40",
            "--dtype", "float32", *extra]


class Factory:
    def __init__(self, llm):
        self.llm, self.calls = llm, []

    def __call__(self, model, components, options):
        self.calls.append((model, list(components), dict(options)))
        return self.llm


@pytest.fixture(scope="module")
def full_run(llm, tiny, prompts_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "full"
    factory = Factory(llm)
    assert main(extract_args(tiny, prompts_file, out), llm_factory=factory) == 0
    assert factory.calls == [(str(tiny), COMPONENTS, {"dtype": "float32"})]
    return out


def reference(llm, stream, **kwargs):
    from vllm_capture.api import capture_batches

    selects = [OWN_SELECT if i == 3 else None for i in range(len(PROMPTS))]
    return list(capture_batches(llm, PROMPTS, batch_size=BATCH, stream=stream,
                                max_tokens=MAX_TOKENS, select=SelectSpec.all(),
                                per_prompt_selects=selects, **kwargs))


@pytest.mark.engine
def test_extract_matches_in_memory_capture(llm, full_run):
    ds = load_dataset(full_run, verify=True)
    assert ds.complete and len(ds.shards) > 1
    assert ds.prompt_ids == [f"p{i}" for i in range(len(PROMPTS))]
    assert ds.components == COMPONENTS and ds.layers("hidden_states") == [0, 1, 2, 3]
    assert ds.layout("attention_heads", 0) == {"width": 128, "num_heads": 4, "head_size": 32}
    for stream in COMPONENTS:
        batches = reference(llm, stream)
        lab = ds.labels(stream)
        want_pos = torch.cat([b.meta(0).positions for b in batches]).numpy()
        want_tok = torch.cat([b.meta(0).token_ids for b in batches]).numpy()
        want_idx = np.concatenate([np.repeat(np.arange(k * BATCH, k * BATCH + len(b.offsets) - 1),
                                             np.diff(b.offsets)) for k, b in enumerate(batches)])
        assert np.array_equal(lab["position"], want_pos)
        assert np.array_equal(lab["token_id"], want_tok)
        assert np.array_equal(lab["prompt_index"], want_idx)
        assert np.array_equal(lab["request_id"], want_idx)
        for layer in range(4):
            want = torch.cat([b.layers[layer] for b in batches])
            got = ds.rows(stream, layer)
            assert got.dtype == want.dtype and torch.equal(got, want)  # bit-identical
        # Prompt 5 is the second prompt of the second batch; prompt 3 has its own selection.
        assert torch.equal(ds.rows(stream, 2, prompt="p5"), batches[1].sample_rows(1, 2))
        assert ds.labels(stream, prompt=3)["position"].tolist() == [0, 1]
        lengths = [len(o.prompt_token_ids) for b in batches for o in b.outputs]
        assert ds.prompt_lengths.tolist() == lengths
        gen = ds.labels(stream, prompt=0)["position"]
        assert (gen >= lengths[0]).sum() == MAX_TOKENS - 1
    m = ds.manifest
    assert m["rows"]["hidden_states"] == len(ds) > 0
    assert m["selection"]["mode"] == "all" and m["max_tokens"] == MAX_TOKENS
    assert m["versions"]["vllm"].startswith("0.26")
    assert m["versions"]["torch"] == torch.__version__


@pytest.mark.engine
def test_last_selection_bf16_matches_capture(llm, tiny, tmp_path):
    from vllm_capture.api import capture

    txt = tmp_path / "p.txt"
    txt.write_text("\n".join(PROMPTS) + "\n\n")
    out = tmp_path / "last"
    argv = ["extract", str(tiny), str(txt), "-o", str(out), "--layers", "1,-1",
            "--storage-dtype", "bf16", "--batch-size", "16", "--dtype", "float32", "--no-progress"]
    assert main(argv, llm_factory=Factory(llm)) == 0
    res = capture(llm, PROMPTS, select=SelectSpec(prompt_positions=(-1,)), dtype="bfloat16",
                  layers=[1, 3])
    ds = load_dataset(out)
    assert ds.layers("hidden_states") == [1, 3] and ds.dtype == torch.bfloat16
    assert len(ds) == len(PROMPTS)
    for layer in (1, 3):
        assert torch.equal(ds.rows("hidden_states", layer), res.layers[layer])
    assert ds.labels()["position"].tolist() == res.meta(1).positions.tolist()
    assert ds.prompt_ids == [str(i) for i in range(len(PROMPTS))]


@pytest.mark.engine
def test_resume_after_interruption(llm, tiny, prompts_file, full_run, tmp_path, capsys):
    from vllm_capture.cli import load_prompts

    out = tmp_path / "resumed"

    class Stop(Exception):
        pass

    def stop(entry):
        raise Stop(entry["file"])

    with pytest.raises(Stop):
        extract(llm, load_prompts(prompts_file), out, model=str(tiny), components=COMPONENTS,
                select="all", max_tokens=MAX_TOKENS, batch_size=BATCH, shard_rows=40,
                engine_options={"dtype": "float32"}, progress=False, on_shard=stop)
    part = load_dataset(out)
    assert not part.complete and len(part.shards) == 1
    (out / ".shard-00001.safetensors.tmp-1").write_bytes(b"partial")
    capsys.readouterr()
    assert main(extract_args(tiny, prompts_file, out), llm_factory=Factory(llm)) == 0
    assert "resuming after prompt" in capsys.readouterr().err
    a, b = load_dataset(full_run), load_dataset(out, verify=True)
    assert b.complete and [s["prompt_end"] for s in a.shards] == [s["prompt_end"] for s in b.shards]
    for stream in COMPONENTS:
        la, lb = a.labels(stream), b.labels(stream)
        for col in la:
            assert np.array_equal(la[col], lb[col])
        assert len(set(zip(lb["prompt_index"].tolist(), lb["position"].tolist()))) == len(b)
        for layer in range(4):
            assert torch.equal(a.rows(stream, layer), b.rows(stream, layer))
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.engine
def test_rerun_of_finished_run_does_nothing(tiny, prompts_file, full_run, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in full_run.iterdir()}
    assert main(extract_args(tiny, prompts_file, full_run), llm_factory=no_engine) == 0
    assert "already complete" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in full_run.iterdir()} == before


@pytest.mark.engine
def test_folder_of_a_different_run_is_refused(tiny, prompts_file, full_run, capsys):
    before = (full_run / "manifest.json").read_bytes()
    capsys.readouterr()
    rc = main(extract_args(tiny, prompts_file, full_run, "--layers", "0"), llm_factory=no_engine)
    err = capsys.readouterr().err
    assert rc == 2 and "different run (differs in: layers)" in err and err.count("\n") == 1
    assert (full_run / "manifest.json").read_bytes() == before


@pytest.mark.engine
def test_unknown_layer_found_by_the_engine(llm, tmp_path):
    # A model name with no readable config: the engine's layer list decides, before writing.
    out = tmp_path / "x"
    with pytest.raises(UsageError, match=r"unknown layer\(s\) \[9\].*0\.\.3"):
        extract(llm, ["one two"], out, model="some-org/some-model", layers=[9], progress=False)
    assert not out.exists()


@pytest.mark.engine
def test_inspect_summary_and_plot(full_run, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plots" / "norms.png"
    assert main(["inspect", str(full_run), "--plot", str(png), "--verify"]) == 0
    text = capsys.readouterr().out
    n = len(load_dataset(full_run))
    assert f"hidden_states: {n} rows x 4 layers" in text
    assert "sha256 verified" in text and "complete: 10/10 prompts" in text
    assert "mean |x|" in text and "(4 heads x 32)" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    # Without a suffix the file gets .png, and the message names it.
    assert main(["inspect", str(full_run), "--no-stats", "--plot", str(tmp_path / "bare")]) == 0
    assert f"plot written to {tmp_path / 'bare.png'}" in capsys.readouterr().out
    assert (tmp_path / "bare.png").stat().st_size > 5000
    afile = tmp_path / "afile"
    afile.write_text("x")
    for target, message in [(tmp_path / "x.txt", "--plot: cannot write a '.txt' file; use one of"),
                            (afile / "p.png", f"--plot: cannot write {afile / 'p.png'}: ")]:
        assert main(["inspect", str(full_run), "--no-stats", "--plot", str(target)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"vllm-capture: error: {message}") and err.count("\n") == 1, err


@pytest.mark.engine
def test_tampered_shard_fails_verification(full_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(full_run, copy)
    shard = copy / load_dataset(copy).shards[-1]["file"]
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0x40
    shard.write_bytes(bytes(data))
    assert load_dataset(copy).rows("hidden_states", 0).shape[0] > 0  # lazy open does not hash
    with pytest.raises(DatasetError, match="sha256"):
        load_dataset(copy, verify=True)
    capsys.readouterr()
    assert main(["inspect", str(copy), "--verify"]) == 2
    assert "sha256" in capsys.readouterr().err


@pytest.mark.engine
def test_demo_with_injected_engine(llm, tiny, tmp_path, capsys):
    out = tmp_path / "demo"
    factory = Factory(llm)
    assert main(["demo", "--out", str(out), "--no-progress"], llm_factory=factory) == 0
    assert factory.calls and factory.calls[0][0] == str(tiny)
    text = capsys.readouterr().out
    ds = load_dataset(out, verify=True)
    assert ds.num_prompts == 16 and len(ds.shards) > 1
    assert f"hidden_states: {len(ds)} rows x 4 layers" in text
    assert "attention_heads" in text and "generated" in text
    # A second demo run finds the finished dataset and starts no engine.
    assert main(["demo", "--out", str(out), "--no-progress"], llm_factory=no_engine) == 0


@pytest.mark.engine
def test_prompt_longer_than_max_model_len_is_refused_before_writing(llm, tiny, tmp_path, capsys):
    txt = _write(tmp_path / "p.txt", "one two three\n\n" + " ".join(["red"] * 300) + "\n")
    out = tmp_path / "ds"
    capsys.readouterr()
    rc = main(["extract", str(tiny), str(txt), "--out", str(out), "--dtype", "float32",
               "--no-progress"], llm_factory=Factory(llm))
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "prompt '1' (line 3) has 300 tokens" in err
    assert "max_model_len 256 allows at most 255" in err
    assert not out.exists()


@pytest.mark.engine
def test_demo_subprocess(tmp_path):
    """`vllm-capture demo`, the console entry point `make demo` runs, in a process of its own."""
    exe = Path(sys.executable).with_name("vllm-capture")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "vllm_capture.cli"]
    proc = subprocess.run([*cmd, "demo", "--out", str(tmp_path / "demo"), "--no-progress"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_CAPTURE_TINY_DIR": str(tmp_path / "tiny")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "hidden_states:" in proc.stdout and "rows" in proc.stdout


# ---- bad input: exit code 2, one line on stderr, no engine, nothing written ---------------------

def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


BAD_INPUTS = {
    "missing prompts file": (lambda d: ["{model}", str(d / "nope.txt")], "prompts file not found"),
    "empty prompts file": (lambda d: ["{model}", str(_write(d / "e.txt", "\n  \n"))],
                           "holds no prompts"),
    "bad extension": (lambda d: ["{model}", str(_write(d / "p.csv", "a\n"))], ".txt"),
    "malformed jsonl": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a"}\n\n{"prompt": "b",}\n'))], "p.jsonl:3: malformed JSON"),
    "jsonl without prompt": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a"}\n{"text": "b"}\n'))], 'p.jsonl:2: missing "prompt"'),
    "jsonl bad select": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a", "select": {"prompt_positions": []}}\n'))],
        'p.jsonl:1: invalid "select"'),
    "jsonl duplicate id": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a", "id": 1}\n{"prompt": "b", "id": "1"}\n'))],
        "p.jsonl:2: duplicate prompt id '1'"),
    "unknown layer": (lambda d: ["{model}", "{txt}", "--layers", "2,4"], r"unknown layer(s) [4]"),
    "bad layer syntax": (lambda d: ["{model}", "{txt}", "--layers", "x"], "--layers: cannot parse"),
    "layer with an underscore": (lambda d: ["{model}", "{txt}", "--layers", "1_0"],
                                 "--layers: cannot parse '1_0'"),
    "negative layers after -l": (lambda d: ["{model}", "{txt}", "-l", "-9,-1"],
                                 "unknown layer(s) [-9]"),
    "unknown component": (lambda d: ["{model}", "{txt}", "-c", "hidden_states,mlp"],
                          "unknown component 'mlp'"),
    "router on a dense model": (lambda d: ["{model}", "{txt}", "-c", "router_logits"],
                                "not a mixture-of-experts model"),
    "selection selects nothing": (lambda d: ["{model}", "{txt}", "--select", "{}"],
                                  "selects nothing"),
    "invalid selection json": (lambda d: ["{model}", "{txt}", "--select", "{prompt: all}"],
                               "invalid JSON"),
    "invalid selection field": (lambda d: ["{model}", "{txt}", "--select", '{"prompts": "all"}'],
                                "unknown keys ['prompts']"),
    "selection int past int64": (
        lambda d: ["{model}", "{txt}", "--select", '{"prompt_positions": [99999999999999999999]}'],
        "prompt_positions: 99999999999999999999 is out of range"),
    "generation rows without generation": (
        lambda d: ["{model}", "{txt}", "--select", '{"generation": "all"}'], "feeds none"),
    "per-prompt generation select without generation": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a", "select": {"generation_positions": [0]}}\n'))],
        "line 1) select"),
    "generation position past the generated rows": (
        lambda d: ["{model}", "{txt}", "--select", '{"generation_positions": [5]}',
                   "--max-tokens", "3"], "no decode step that max_tokens=3 feeds"),
    "per-prompt generation window past the generated rows": (lambda d: ["{model}", str(_write(
        d / "p.jsonl", '{"prompt": "a", "select": {"generation_window": [4, null]}}\n')),
        "--max-tokens", "3"], "line 1) select: selects generated rows only, but no decode step"),
    "missing model folder": (lambda d: [str(d / "no-model"), "{txt}"], "model not found"),
    "bad storage dtype": (lambda d: ["{model}", "{txt}", "--storage-dtype", "int8"],
                          "--storage-dtype"),
    "bad batch size": (lambda d: ["{model}", "{txt}", "--batch-size", "0"], "--batch-size"),
    "bad engine dtype": (lambda d: ["{model}", "{txt}", "--dtype", "fp8"],
                         "--dtype: expected one of auto, half, float16, bfloat16, float, float32, "
                         "got 'fp8'"),
    "bad capture buffer": (lambda d: ["{model}", "{txt}", "--capture-buffer-bytes", "-1"],
                           "--capture-buffer-bytes"),
    "foreign output folder": (lambda d: ["{model}", "{txt}", "--out", str(_foreign(d))],
                              "not empty"),
    "output folder under a file": (lambda d: ["{model}", "{txt}", "--out", str(
        _write(d / "afile", "x") / "sub" / "ds")], "afile is a file, not a folder"),
    "output folder that cannot be created": (
        lambda d: ["{model}", "{txt}", "--out", "/proc/vllm-capture-test/ds"],
        "cannot create /proc/vllm-capture-test/ds"),
}


def test_engine_arguments_vllm_refuses_are_one_line_exit_2(tiny, tmp_path, capsys):
    """vLLM checks some engine arguments only as the engine is built (a max_model_len past the
    model's, in pydantic): a usage error, not a traceback."""
    def refusing_factory(model, components, engine_options):
        raise ValueError("1 validation error for ModelConfig\n  Value error, User-specified "
                         "max_model_len (100000) is greater than the derived max_model_len")

    txt = _write(tmp_path / "ok.txt", "one two three\n")
    rc = main(["extract", str(tiny), str(txt), "--out", str(tmp_path / "out"),
               "--max-model-len", "100000"], llm_factory=refusing_factory)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("vllm-capture: error: the engine refused its arguments: 1 validation "
                          "error for ModelConfig Value error, User-specified max_model_len "
                          "(100000)"), err


def _foreign(d: Path) -> Path:
    folder = d / "foreign"
    folder.mkdir(exist_ok=True)
    (folder / "mine.txt").write_text("not a dataset")
    return folder


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(case, tiny, tmp_path, capsys):
    build, message = BAD_INPUTS[case]
    txt = _write(tmp_path / "ok.txt", "one two three\n")
    args = [a.replace("{model}", str(tiny)).replace("{txt}", str(txt)) for a in build(tmp_path)]
    out = tmp_path / "out"
    if "--out" not in args:
        args += ["--out", str(out)]
    before = sorted(p.name for p in tmp_path.rglob("*"))
    capsys.readouterr()
    rc = main(["extract", *args], llm_factory=no_engine)
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("vllm-capture: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert not out.exists()


def test_a_folder_another_run_holds_is_refused_before_the_engine_starts(tiny, prompts_file,
                                                                        tmp_path, capsys):
    import fcntl

    out = tmp_path / "ds"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)  # another run's hold on the folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        capsys.readouterr()
        assert main(extract_args(tiny, prompts_file, out), llm_factory=no_engine) == 2
        assert "another extract run is writing into" in capsys.readouterr().err
    finally:
        os.close(fd)
    assert out.is_dir() and not any(out.iterdir())


def test_engine_options_reach_the_engine(tiny, prompts_file, tmp_path):
    seen = {}

    def factory(model, components, engine_options):
        seen.update(engine_options)
        raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        main(["extract", str(tiny), str(prompts_file), "-o", str(tmp_path / "ds"), "--no-progress",
              "--load-format", "dummy", "--max-num-seqs", "8", "--enforce-eager",
              "--capture-buffer-bytes", "1048576"],
             llm_factory=factory)
    assert seen == {"load_format": "dummy", "max_num_seqs": 8, "enforce_eager": True,
                    "capture_buffer_bytes": 1 << 20}


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["extract", "model-only"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "required" in err
    assert main(["inspect", "/nonexistent/dataset"]) == 2
    assert "no such dataset folder" in capsys.readouterr().err
