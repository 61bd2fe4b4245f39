"""The dataset format and loader, and the extractor's sharding/resume logic, without an engine.

``vllm_capture.api.capture`` / ``capture_status`` are replaced by a deterministic fake, so these
tests exercise exactly the code paths ``vllm-capture extract`` uses (extract(), the shard writer,
the manifest, resume) in milliseconds. tests/test_cli.py runs the same paths on a real engine.
"""

from __future__ import annotations

import json
import shutil
import threading
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_capture import api, cli
from vllm_capture.cli import Prompt, UsageError, extract, load_prompts, main
from vllm_capture.dataset import DatasetError, load_dataset
from vllm_capture.selection import SelectSpec
from vllm_capture.session.wire import CaptureMeta

WIDTH = {"hidden_states": 8, "attention_heads": 6}
NUM_LAYERS = 3
PROMPTS = [
    "the quick brown fox",
    "one two three four five six",
    "red green",
    "a b c d e f g h i j k",
    "north south east west",
    "x",
    "monday tuesday wednesday",
    "chunked prefill spreads a long prompt over several steps",
    "up down",
    "left right left right left",
]


def _token(word: str) -> int:
    return zlib.crc32(word.encode()) % 500


def expected_row(text: str, position: int, layer: int, component: str) -> torch.Tensor:
    width = WIDTH[component]
    base = float(zlib.crc32(text.encode()) % 997)
    comp = 1000.0 * (list(WIDTH).index(component) + 1)
    return (torch.arange(width, dtype=torch.float32) * 1e-3 + base + position * 0.5
            + layer * 100.0 + comp)


