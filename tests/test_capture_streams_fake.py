"""capture_streams' own path (_run_streams, _joined_params) and extract through it, on a fake
engine: the RPC helpers api.start_capture / stop_capture / fetch_captured / capture_status are
replaced, generate() is the fake's. No vLLM engine starts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vllm_capture as vc
from vllm_capture import api
from vllm_capture.session.wire import CaptureMeta


def _tokens(text: str) -> list[int]:
    return [sum(map(ord, w)) % 50 + 1 for w in text.split()]


class FakeLLM:
    """generate() captures, for every stream on, the rows its request's select picks (prompt
    rows only; max_tokens=1) under the engine-internal id ``{id}-0000000a``."""

    def __init__(self, *, model_dtype=torch.float32, stream_dtypes=None, fail_start=None,
                 fail_generate=False, fail_stop_once=None, dropped=None, leftover=0,
                 unreported=0):
        self.on, self.rows, self.log = {}, {}, []
        self.model_config = SimpleNamespace(dtype=model_dtype, max_model_len=100)
        self.stream_dtypes = stream_dtypes or {}
        self.fail_start, self.fail_generate = fail_start, fail_generate
        self.fail_stop_once, self.dropped = fail_stop_once, dropped or {}
        self.leftover = leftover  # requests an interrupted generate() left queued
        self.unreported = unreported  # requests another thread added while generate() ran
        self.next_id = 100
        self.llm_engine = SimpleNamespace(get_num_unfinished_requests=lambda: self.leftover)

    def get_tokenizer(self):
        return lambda texts, add_special_tokens=True: {"input_ids": [_tokens(t) for t in texts]}

    def generate(self, prompts, params, use_tqdm=False):
        self.log.append(("generate", len(prompts)))
        if self.fail_generate:
            raise KeyboardInterrupt
        outs = [SimpleNamespace(request_id=str(i), prompt_token_ids=[1, 2],
                                outputs=[SimpleNamespace(token_ids=[3])])
                for i in range(self.leftover + self.unreported)]
        for prompt, p in zip(prompts, params):
            rid, toks = str(self.next_id), _tokens(prompt)
            self.next_id += 1
            outs.append(SimpleNamespace(request_id=rid, prompt_token_ids=toks,
                                        outputs=[SimpleNamespace(token_ids=[3])]))
            own = (p.extra_args or {}).get("capture", {})
            for stream, config in self.on.items():
                wire = own.get(stream, config["select"])
                spec = vc.SelectSpec.from_wire(wire) if wire else vc.SelectSpec(prompt="all")
                for pos in spec.selected_prompt_positions(len(toks), toks):
                    self.rows.setdefault(stream, []).append((f"{rid}-0000000a", int(pos),
                                                             toks[pos]))
        return outs


@pytest.fixture(autouse=True)
def fake_rpcs(monkeypatch):
    def start(llm, stream, **config):
        llm.log.append(("start", stream))
        if stream == llm.fail_start:
            raise ValueError(f"layers: not available for {stream!r}")
        llm.on[stream] = config
        return {}

    def stop(llm, stream):
        llm.log.append(("stop", stream))
        if stream == llm.fail_stop_once:
            llm.fail_stop_once = None  # a harvest error is reported once, the stream left on
            raise RuntimeError("capture harvest failed")
        llm.on.pop(stream, None)
        llm.rows.pop(stream, None)

    def status(llm, stream="hidden_states", all_ranks=False):
        dtype = str(llm.stream_dtypes.get(stream, llm.model_config.dtype)).removeprefix("torch.")
        return {"enabled": stream in llm.on, "tokens_dropped": llm.dropped.get(stream, 0),
                "layouts": {0: {"width": 2}, 1: {"width": 2}}, "dtypes": {0: dtype, 1: dtype}}

    def fetch(llm, stream="hidden_states", clear=True, layers=None, req_ids=None):
        rows = llm.rows.get(stream, [])
        if not rows:
            return {}, {}, {}
        dtype = llm.stream_dtypes.get(stream, llm.model_config.dtype)
        meta = CaptureMeta([r[0] for r in rows], torch.tensor([r[1] for r in rows],
                                                              dtype=torch.int32),
                           torch.tensor([r[2] for r in rows], dtype=torch.int32))
        wanted = [0, 1] if llm.on[stream]["layers"] is None else llm.on[stream]["layers"]
        return ({layer: torch.full((len(rows), 2), float(layer), dtype=dtype) for layer in wanted},
                {layer: meta for layer in wanted}, {layer: {"width": 2} for layer in wanted})

    monkeypatch.setattr(api, "start_capture", start)
    monkeypatch.setattr(api, "stop_capture", stop)
    monkeypatch.setattr(api, "capture_status", status)
    monkeypatch.setattr(api, "fetch_captured", fetch)


STREAMS = {vc.HIDDEN_STATES: None, vc.ATTENTION_HEADS: [1]}


def test_every_stream_gets_its_rows_and_the_selects_of_every_stream():
    llm = FakeLLM()
    selects = iter([None, vc.SelectSpec(prompt_positions=(0,)), {"prompt": "all"}])
    res = vc.capture_streams(llm, ["a b c", "d e", "f"], STREAMS, per_prompt_selects=selects,
                             select=vc.SelectSpec.last_prompt_token())
    assert list(res) == list(STREAMS)
    for stream, r in res.items():
        assert r.stream == stream and r.outputs is res[vc.HIDDEN_STATES].outputs
        assert [r.sample_positions(i).tolist() for i in range(3)] == [[2], [0], [0]]
    assert sorted(res[vc.ATTENTION_HEADS].layers) == [1]
    assert llm.on == {} and llm.log.count(("generate", 3)) == 1


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(fail_start=vc.ATTENTION_HEADS), ValueError, "not available"),
    (dict(fail_generate=True), KeyboardInterrupt, None),
    # Not only the first stream's count.
    (dict(dropped={vc.ATTENTION_HEADS: 2}), RuntimeError, "attention_heads dropped 2 row"),
    # The others are stopped all the same, and the failed one again.
    (dict(fail_stop_once=vc.HIDDEN_STATES), RuntimeError, "harvest failed"),
    # A stop that fails after another error leaves that error to report.
    (dict(fail_generate=True, fail_stop_once=vc.HIDDEN_STATES), KeyboardInterrupt, None),
    (dict(dropped={vc.ATTENTION_HEADS: 2}, fail_stop_once=vc.HIDDEN_STATES), RuntimeError,
     "dropped 2 row"),
    (dict(unreported=1), RuntimeError, "generate\\(\\) returned 3 outputs for 2 prompts"),
])
def test_every_stream_is_stopped_whatever_fails(kwargs, error, message):
    llm = FakeLLM(**kwargs)
    with pytest.raises(error, match=message):
        vc.capture_streams(llm, ["a b", "c"], STREAMS)
    assert llm.on == {}
    # A stream whose start failed is stopped too (it may have started on some ranks).
    assert {stream for kind, stream in llm.log if kind == "stop"} == set(STREAMS)


def test_requests_an_interrupted_generate_left_are_refused_before_any_start():
    llm = FakeLLM(leftover=1)
    with pytest.raises(RuntimeError, match="unfinished"):
        vc.capture_streams(llm, ["a b", "c"], STREAMS)
    assert [entry for entry in llm.log if entry[0] == "start"] == []


def test_a_layer_no_row_reached_comes_in_the_dtype_its_rows_would_have():
    llm = FakeLLM(model_dtype=torch.bfloat16, stream_dtypes={"router_logits": torch.float32})
    none = vc.SelectSpec(prompt_tokens=(_tokens("?")[0],))
    res = vc.capture_streams(llm, ["no question here"], {"router_logits": None,
                                                          vc.HIDDEN_STATES: [1]}, select=none)
    assert {layer: t.dtype for layer, t in res["router_logits"].layers.items()} == {
        0: torch.float32, 1: torch.float32}
    assert res[vc.HIDDEN_STATES].layers[1].dtype == torch.bfloat16
    assert all(t.shape[0] == 0 for r in res.values() for t in r.layers.values())
    res = vc.capture_streams(llm, ["no question here"], {"router_logits": None}, select=none,
                             dtype="float16")  # the stream's own dtype, where it sets one
    assert {t.dtype for t in res["router_logits"].layers.values()} == {torch.float16}


def test_extract_stores_a_batch_without_rows_of_a_component_in_another_dtype(tmp_path):
    """Router logits may be float32 beside a bfloat16 model (GLM-4-MoE's and Ernie-4.5-MoE's
    gates): a batch whose selection picks no row hands back [0, width] tensors in the model's
    dtype; the run goes on and the dataset verifies."""
    from vllm_capture.cli import Prompt, extract
    from vllm_capture.dataset import load_dataset

    llm = FakeLLM(model_dtype=torch.bfloat16, stream_dtypes={"router_logits": torch.float32})
    own = {"prompt_tokens": _tokens("?")}
    for order in (["what ?", "no question here"], ["no question here", "what ?"]):
        out = tmp_path / "-".join(order[0].split())
        prompts = [Prompt(i, str(i), text, own) for i, text in enumerate(order)]
        extract(llm, prompts, out, model="fake", components=["hidden_states", "router_logits"],
                select="last", batch_size=1, shard_rows=1, progress=False)
        ds = load_dataset(out, verify=True)
        assert ds.manifest["dtypes"] == {"hidden_states": "bfloat16", "router_logits": "float32"}
        assert ds.num_rows("router_logits") == 1
        # A shard of the batch without rows stores them empty in the component's dtype too.
        assert {rows.dtype for rows, _ in ds.iter_shards("router_logits", 0)} == {torch.float32}


@pytest.mark.parametrize("layers, kwargs, error, message", [
    ([vc.HIDDEN_STATES], {}, ValueError, r"layers: name at least one stream, as \{stream"),
    ({}, {}, ValueError, "layers: name at least one stream"),
    (STREAMS, {"stream": vc.HIDDEN_STATES}, TypeError, "stream: capture_streams takes"),
    ({"bogus": None}, {}, ValueError, r"layers\['bogus'\]: unknown 'bogus'"),
    ({vc.HIDDEN_STATES: "1"}, {}, ValueError, r"layers\['hidden_states'\]: layers must be"),
    (STREAMS, {"max_tokens": 0}, ValueError, "^max_tokens"),  # not a stream's: no prefix
])
def test_bad_arguments_name_the_stream_they_belong_to(layers, kwargs, error, message):
    llm = FakeLLM()
    with pytest.raises(error, match=message):
        vc.capture_streams(llm, ["a b"], layers, **kwargs)
    assert llm.log == []
