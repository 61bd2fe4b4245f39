"""The client calls' argument handling, without an engine: what reaches the workers through
vLLM's RPC encoder, and the checks capture() and capture_batches() make before any request."""

import numpy as np
import pytest
import torch

import vllm_capture as vc
from vllm_capture.session.config import StreamConfig


class _EncodingEngine:
    """A vllm.LLM stand-in whose collective_rpc sends its arguments through vLLM's msgpack
    encoder and decoder (the multiprocessing engine's way to its workers) and records them."""

    def __init__(self, reply):
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder()
        self.reply, self.calls = reply, []

    def collective_rpc(self, method, args=()):
        decoded = self.decoder.decode(self.encoder.encode((method, args)))
        self.calls.append(decoded)
        return [self.reply]


class _NoEngine:
    def collective_rpc(self, method, args=()):
        raise AssertionError(f"{method} reached the engine: the arguments were not checked first")


def test_start_capture_carries_torch_dtypes_and_numpy_layers_to_the_worker():
    llm = _EncodingEngine({"tp_rank": 0})
    vc.start_capture(llm, vc.HIDDEN_STATES, dtype=torch.bfloat16, layers=np.arange(2),
                     budget_rows=np.int64(8))
    _, (stream, config) = llm.calls[0]
    worker_side = StreamConfig(**config)
    assert stream == vc.HIDDEN_STATES
    assert (worker_side.dtype, worker_side.layers, worker_side.budget_rows) == (
        torch.bfloat16, {0, 1}, 8)
    vc.start_capture(llm, vc.HIDDEN_STATES, layers=range(1, 3), dtype="fp16")
    worker_side = StreamConfig(**llm.calls[1][1][1])
    assert (worker_side.dtype, worker_side.layers) == (torch.float16, {1, 2})


@pytest.mark.parametrize("config, field", [
    (dict(budget_rows=2 ** 70), "budget_rows"),
    (dict(layers=[0, 2 ** 70]), "layers"),
    (dict(dtype=np.float16), "dtype"),
])
def test_start_capture_names_a_value_the_rpc_could_not_carry(config, field):
    """vLLM's encoder would refuse these naming no field (an int past 2**64, a numpy type)."""
    with pytest.raises(ValueError, match=f"^{field} must be"):
        vc.start_capture(_NoEngine(), vc.HIDDEN_STATES, **config)


def test_numpy_ints_are_ints_everywhere_a_count_or_layer_goes(monkeypatch):
    config = StreamConfig(layers=[np.int64(1)], budget_rows=np.int32(5))
    assert config.layers == {1} and config.budget_rows == 5
    assert type(next(iter(config.layers))) is int and type(config.budget_rows) is int
    monkeypatch.setattr(vc.api, "_run", lambda llm, checked: checked)
    checked = vc.capture(_EncodingEngine({"tp_rank": 0, "enabled": False}), ["a"],
                         budget_rows=np.int64(5), layers=[np.int64(0)])
    assert checked.config["budget_rows"] == 5 and type(checked.config["budget_rows"]) is int
    kw = vc.engine_kwargs(buffer_bytes=np.int64(2 ** 30), reduce_slots=np.int32(8))
    assert kw["additional_config"]["capture"]["buffer_bytes"] == 2 ** 30
    assert type(kw["additional_config"]["capture"]["reduce_slots"]) is int
    batches = list(vc.capture_batches(_EncodingEngine({"tp_rank": 0, "enabled": False}),
                                      list("abc"), batch_size=np.int64(2)))
    assert [len(c.prompts) for c in batches] == [2, 1]


@pytest.mark.parametrize("value, expected", [
    (3, True), (np.int64(3), True), (np.uint8(3), True), (-1, True),
    (True, False), (np.bool_(True), False), (3.0, False), (np.float32(3), False), ("3", False),
    (torch.tensor(3), False), (None, False)])
def test_one_integer_test_for_every_entry_point(value, expected):
    from vllm_capture.checks import is_int

    assert is_int(value) is expected
    # The checks that use it refuse the same values (a count, a layer, a prompt position).
    if expected:
        return
    from vllm_capture.checks import as_count

    with pytest.raises(ValueError, match="batch_size"):
        as_count("batch_size", value)
    with pytest.raises(ValueError, match="layers"):
        StreamConfig(layers=[value])
    with pytest.raises(ValueError, match="prompt_positions"):
        vc.SelectSpec(prompt_positions=[value])