class FakeTokenizer:
    """One token per word, like fake_capture."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[_token(w) for w in text.split()] for text in texts]}


class FakeEngine:
    """Stands in for the engine: records which prompts each capture() call saw."""

    def __init__(self, max_model_len: int = 1024):
        self.calls: list[tuple[str, list[str]]] = []
        self.model_config = SimpleNamespace(max_model_len=max_model_len)

    def get_tokenizer(self):
        return FakeTokenizer()


def fake_capture(llm, prompts, *, stream, max_tokens=1, layers=None, dtype=None, select=None,
                 per_prompt_selects=None, **_):
    llm.calls.append((stream, list(prompts)))
    spec = SelectSpec.from_wire(select) if isinstance(select, dict) else select
    layers = list(layers) if layers is not None else list(range(NUM_LAYERS))
    rows = {layer: [] for layer in layers}
    positions, tokens, req_ids, offsets, outputs = [], [], [], [0], []
    for i, text in enumerate(prompts):
        own = per_prompt_selects[i] if per_prompt_selects else None
        s = SelectSpec.from_wire(own) if isinstance(own, dict) else (own or spec)
        toks = [_token(w) for w in text.split()]
        plen = len(toks)
        pos = list(s.selected_prompt_positions(plen, toks)) if s.covers_prompt else []
        if s.covers_generation:
            for g in range(max_tokens - 1):
                tok = _token(f"gen{g}")
                if s.match_generation([g], [tok]).keep[0]:
                    pos.append(plen + g)
                toks.append(tok)
        for p in pos:
            positions.append(p)
            tokens.append(toks[p])
            req_ids.append(f"{i}-0000000a")
            for layer in layers:
                rows[layer].append(expected_row(text, p, layer, stream))
        offsets.append(len(positions))
        outputs.append(SimpleNamespace(request_id=str(i), prompt_token_ids=toks[:plen]))
    tensors, meta = {}, {}
    for layer in layers:
        t = (torch.stack(rows[layer]) if rows[layer]
             else torch.empty((0, WIDTH[stream]), dtype=torch.float32))
        if dtype is not None:
            t = t.to(getattr(torch, dtype))
        tensors[layer] = t
        meta[layer] = CaptureMeta(list(req_ids), torch.tensor(positions, dtype=torch.int32),
                                  torch.tensor(tokens, dtype=torch.int32))
    layouts = {layer: {"width": WIDTH[stream]} for layer in layers}
    return api.CaptureResult(tensors, outputs, layouts, stream, meta, offsets)


def fake_status(llm, stream="hidden_states"):
    if stream not in WIDTH:
        return {"layouts": {}}
    return {"layouts": {layer: {"width": WIDTH[stream]} for layer in range(NUM_LAYERS)}}


def streams_through_capture(llm, prompts, layers, **kwargs):
    """``capture_streams`` as one fake ``capture()`` a stream, whichever ``api.capture`` is."""
    return {c: api.capture(llm, prompts, stream=c, layers=stream_layers, **kwargs)
            for c, stream_layers in layers.items()}


@pytest.fixture(autouse=True)
def fake_engine_api(monkeypatch):
    monkeypatch.setattr(api, "capture", fake_capture)
    monkeypatch.setattr(api, "capture_streams", streams_through_capture)
    monkeypatch.setattr(api, "capture_status", fake_status)


def run(out, engine=None, **kwargs):
    opts = dict(model="fake-model", components=["hidden_states", "attention_heads"],
                select="all", max_tokens=3, batch_size=3, shard_rows=20, progress=False)
    opts.update(kwargs)
    prompts = opts.pop("prompts", PROMPTS)
    return extract(engine or FakeEngine(), prompts, out, **opts)


def expected_positions(text: str, max_tokens: int = 3) -> list[int]:
    n = len(text.split())
    return list(range(n + max_tokens - 1))


def test_roundtrip_rows_labels_and_manifest(tmp_path):
    out = tmp_path / "ds"
    summary = run(out)
    assert summary["prompts"] == len(PROMPTS)
    ds = load_dataset(out, verify=True)
    assert summary["rows"] == ds.num_rows("hidden_states")  # positions, once for all components
    m = ds.manifest
    assert ds.complete and m["complete"]
    assert ds.components == ["hidden_states", "attention_heads"]
    assert ds.layers("hidden_states") == [0, 1, 2]
    assert ds.layout("attention_heads", 1) == {"width": 6}
    assert ds.dtype == torch.float32
    assert len(ds.shards) > 1  # shard_rows=20 splits the corpus
    assert [s["prompt_start"] for s in ds.shards][0] == 0
    for a, b in zip(ds.shards, ds.shards[1:]):
        assert a["prompt_end"] == b["prompt_start"]
    assert ds.shards[-1]["prompt_end"] == len(PROMPTS)
    assert set(m["versions"]) == {"vllm", "torch", "vllm_capture"}
    assert all(len(s["sha256"]) == 64 for s in ds.shards)
    total = sum(len(expected_positions(t)) for t in PROMPTS)
    assert len(ds) == ds.num_rows("attention_heads") == total == m["rows"]["hidden_states"]
    assert ds.prompt_ids == [str(i) for i in range(len(PROMPTS))]
    assert ds.prompts[3]["prompt"] == PROMPTS[3]
    assert ds.prompt_lengths.tolist() == [len(t.split()) for t in PROMPTS]

    labels = ds.labels("hidden_states")
    assert labels["prompt_index"].tolist() == [i for i, t in enumerate(PROMPTS)
                                               for _ in expected_positions(t)]
    assert labels["position"].tolist() == [p for t in PROMPTS for p in expected_positions(t)]
    assert (labels["request_id"] == labels["prompt_index"]).all()
    for comp in ds.components:
        for layer in ds.layers(comp):
            rows = ds.rows(comp, layer)
            want = torch.stack([expected_row(PROMPTS[i], p, layer, comp) for i, p in
                                zip(labels["prompt_index"], labels["position"])])
            assert torch.equal(rows, want)


def test_lazy_access_by_prompt_position_and_id(tmp_path):
    out = tmp_path / "ds"
    run(out)
    ds = load_dataset(out)
    # Prompt 7 lives in one shard; only that shard is opened.
    rows = ds.rows("hidden_states", 2, prompt=7)
    owner = [s["file"] for s in ds.shards if s["prompt_start"] <= 7 < s["prompt_end"]]
    assert list(ds._handles) == owner
    pos = expected_positions(PROMPTS[7])
    assert torch.equal(rows, torch.stack([expected_row(PROMPTS[7], p, 2, "hidden_states")
                                          for p in pos]))
    lab = ds.labels("hidden_states", prompt=7)
    assert lab["position"].tolist() == pos and set(lab["prompt_index"].tolist()) == {7}
    assert lab["token_id"].tolist()[: len(PROMPTS[7].split())] == [
        _token(w) for w in PROMPTS[7].split()]
    # By id, by several prompts, by positions, and both.
    assert torch.equal(ds.rows("hidden_states", 2, prompt="7"), rows)
    both = ds.rows("attention_heads", 0, prompt=[1, 4], positions=[0, 2])
    assert both.shape == (4, WIDTH["attention_heads"])
    assert ds.labels("attention_heads", prompt=[1, 4], positions=[0, 2])["position"].tolist() == \
        [0, 2, 0, 2]
    first = ds.rows("hidden_states", 0, positions=0)
    assert first.shape[0] == len(PROMPTS)
    assert torch.equal(first[5], expected_row(PROMPTS[5], 0, 0, "hidden_states"))
    # Scattered selections across many runs read correctly too.
    evens = ds.labels("hidden_states", positions=range(0, 20, 2))
    got = ds.rows("hidden_states", 1, positions=range(0, 20, 2))
    assert got.shape[0] == len(evens["position"]) > 32
    assert torch.equal(got[-1], expected_row(PROMPTS[int(evens["prompt_index"][-1])],
                                             int(evens["position"][-1]), 1, "hidden_states"))
    assert ds.rows("hidden_states", 0, prompt=5, positions=99).shape == (0, 8)
    # Full passes in bounded memory.
    n = sum(r.shape[0] for r, _ in ds.iter_shards("hidden_states", 0))
    assert n == len(ds)
    with pytest.raises(KeyError, match="layer 7"):
        ds.rows("hidden_states", 7)
    with pytest.raises(KeyError, match="router_logits"):
        ds.rows("router_logits", 0)
    with pytest.raises(KeyError, match="nope"):
        ds.rows("hidden_states", 0, prompt="nope")
    with pytest.raises(IndexError):
        ds.rows("hidden_states", 0, prompt=len(PROMPTS))
    # Nor values that iterate as others: bytes as byte codes, a dict as its keys, nested lists.
    for bad in ([2.7], [True], ["2"], b"\x01\x02", {1: 0}, [[1, 2]], [2 ** 70]):
        with pytest.raises(TypeError, match="^positions: expected an int or an iterable of ints"):
            ds.rows("hidden_states", 0, positions=bad)
    for bad in (1.0, b"\x01\x02", {"doc-1": 0}, torch.tensor(1)):
        with pytest.raises(TypeError, match="^prompt: expected an index"):
            ds.rows("hidden_states", 0, prompt=bad)
    # Any other iterable of indices or ids reads as its list.
    for same in ({1, 3}, (i for i in (3, 1)), np.array([1, 3]), range(1, 4, 2)):
        assert torch.equal(ds.rows("hidden_states", 0, prompt=same),
                           ds.rows("hidden_states", 0, prompt=[1, 3]))
    for bad in (-1, [3, -1]):  # positions are absolute: a negative one would match nothing
        with pytest.raises(ValueError, match="positions: expected values >= 0"):
            ds.rows("hidden_states", 0, positions=bad)
    for bad in (1.9, True, "1"):  # not truncated or coerced to layer 1
        with pytest.raises(TypeError, match="layer: expected an int"):
            ds.rows("hidden_states", bad)


def _rewrite_first_shard(out, name: str, change) -> None:
    """Change one tensor of the first shard and re-hash it, as a writer's bug would have made it:
    the manifest's sizes and hashes agree, so only verify's label checks can see it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vllm_capture.dataset import sha256_file

    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["shards"][0]
    path = out / entry["file"]
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        metadata = f.metadata()
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, str(path), metadata=metadata)
    entry["bytes"], entry["sha256"] = path.stat().st_size, sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("column, change", [
    ("prompt_index", lambda t: t.flip(0)),  # out of order
    ("prompt_index", lambda t: t + 100),  # outside the shard's prompts
    ("request_id", lambda t: t + 1),  # not the prompt index
])
def test_verify_checks_the_prompt_index_and_request_id_columns(tmp_path, column, change):
    out = tmp_path / "ds"
    run(out, prompts=PROMPTS[:4], components=["hidden_states"])
    _rewrite_first_shard(out, f"hidden_states.{column}", change)
    load_dataset(out).close()
    with pytest.raises(DatasetError, match="prompt_index or request_id out of"):
        load_dataset(out, verify=True)


@pytest.mark.parametrize("line, message", [("{not json", "not JSON"),
                                           ('{"id": "a"}', "not a prompt record")])
def test_a_damaged_prompts_file_is_named_with_its_line(tmp_path, line, message):
    out = tmp_path / "ds"
    run(out, prompts=PROMPTS[:2])
    path = out / "prompts.jsonl"
    first, *rest = path.read_text().splitlines()
    path.write_text("\n".join([first, line, *rest[1:]]) + "\n")
    with pytest.raises(DatasetError, match=f"prompts.jsonl:2: {message}"):
        load_dataset(out, verify=True)


def test_verify_detects_tampered_and_missing_shards(tmp_path):
    out = tmp_path / "ds"
    run(out)
    load_dataset(out, verify=True).close()
    shard = out / load_dataset(out).shards[1]["file"]
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01  # one bit of one activation value
    shard.write_bytes(bytes(data))
    ds = load_dataset(out)  # lazy: no hashing unless asked
    with pytest.raises(DatasetError, match="sha256"):
        ds.verify()
    with pytest.raises(DatasetError, match="sha256"):
        load_dataset(out, verify=True)
    shard.unlink()
    with pytest.raises(DatasetError, match="missing"):
        load_dataset(out)


def _drop_middle_shard(m, out):
    del m["shards"][1]


def _drop_last_shard(m, out):
    m["shards"].pop()


def _list_a_shard_twice(m, out):
    m["shards"].insert(2, m["shards"][1])


def _count_a_row_more(m, out):
    m["rows"]["hidden_states"] += 1


def _count_a_shards_row_more(m, out):
    m["shards"][0]["rows"]["hidden_states"] += 1
    m["rows"]["hidden_states"] += 1


def _move_a_shard_boundary(m, out):
    m["shards"][0]["prompt_end"] -= 1
    m["shards"][1]["prompt_start"] -= 1


def _swap_request_ids(m, out):
    ids = m["request_ids"]
    ids[0], ids[1] = ids[1], ids[0]


def _call_it_bf16(m, out):
    m["dtypes"]["hidden_states"] = "bfloat16"


def _narrow_a_layout(m, out):
    m["layouts"]["hidden_states"]["0"]["width"] = 4


def _forget_a_layer(m, out):
    m["layers"]["hidden_states"].remove(2)


def _edit_a_prompt(m, out):
    path = out / "prompts.jsonl"
    path.write_text(path.read_text().replace("red green", "red blue"))


def _delete_the_prompts(m, out):
    (out / "prompts.jsonl").unlink()


@pytest.mark.parametrize("edit, on_load, match", [
    (_drop_middle_shard, True, "a shard is missing"),
    (_drop_last_shard, True, "says it is complete"),
    (_list_a_shard_twice, True, "listed twice"),
    (_count_a_row_more, True, "its shards hold"),
    (_count_a_shards_row_more, False, "hidden_states.layer_0 is float32"),
    (_move_a_shard_boundary, False, "holds prompts"),
    (_swap_request_ids, False, "request_ids"),
    (_call_it_bf16, False, "the manifest says bfloat16"),
    (_narrow_a_layout, False, r"the manifest says float32 \[\d+, 4\]"),
    (_forget_a_layer, False, "does not list"),
    (_edit_a_prompt, False, "prompts_sha256"),
    (_delete_the_prompts, False, "prompts.jsonl is missing"),
])
def test_the_manifest_is_checked_against_its_shards_and_prompts(tmp_path, edit, on_load, match):
    """Shards that hash right are not enough: the manifest and prompts.jsonl that describe them
    must agree with them (cheap checks at load, the rest in verify)."""
    out = tmp_path / "ds"
    run(out)
    load_dataset(out, verify=True).close()
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3
    edit(manifest, out)
    (out / "manifest.json").write_text(json.dumps(manifest))
    if on_load:
        with pytest.raises(DatasetError, match=match):
            load_dataset(out)
    else:
        ds = load_dataset(out)
        with pytest.raises(DatasetError, match=match):
            ds.verify()


def test_prompt_files_split_on_newlines_only(tmp_path):
    """A .txt holds one prompt per line: a form feed or U+2028 inside a prompt is text, a BOM
    and a carriage return before the newline are not."""
    txt = tmp_path / "p.txt"
    txt.write_bytes("\ufefffirst\r\nsecond\fpart\n\nthird\u2028part\n".encode())
    assert [p.text for p in load_prompts(txt)] == ["first", "second\fpart", "third\u2028part"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_bytes(("\ufeff" + json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False)
                       + "\r\n").encode())
    assert [p.text for p in load_prompts(jsonl)] == ["a\u2028b"]


class Interrupt(RuntimeError):
    pass


def relabelled_capture(target: str, column: str, change):
    """fake_capture whose rows of ``target`` carry other labels in ``column`` (a writer's bug)."""

    def capture(llm, prompts, *, stream, **kwargs):
        result = fake_capture(llm, prompts, stream=stream, **kwargs)
        if stream == target:
            for meta in result._meta.values():
                setattr(meta, column, change(getattr(meta, column).clone()))
        return result

    return capture