def test_prompts_without_their_own_selection_share_one_copy_of_the_parameters(monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setattr(vc.api, "_run", lambda llm, checked: checked)
    given = SamplingParams(max_tokens=3, temperature=0.0)
    own = vc.SelectSpec(prompt="all")
    checked = vc.capture(_EncodingEngine({"tp_rank": 0, "enabled": False}), list("abcd"),
                         select=vc.SelectSpec.last_prompt_token(), sampling_params=given,
                         per_prompt_selects=[None, own, None, own])
    shared, first_own, _, second_own = checked.params
    assert checked.params[2] is shared and shared is not given
    assert first_own is not second_own and shared not in (first_own, second_own)
    assert (shared.extra_args or {}).get("capture") is None
    assert shared.skip_reading_prefix_cache is not True  # a last prompt row may read the cache
    for p in (first_own, second_own):
        assert p.extra_args["capture"] == {"hidden_states": own.to_wire()}
        assert p.skip_reading_prefix_cache is True
    assert given.extra_args is None and given.skip_reading_prefix_cache is not True
    assert all(p.max_tokens == 3 for p in checked.params)


def test_fetch_carries_numpy_layer_ids_and_tuples_of_request_ids():
    llm = _EncodingEngine({"tp_rank": 0, "tp_size": 1, "layers": {}})
    assert vc.fetch_captured(llm, vc.HIDDEN_STATES, layers=[np.int32(3)],
                             req_ids=("a", "b"))[0] == {}
    _, (stream, clear, layers, req_ids, _, as_text) = llm.calls[0]
    assert (stream, clear, layers, req_ids, as_text) == (
        vc.HIDDEN_STATES, True, [3], ["a", "b"], False)


def test_max_tokens_with_sampling_params_is_refused():
    from vllm import SamplingParams

    with pytest.raises(ValueError, match=r"not both \(\['max_tokens'\]\)"):
        vc.capture(_NoEngine(), ["a"], max_tokens=4, sampling_params=SamplingParams())
    with pytest.raises(ValueError, match=r"not both \(\['seed', 'max_tokens'\]\)"):
        vc.capture(_NoEngine(), ["a"], max_tokens=4, seed=1, sampling_params=SamplingParams())


@pytest.mark.parametrize("call", [vc.capture, vc.capture_batches])
@pytest.mark.parametrize("prompts, selects, match", [
    ("hello", None, "prompts: expected a list of prompts, got one str"),
    ([], None, "prompts: empty"),
    (["a", "b", "c"], [None] * 4, "per_prompt_selects: 4 entries for 3 prompts"),
    (["a", "b", "c"], [None] * 2, "per_prompt_selects: 2 entries for 3 prompts"),
    (["a"], vc.SelectSpec.last_prompt_token(), "per_prompt_selects: expected one entry per prompt"),
    (["a"], {"prompt": "all"}, "per_prompt_selects: expected one entry per prompt"),
])
def test_bad_prompts_or_selections_are_refused_before_any_request(call, prompts, selects, match):
    with pytest.raises(ValueError, match=match):
        call(_NoEngine(), prompts, per_prompt_selects=selects)


def test_capture_batches_reads_an_iterator_of_selections_once(monkeypatch):
    seen = []
    monkeypatch.setattr(vc.api, "_run", lambda llm, checked: seen.append(checked) or len(
        checked.prompts))
    selects = (vc.SelectSpec(prompt_positions=(i,)) for i in range(5))
    llm = _EncodingEngine({"tp_rank": 0, "enabled": False})
    batches = list(vc.capture_batches(llm, list("abcde"), batch_size=2,
                                      per_prompt_selects=selects, max_tokens=3))
    assert batches == [2, 2, 1]
    assert [method for method, _ in llm.calls] == ["capture_status"]  # is the stream off?
    assert [c.prompts for c in seen] == [["a", "b"], ["c", "d"], ["e"]]
    wires = [p.extra_args["capture"][vc.HIDDEN_STATES] for c in seen for p in c.params]
    assert wires == [vc.SelectSpec(prompt_positions=(i,)).to_wire() for i in range(5)]
    assert {p.max_tokens for c in seen for p in c.params} == {3}


@pytest.mark.parametrize("kwargs, message", [
    (dict(per_prompt_selects=[None, None, {"prompt_positions": "x"}]), "per_prompt_selects\\[2\\]"),
    (dict(stream="nonsense"), "^stream:"),
    (dict(sampling_params=object()), "^sampling_params:"),
    (dict(max_tokens=2, temperature=0.5, n=2), "n=1"),
    (dict(layers="1"), "^layers"),
    (dict(dtype="int8"), "^dtype"),
    (dict(budget_rows=-1), "^budget_rows"),
    (dict(max_tokens=True), "^max_tokens: expected an int >= 1, got True"),
    (dict(max_tokens=2.0), "^max_tokens: expected an int >= 1, got 2.0"),
    (dict(max_tokens=0), "^max_tokens: expected an int >= 1, got 0"),
    (dict(per_prompt_selects=5), "^per_prompt_selects: expected one entry per prompt, got 5"),
    (dict(select={"nonsense": 1}), "select"),
    # Generated rows only, with max_tokens=1 (the default): no row could be captured.
    (dict(select=vc.SelectSpec(generation="all")), "^select: selects generated rows only, but "
                                                   "max_tokens=1 feeds none"),
    (dict(max_tokens=3, per_prompt_selects=[None, {"generation_positions": [2]}, None]),
     "^per_prompt_selects\\[1\\]: selects generated rows only, but no decode step that "
     "max_tokens=3 feeds"),
    # A selection in the sampling parameters would override select= unseen.
    (dict(extra_args={"capture": {"prompt": "all"}}), "^extra_args\\['capture'\\]: capture\\(\\) "
                                                      "sets each prompt's selection itself"),
])
def test_capture_batches_checks_every_argument_before_the_first_batch(kwargs, message):
    with pytest.raises(ValueError, match=message):
        vc.capture_batches(_NoEngine(), ["a", "b", "c"], batch_size=1, **kwargs)


def test_a_selection_in_given_sampling_params_is_refused(monkeypatch):
    from vllm import SamplingParams

    monkeypatch.setattr(vc.api, "_run", lambda llm, checked: checked)
    none = SamplingParams(max_tokens=1, extra_args={"capture": None})  # no selection: fine
    vc.capture(_EncodingEngine({"tp_rank": 0, "enabled": False}), ["a"], sampling_params=none)

    params = SamplingParams(max_tokens=2, extra_args={"capture": {"prompt": "all"}, "x": 1})
    with pytest.raises(ValueError, match=r"^sampling_params.extra_args\['capture'\]: "):
        vc.capture(_NoEngine(), ["a"], select=vc.SelectSpec.last_prompt_token(),
                   sampling_params=params)


def test_selections_that_feed_rows_pass_the_max_tokens_check(monkeypatch):
    """The check refuses only what can capture nothing: a generated row at the last step fed,
    a prompt row at max_tokens=1, and a token selector (tokens are unknown before the generate)."""
    monkeypatch.setattr(vc.api, "_run", lambda llm, checked: checked)
    llm = _EncodingEngine({"tp_rank": 0, "enabled": False})
    for max_tokens, select in [(3, {"generation_positions": [1]}), (1, {"prompt": "all"}),
                               (2, {"generation_tokens": [7]}),
                               (2, {"generation": "all", "exclude_generation_positions": [5]})]:
        checked = vc.capture(llm, ["a"], max_tokens=max_tokens, select=select)
        assert checked.config["select"] == vc.SelectSpec.from_wire(select).to_wire()


@pytest.mark.parametrize("call", [vc.capture, vc.capture_batches])
def test_capture_refuses_a_stream_that_is_already_on(call):
    """Starting it afresh would drop the rows it holds: capture() refuses before any request."""
    llm = _EncodingEngine({"tp_rank": 0, "enabled": True, "tokens_stored": 12})
    with pytest.raises(RuntimeError, match="'attention_heads' is already on .*stop_capture"):
        call(llm, ["a"], stream=vc.ATTENTION_HEADS)
    assert [method for method, _ in llm.calls] == ["capture_status"]


def test_capture_streams_checks_every_stream_before_starting_any():
    llm = _EncodingEngine({"tp_rank": 0, "enabled": False})
    with pytest.raises(ValueError, match=r"^layers\['nonsense'\]: unknown 'nonsense'"):
        vc.capture_streams(llm, ["a"], {vc.HIDDEN_STATES: None, "nonsense": None})
    with pytest.raises(ValueError, match="^layers: name at least one stream"):
        vc.capture_streams(llm, ["a"], {})
    assert [method for method, _ in llm.calls] == ["capture_status"]  # nothing started


def test_an_engine_without_the_worker_extension_is_named_as_such():
    class _Plain:
        def collective_rpc(self, method, args=()):
            # vLLM's message when the worker class lacks the method (seen from a real engine).
            raise Exception(f"Call to collective_rpc method failed: Worker failed with error "
                            f"''CPUWorker' object has no attribute '{method}'', please check the "
                            f"stack trace above for the root cause")

    with pytest.raises(RuntimeError, match="worker_extension_cls='vllm_capture.engine.worker_ext"
                                           ".CaptureWorkerExtension'"):
        vc.start_capture(_Plain(), vc.HIDDEN_STATES)


def test_an_async_engine_is_refused_by_name():
    class _AsyncEngine:  # vLLM's AsyncLLM has this collective_rpc
        async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            raise AssertionError("awaited")

    with pytest.raises(TypeError, match="AsyncLLM"):
        vc.capture_status(_AsyncEngine())