def _moved_last(positions):
    positions[-1] += 1000
    return positions


@pytest.mark.parametrize("stream, column, change, message", [
    ("attention_heads", "token_ids", lambda t: t + 1, "label columns differ from hidden_states"),
    ("hidden_states", "token_ids", lambda t: t - 10**6, "token_id below 0"),
    ("hidden_states", "positions", lambda t: t.flip(0), "out of order within a prompt"),
    ("hidden_states", "positions", _moved_last, "outside its prompt and generated tokens"),
])
def test_verify_checks_positions_token_ids_and_that_components_agree(tmp_path, monkeypatch,
                                                                     stream, column, change,
                                                                     message):
    monkeypatch.setattr(api, "capture", relabelled_capture(stream, column, change))
    out = tmp_path / "ds"
    run(out, prompts=PROMPTS[:2])
    load_dataset(out).close()  # hashes and sizes agree: only the label checks see it
    with pytest.raises(DatasetError, match=message):
        load_dataset(out, verify=True)


def lossy_capture(lost_prompt: int):
    """fake_capture that loses the first row of one prompt in every component (the components
    still agree), as a writer's bug or a lost row would."""

    def capture(llm, prompts, **kwargs):
        result = fake_capture(llm, prompts, **kwargs)
        if lost_prompt < len(prompts) and result.offsets[lost_prompt + 1] > result.offsets[
                lost_prompt]:
            row = result.offsets[lost_prompt]
            keep = torch.ones(result.offsets[-1], dtype=torch.bool)
            keep[row] = False
            for layer in result.layers:
                result.layers[layer] = result.layers[layer][keep]
                meta = result._meta[layer]
                result._meta[layer] = CaptureMeta(
                    [r for i, r in enumerate(meta.req_ids) if i != row], meta.positions[keep],
                    meta.token_ids[keep])
            result.offsets = [o - (i > lost_prompt) for i, o in enumerate(result.offsets)]
        return result

    return capture


@pytest.mark.parametrize("select, max_tokens", [("all", 3), ("all", 1), ("last", 2)])
def test_verify_finds_a_prompt_that_lost_rows_its_selection_keeps(tmp_path, monkeypatch, select,
                                                                  max_tokens):
    prompts = [Prompt(0, "p0", "one two three"), Prompt(1, "p1", "four five six seven"),
               Prompt(2, "p2", "eight nine", {"prompt_positions": [1]})]
    kept = tmp_path / "kept"
    run(kept, prompts=prompts, select=select, max_tokens=max_tokens)
    load_dataset(kept, verify=True).close()
    # The prompt with a selection of its own is not checked: its rows depend on its tokens.
    monkeypatch.setattr(api, "capture", lossy_capture(2))
    run(tmp_path / "own", prompts=prompts, select=select, max_tokens=max_tokens)
    load_dataset(tmp_path / "own", verify=True).close()
    monkeypatch.setattr(api, "capture", lossy_capture(1))
    out = tmp_path / "lost"
    run(out, prompts=prompts, select=select, max_tokens=max_tokens)
    load_dataset(out).close()  # hashes, sizes and label order agree
    with pytest.raises(DatasetError, match=rf"prompt 1 \(4 tokens\) has rows at positions "
                                           rf".*not what selection '{select}' keeps"):
        load_dataset(out, verify=True)


def test_verify_finds_a_last_row_at_another_position(tmp_path, monkeypatch):
    """One row a prompt, in order and inside the prompt: only `last`'s promise is broken."""
    monkeypatch.setattr(api, "capture", relabelled_capture("hidden_states", "positions",
                                                           lambda t: t * 0))
    out = tmp_path / "ds"
    run(out, prompts=PROMPTS[:2], components=["hidden_states"], select="last")
    load_dataset(out).close()
    with pytest.raises(DatasetError, match=r"prompt 0 \(4 tokens\) has rows at positions \[0\]"):
        load_dataset(out, verify=True)


def test_resume_after_interruption_matches_uninterrupted_run(tmp_path):
    full = tmp_path / "full"
    run(full)
    part = tmp_path / "part"

    def stop_after_first(entry):
        raise Interrupt(entry["file"])

    with pytest.raises(Interrupt):
        run(part, on_shard=stop_after_first)
    ds = load_dataset(part)
    assert not ds.complete and len(ds.shards) == 1
    done = ds.shards[0]["prompt_end"]
    with pytest.raises(IndexError, match="not extracted yet"):
        ds.rows("hidden_states", 0, prompt=done)
    # What a crash can leave behind: a temporary shard and a renamed shard that the manifest
    # never listed. Neither may count, and the rerun must replace them.
    (part / ".shard-00001.safetensors.tmp-999").write_bytes(b"half a shard")
    (part / "shard-00001.safetensors").write_bytes(b"orphan: renamed, not in the manifest")
    assert len(load_dataset(part).shards) == 1

    engine = FakeEngine()
    summary = run(part, engine=engine)
    assert summary["resumed_at"] == done
    seen = [p for _, batch in engine.calls for p in batch]
    assert not set(PROMPTS[:done]) & set(seen)  # finished prompts are not captured again
    a, b = load_dataset(full, verify=True), load_dataset(part, verify=True)
    assert b.complete
    assert not list(part.glob(".*tmp*"))
    for comp in a.components:
        la, lb = a.labels(comp), b.labels(comp)
        for col in la:
            assert np.array_equal(la[col], lb[col]), col
        pairs = list(zip(lb["prompt_index"].tolist(), lb["position"].tolist()))
        assert len(pairs) == len(set(pairs))  # no duplicated rows
        for layer in a.layers(comp):
            assert torch.equal(a.rows(comp, layer), b.rows(comp, layer))
    # A rerun of a finished run does nothing.
    engine = FakeEngine()
    assert run(part, engine=engine)["prompts"] == 0 and engine.calls == []


def test_crash_while_writing_a_shard_leaves_no_complete_looking_shard(tmp_path, monkeypatch):
    import safetensors.torch as st

    out = tmp_path / "ds"
    real = st.save_file
    calls = {"n": 0}

    def dying_save(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] == 2:
            with open(path, "wb") as f:
                f.write(b"\x00" * 100)  # half-written, then the process dies
            raise Interrupt("killed while writing")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(st, "save_file", dying_save)
    with pytest.raises(Interrupt):
        run(out)
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.safetensors"]
    assert len(load_dataset(out, verify=True).shards) == 1
    monkeypatch.setattr(st, "save_file", real)
    run(out)
    ds = load_dataset(out, verify=True)
    assert ds.complete and ds.shards[-1]["prompt_end"] == len(PROMPTS)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []


def _write_waiting_for(event: threading.Event, seen: list):
    """``_write_shard`` that first waits (5 s at most) for ``event``; ``seen`` gets whether it
    came, per shard."""
    real = cli._write_shard

    def write(*args, **kwargs):
        seen.append(event.wait(timeout=5))
        return real(*args, **kwargs)
    return write


def test_a_shard_is_written_while_the_next_batch_runs(tmp_path, monkeypatch):
    next_batch, seen = threading.Event(), []
    monkeypatch.setattr(cli, "_write_shard", _write_waiting_for(next_batch, seen))

    def capture(llm, prompts, **kwargs):
        if len(llm.calls) >= 2:  # past the first batch (a call a component: two)
            next_batch.set()
        return fake_capture(llm, prompts, **kwargs)

    monkeypatch.setattr(api, "capture", capture)
    out = tmp_path / "ds"
    run(out, batch_size=2, shard_rows=1)  # every batch ends a shard
    assert seen[0] is True  # a write in line would have waited out the 5 s
    ds = load_dataset(out, verify=True)
    assert ds.complete and len(ds.shards) == len(PROMPTS) // 2 == len(seen)


def test_an_error_in_a_batch_keeps_the_shard_being_written(tmp_path, monkeypatch):
    failed, seen = threading.Event(), []
    monkeypatch.setattr(cli, "_write_shard", _write_waiting_for(failed, seen))

    def capture(llm, prompts, **kwargs):
        if len(llm.calls) == 2:  # the second batch's first component: shard 0 is being written
            failed.set()
            raise Interrupt("the engine died")
        return fake_capture(llm, prompts, **kwargs)

    monkeypatch.setattr(api, "capture", capture)
    out = tmp_path / "ds"
    with pytest.raises(Interrupt, match="the engine died"):
        run(out, batch_size=2, shard_rows=1)
    assert seen == [True]
    ds = load_dataset(out, verify=True)
    assert [s["prompt_end"] for s in ds.shards] == [2] and not ds.complete
    monkeypatch.setattr(api, "capture", fake_capture)
    assert run(out, batch_size=2, shard_rows=1)["resumed_at"] == 2
    full = tmp_path / "full"
    run(full, batch_size=2, shard_rows=1)
    a, b = load_dataset(full), load_dataset(out, verify=True)
    for layer in range(NUM_LAYERS):
        assert torch.equal(a.rows("hidden_states", layer), b.rows("hidden_states", layer))


def test_shard_limits_bound_buffered_rows(tmp_path):
    out = tmp_path / "ds"
    run(out, batch_size=1, shard_rows=10**6, shard_mb=1e-4)  # ~100 bytes: every batch flushes
    assert len(load_dataset(out).shards) == len(PROMPTS)
    out2 = tmp_path / "ds2"
    run(out2, batch_size=2, shard_rows=1)
    assert len(load_dataset(out2).shards) == len(PROMPTS) // 2


def test_last_selection_per_prompt_select_ids_and_bf16(tmp_path):
    prompts = [Prompt(i, f"doc-{i}", t) for i, t in enumerate(PROMPTS)]
    own = SelectSpec(prompt_positions=(0, 1)).to_wire()
    prompts[2] = Prompt(2, "doc-2", PROMPTS[2], own)
    out = tmp_path / "ds"
    run(out, prompts=prompts, select="last", max_tokens=1, storage_dtype="bf16",
        components="hidden_states", layers="0,-1")
    ds = load_dataset(out)
    assert ds.manifest["selection"]["mode"] == "last"
    assert ds.manifest["selection"]["per_prompt"] == 1
    assert ds.layers("hidden_states") == [0, 2]
    assert ds.dtype == torch.bfloat16
    lab = ds.labels("hidden_states")
    assert lab["position"].tolist() == [
        len(t.split()) - 1 if i != 2 else p for i, t in enumerate(PROMPTS)
        for p in ([0, 1] if i == 2 else [None])]
    rows = ds.rows("hidden_states", 2, prompt="doc-3")
    assert rows.dtype == torch.bfloat16
    assert torch.equal(rows[0], expected_row(PROMPTS[3], 10, 2, "hidden_states").bfloat16())
    assert ds.prompt_ids[3] == "doc-3"


def test_output_folder_holding_another_run_is_refused(tmp_path):
    out = tmp_path / "ds"
    run(out)
    before = (out / "manifest.json").read_text()
    for change in (dict(layers=[0]), dict(select="last"), dict(max_tokens=2),
                   dict(prompts=PROMPTS[:-1]), dict(components=["hidden_states"]),
                   dict(storage_dtype="float16"), dict(model="other"),
                   dict(engine_options={"load_format": "dummy"})):
        with pytest.raises(UsageError, match="different run"):
            run(out, **change)
    assert (out / "manifest.json").read_text() == before
    # A manifest from before the fingerprint named the load format resumes as the checkpoint's.
    manifest = json.loads(before)
    del manifest["run"]["load_format"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert run(out)["prompts"] == 0  # accepted: complete, nothing to do
    with pytest.raises(UsageError, match="load_format"):
        run(out, engine_options={"load_format": "dummy"})
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match="not empty"):
        run(foreign)


def test_engine_side_validation_writes_nothing(tmp_path):
    out = tmp_path / "ds"
    with pytest.raises(UsageError, match=r"unknown layer\(s\) \[5\]"):
        run(out, layers=[5])
    with pytest.raises(UsageError, match="router_logits"):
        run(out, components=["router_logits"])
    with pytest.raises(UsageError, match="selects nothing|feeds none"):
        run(out, select=json.dumps({"generation": "all"}), max_tokens=1)
    assert not out.exists()


def test_not_a_dataset(tmp_path):
    with pytest.raises(DatasetError, match="no such dataset folder"):
        load_dataset(tmp_path / "missing")
    with pytest.raises(DatasetError, match="no manifest.json"):
        load_dataset(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(DatasetError, match="not a vllm-capture dataset"):
        load_dataset(tmp_path)


def engine_dtype_capture(dtypes: dict[str, torch.dtype]):
    """fake_capture as the real engine answers without a storage dtype: each component's rows
    in the engine's dtype for it (a MoE gate may give float32 router logits beside bfloat16
    hidden states), and no entry for a layer without rows."""

    def capture(llm, prompts, *, stream, dtype=None, **kwargs):
        result = fake_capture(llm, prompts, stream=stream, dtype=dtype, **kwargs)
        stored = getattr(torch, dtype) if dtype else dtypes[stream]
        kept = [layer for layer, t in result.layers.items() if t.shape[0]]
        result.layers = {layer: result.layers[layer].to(stored) for layer in kept}
        result._meta = {layer: result._meta[layer] for layer in kept}
        result.layouts = {layer: result.layouts[layer] for layer in kept}
        return result

    return capture


def test_resumed_run_stores_an_empty_last_shard_in_the_recorded_dtype(tmp_path, monkeypatch):
    from safetensors import safe_open

    monkeypatch.setattr(api, "capture", engine_dtype_capture({"hidden_states": torch.bfloat16}))
    nothing = SelectSpec(prompt_tokens=[100000]).to_wire()  # no fake token is that large
    prompts = [Prompt(i, str(i), t, nothing if i >= 6 else None) for i, t in enumerate(PROMPTS)]
    opts = dict(prompts=prompts, components="hidden_states", select="last", max_tokens=1,
                shard_rows=3)

    def stop_at_prompt_6(entry):
        if entry["prompt_end"] >= 6:
            raise Interrupt(entry["file"])

    out = tmp_path / "ds"
    with pytest.raises(Interrupt):
        run(out, on_shard=stop_at_prompt_6, **opts)
    run(out, **opts)  # prompts 6.. select nothing: an empty last shard
    ds = load_dataset(out, verify=True)
    assert ds.complete and ds.dtype == torch.bfloat16
    last = ds.shards[-1]
    assert last["prompt_start"] == 6 and last["rows"] == {"hidden_states": 0}
    with safe_open(str(out / last["file"]), framework="pt") as f:
        assert f.get_slice("hidden_states.layer_0").get_dtype() == "BF16"


def test_each_component_records_its_own_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(api, "capture", engine_dtype_capture(
        {"hidden_states": torch.bfloat16, "attention_heads": torch.float32}))
    out = tmp_path / "ds"
    run(out)
    ds = load_dataset(out, verify=True)
    assert ds.manifest["dtypes"] == {"hidden_states": "bfloat16", "attention_heads": "float32"}
    assert ds.dtypes == {"hidden_states": torch.bfloat16, "attention_heads": torch.float32}
    assert ds.dtype == torch.bfloat16  # the first component's
    assert ds.rows("attention_heads", 1).dtype == torch.float32
    assert ds.rows("hidden_states", 1, prompt=0, positions=99).dtype == torch.bfloat16


def test_resume_on_an_engine_of_another_dtype_is_refused(tmp_path, monkeypatch):
    bf16 = {"hidden_states": torch.bfloat16, "attention_heads": torch.bfloat16}
    monkeypatch.setattr(api, "capture", engine_dtype_capture(bf16))
    out = tmp_path / "ds"

    def stop_after_first(entry):
        raise Interrupt(entry["file"])

    with pytest.raises(Interrupt):
        run(out, on_shard=stop_after_first)
    before = (out / "manifest.json").read_text()
    monkeypatch.setattr(api, "capture", engine_dtype_capture({**bf16,
                                                              "hidden_states": torch.float16}))
    with pytest.raises(DatasetError, match=r"hidden_states layer 0 of prompts \[\d+, \d+\) came "
                       "back as float16, but this dataset stores hidden_states as bfloat16"):
        run(out)
    assert (out / "manifest.json").read_text() == before
    assert len(load_dataset(out, verify=True).shards) == 1


def test_format_version_1_manifests_are_read_and_resumed(tmp_path):
    out = tmp_path / "ds"

    def stop_after_first(entry):
        raise Interrupt(entry["file"])

    with pytest.raises(Interrupt):
        run(out, on_shard=stop_after_first)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["version"] = 1  # version 1 recorded one dtype for all components
    manifest["dtype"] = manifest.pop("dtypes")["hidden_states"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert load_dataset(out, verify=True).dtypes == {"hidden_states": torch.float32,
                                                     "attention_heads": torch.float32}
    run(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["version"] == 2 and "dtype" not in manifest
    assert manifest["dtypes"] == {"hidden_states": "float32", "attention_heads": "float32"}
    assert load_dataset(out, verify=True).complete


def test_prompt_longer_than_max_model_len_is_refused_before_writing(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"doc-{i}", "prompt": t}) + "\n"
                            for i, t in enumerate(PROMPTS[:5])))
    engine = FakeEngine(max_model_len=11)  # prompt 3 has 11 words: one token each
    out = tmp_path / "ds"
    with pytest.raises(UsageError, match=r"prompt 'doc-3' \(line 4\) has 11 tokens; the engine's "
                       r"max_model_len 11 allows at most 10"):
        extract(engine, load_prompts(path), out, model="fake-model", progress=False)
    assert engine.calls == [] and not out.exists()
    capsys.readouterr()
    rc = main(["extract", "fake-model", str(path), "--out", str(out), "--no-progress"],
              llm_factory=lambda *args: engine)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "prompt 'doc-3' (line 4)" in err, err
    assert engine.calls == [] and not out.exists()


def test_truncated_or_unreadable_shard_is_a_dataset_error(tmp_path, capsys):
    out = tmp_path / "ds"
    run(out)
    shard = out / load_dataset(out).shards[1]["file"]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(DatasetError, match="truncated"):
        load_dataset(out)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and shard.name in err and "truncated" in err
    shard.write_bytes(b"\xff" * len(data))  # the listed size, an unreadable header
    ds = load_dataset(out)
    with pytest.raises(DatasetError, match=f"{shard.name}: unreadable shard"):
        ds.rows("hidden_states", 0)


def test_capture_result_save_over_an_earlier_save(tmp_path, monkeypatch):
    def result(prompts):
        return fake_capture(FakeEngine(), prompts, stream="hidden_states", layers=[0, 1],
                            select=SelectSpec(prompt="all"))

    a, b = result(PROMPTS[:2]), result(PROMPTS[2:5])
    path = tmp_path / "result"
    a.save(path)
    real_save = np.save
    saved = []

    def disk_full_at_second_file(file, arr, *args, **kwargs):
        saved.append(file)
        if len(saved) == 2:
            raise OSError("No space left on device")
        return real_save(file, arr, *args, **kwargs)

    monkeypatch.setattr(np, "save", disk_full_at_second_file)
    with pytest.raises(OSError, match="No space"):
        b.save(path)
    monkeypatch.setattr(np, "save", real_save)
    with pytest.raises(FileNotFoundError, match="save did not finish"):
        api.CaptureResult.load(path)
    b.save(path)
    loaded = api.CaptureResult.load(path)
    assert loaded.offsets == b.offsets
    for layer in (0, 1):
        assert torch.equal(loaded.layers[layer], b.layers[layer])
        assert torch.equal(loaded.meta(layer).positions, b.meta(layer).positions)
    # Files of two saves mixed by hand are refused too.
    a.save(tmp_path / "a")
    shutil.copy(tmp_path / "a" / "labels_1.npy", path / "labels_1.npy")
    with pytest.raises(ValueError, match="layer 1: row counts disagree"):
        api.CaptureResult.load(path)


def test_capture_result_per_prompt_accessors_and_a_bf16_round_trip(tmp_path):
    """``sample_token_ids`` and ``token`` against the fake's own tokens and rows, and a bf16
    result saved and loaded back with every label (positions, token ids, request ids)."""
    prompts = PROMPTS[:3]
    result = fake_capture(FakeEngine(), prompts, stream="attention_heads", layers=[0, 2],
                          select=SelectSpec(prompt="all"), dtype="bfloat16")
    for i, text in enumerate(prompts):
        words = text.split()
        assert result.sample_token_ids(i).tolist() == [_token(w) for w in words]
        last = expected_row(text, len(words) - 1, 2, "attention_heads").to(torch.bfloat16)
        assert torch.equal(result.token(i, 2), last)
        second = expected_row(text, 1, 0, "attention_heads").to(torch.bfloat16)
        assert torch.equal(result.token(i, 0, pos=1), second)
    with pytest.raises(KeyError, match="no captured row at position 999"):
        result.token(0, 0, pos=999)
    # A layer not captured, or a bool or float where an int goes, is named, not read as another.
    for call in (lambda: result.sample_rows(0, 1), lambda: result.meta(1),
                 lambda: result.token(0, 1)):
        with pytest.raises(KeyError, match=r"layer 1 was not captured; captured layers: \[0, 2\]"):
            call()
    for call in (lambda: result.sample_positions(True), lambda: result.sample(1.0)):
        with pytest.raises(TypeError, match="prompt index: expected an int"):
            call()
    with pytest.raises(TypeError, match="pos: expected an int, got True"):
        result.token(0, 0, pos=True)
    assert torch.equal(result.sample_rows(np.int64(1), 0), result.sample_rows(1, 0))
    # Integer scalars of numpy and torch are ints: the positions a result hands out index it.
    for pos in result.sample_positions(1):
        assert torch.equal(result.token(1, 0, pos), result.token(1, 0, int(pos)))
    assert torch.equal(result.sample_rows(torch.tensor(1), 0), result.sample_rows(1, 0))
    with pytest.raises(TypeError, match="prompt index: expected an int"):
        result.sample(torch.tensor(True))
    loaded = api.CaptureResult.load(result.save(tmp_path / "r"))
    assert (loaded.stream, loaded.offsets, loaded.layouts) == (
        result.stream, result.offsets, result.layouts)
    for layer in (0, 2):
        assert loaded.layers[layer].dtype == torch.bfloat16
        assert torch.equal(loaded.layers[layer], result.layers[layer])
        got, want = loaded.meta(layer), result.meta(layer)
        assert got.req_ids == want.req_ids
        assert torch.equal(got.positions, want.positions)
        assert torch.equal(got.token_ids, want.token_ids)


@pytest.mark.parametrize("prompts, match", [
    ([Prompt(0, "doc", "a b"), Prompt(1, "doc", "c d")],
     r"prompts\[1\]: duplicate prompt id 'doc' \(first at prompts\[0\]\)"),
    ([Prompt(0, "0", "a b", {"prompt_positions": []})], r'prompts\[0\]: invalid "select"'),
    ([Prompt(0, "0", " \n")], r'prompts\[0\]: "prompt" is empty'),
    (["a b", ""], r'prompts\[1\]: "prompt" is empty'),
    ([Prompt(0, 7, "a b")], r'prompts\[0\]: "id" must be a string'),
])
def test_prompt_records_from_python_are_checked_like_a_files(tmp_path, prompts, match):
    engine = FakeEngine()
    out = tmp_path / "ds"
    with pytest.raises(UsageError, match=match):
        run(out, engine=engine, prompts=prompts)
    assert engine.calls == [] and not out.exists()


def test_prompt_record_select_may_be_a_select_spec(tmp_path):
    own = SelectSpec(prompt_positions=(0,))
    out = tmp_path / "ds"
    run(out, prompts=[Prompt(0, "a", PROMPTS[0], own), Prompt(1, "b", PROMPTS[1])],
        select="last", max_tokens=1)
    ds = load_dataset(out, verify=True)
    assert ds.prompts[0]["select"] == own.to_wire()
    assert ds.labels("hidden_states")["position"].tolist() == [0, len(PROMPTS[1].split()) - 1]


def _drop(*keys):
    def edit(manifest):
        *path, last = keys
        for key in path:
            manifest = manifest[key]
        del manifest[last]
    return edit


def _set(*keys, value):
    def edit(manifest):
        *path, last = keys
        for key in path:
            manifest = manifest[key]
        manifest[last] = value
    return edit


@pytest.mark.parametrize("edit, match", [
    (_drop("request_ids"), "field 'request_ids' is missing"),
    (_drop("shards", 0, "rows"), r"field 'shards\[0\].rows' is missing"),
    (_set("shards", value=None), "field 'shards' must be a list, got null"),
    (_set("shards", 1, value="shard-00001.safetensors"), r"field 'shards\[1\]' must be an object"),
    (_set("shards", 1, "file", value="../shard-00001.safetensors"),
     r"field 'shards\[1\].file' must be a file name"),
    (_set("dtypes", "hidden_states", value="int8"), "field 'dtypes.hidden_states' must be one of"),
    (_drop("layouts", "attention_heads", "1", "width"),
     "field 'layouts.attention_heads.1.width' is missing"),
    (_set("rows", "hidden_states", value="12"), "field 'rows.hidden_states' must be an integer"),
    (_set("complete", value="yes"), "field 'complete' must be true or false"),
    (_set("run", value=[]), "field 'run' must be an object"),
    (_set("components", value=[]), "field 'components' must be a non-empty list"),
])
def test_malformed_manifest_fields_are_named(tmp_path, capsys, edit, match):
    out = tmp_path / "ds"
    run(out)
    manifest = json.loads((out / "manifest.json").read_text())
    edit(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=match):
        load_dataset(out)
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("vllm-capture: error: ") and err.count("\n") == 1, err


def test_a_second_run_into_a_folder_being_written_is_refused(tmp_path):
    out = tmp_path / "ds"
    seen = []

    def second_run(entry):  # while the first run writes its shards
        if not seen:
            with pytest.raises(UsageError, match="another extract run is writing into"):
                run(out)
            seen.append(entry["file"])

    summary = run(out, on_shard=second_run)
    assert seen and summary["prompts"] == len(PROMPTS)
    load_dataset(out, verify=True)
    assert run(out)["prompts"] == 0  # the folder is free again: a rerun finds it complete


def _model_folder(path, weights: bytes):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"num_hidden_layers": 3}))
    (path / "model.safetensors").write_bytes(weights)
    (path / "README.md").write_text("about the model")
    return path


def test_a_model_rewritten_in_place_is_another_run(tmp_path):
    size = cli.WEIGHT_SAMPLES * cli.WEIGHT_SAMPLE_BYTES * 4  # large enough to be sampled
    weights = bytearray(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    model = _model_folder(tmp_path / "model", bytes(weights))
    out = tmp_path / "ds"
    run(out, model=str(model))
    # The same bytes written again, and files vLLM does not load (a PyTorch copy beside the
    # safetensors, a trainer's state, a licence): the same run.
    (model / "model.safetensors").write_bytes(bytes(weights))
    (model / "README.md").write_text("edited")
    for name in ("LICENSE.txt", "pytorch_model.bin", "optimizer.pt", "trainer_state.json"):
        (model / name).write_bytes(b"not read")
    assert run(out, model=str(model))["prompts"] == 0
    # New weights of the same size (a block that a sample reads), or a changed config: refused.
    changed = bytearray(weights)
    last = size - cli.WEIGHT_SAMPLE_BYTES
    changed[7 * last // (cli.WEIGHT_SAMPLES - 1) + 100] ^= 1
    (model / "model.safetensors").write_bytes(bytes(changed))
    with pytest.raises(UsageError, match="differs in: model_files_sha256"):
        run(out, model=str(model))
    (model / "model.safetensors").write_bytes(bytes(weights))
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 4}))
    with pytest.raises(UsageError, match="differs in: model_files_sha256"):
        run(out, model=str(model))
    # A dataset written before the fingerprint hashed the model's files, or by a run that did
    # not find them, resumes unchecked.
    manifest = json.loads((out / "manifest.json").read_text())
    for unknown in ({}, {"model_files_sha256": None}):
        manifest["run"].pop("model_files_sha256", None)
        manifest["run"].update(unknown)
        (out / "manifest.json").write_text(json.dumps(manifest))
        assert run(out, model=str(model))["prompts"] == 0


def test_model_files_sha256_reads_small_weight_files_whole(tmp_path):
    model = _model_folder(tmp_path / "model", b"\0" * 1000)
    before = cli.model_files_sha256(str(model))
    (model / "model.safetensors").write_bytes(b"\0" * 999 + b"\1")
    assert cli.model_files_sha256(str(model)) != before
    # PyTorch weights count where there are no safetensors, a trainer's state never.
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"weights")
    bin_only = cli.model_files_sha256(str(model))
    (model / "training_args.bin").write_bytes(b"arguments")
    assert cli.model_files_sha256(str(model)) == bin_only
    (model / "pytorch_model.bin").write_bytes(b"other weights")
    assert cli.model_files_sha256(str(model)) != bin_only
    # Models whose files are not here: a Hub id never downloaded, a label naming no folder.
    assert cli.model_files_sha256("not-a-downloaded-model") is None
    assert cli.model_files_sha256("./checkpoints/step-1000") is None
