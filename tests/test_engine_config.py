"""The engine-side capture config and how it sizes the device ring (no engine started)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_capture.engine.config import EngineCaptureConfig, engine_kwargs
from vllm_capture.engine.worker_ext import (_buffers_do_not_fit, _capacity, _reduce_slots,
                                            check_supported)


def _vllm_config(max_num_batched_tokens: int, max_num_seqs: int = 256):
    return SimpleNamespace(scheduler_config=SimpleNamespace(
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs))


def _targets(widths, dtype=torch.bfloat16, component="attention_heads"):
    return [SimpleNamespace(width=w, dtype=dtype, component=component) for w in widths]


def test_default_buffer_holds_every_row_of_the_largest_step():
    cfg = EngineCaptureConfig()
    assert cfg.buffer_bytes is None
    assert _capacity(cfg, _targets([4096] * 32), _vllm_config(16384)) == 16384


def test_byte_budget_sets_rows_per_step_and_warns_when_a_step_does_not_fit(caplog):
    targets = _targets([100, 28])  # (100*2 + 12) + (28*2 + 12) = 280 bytes a row, 2 slots
    per_row = 280 * 2
    caplog.set_level("WARNING", logger="vllm_capture")
    assert _capacity(EngineCaptureConfig(buffer_bytes=per_row * 70), targets, _vllm_config(512)) == 70
    assert "holds 70 rows per step" in caplog.text and str(per_row * 512) in caplog.text
    caplog.clear()
    assert _capacity(EngineCaptureConfig(buffer_bytes=per_row * 1000), targets, _vllm_config(512)) == 512
    assert caplog.text == ""
    assert _capacity(EngineCaptureConfig(buffer_bytes=1), targets, _vllm_config(512)) == 1


def test_rings_that_do_not_fit_are_sized_in_the_error_with_what_caps_them():
    # An 8B's hidden states and attention heads (64 sites 4,096 wide, bf16) at vLLM's default
    # 16,384 tokens a step on an H100 or H200: two slots of (8,192 + 12) bytes a row each.
    # Its 1,024 reduction slots (vLLM's default max_num_seqs there): 64 x (16,384 + 16) bytes
    # each, and the hidden states' 32 layers 8,192 bytes more each (their last rows in bf16).
    targets = _targets([4096] * 32, component="hidden_states") + _targets([4096] * 32)
    message = _buffers_do_not_fit(EngineCaptureConfig(), targets, 16384, 1024)
    assert "16.0 GiB (16384 rows a step at each of 64 call sites" in message
    assert "1024 reduction slots, 1.3 GiB" in message
    assert all(name in message for name in ("capture_buffer_bytes", "capture_reduce_slots",
                                            "capture_components"))


def test_reduce_slots_default_to_every_request_that_can_run_at_once():
    # vLLM's default max_num_seqs on an H100 or H200 is 1,024: with fewer slots, the requests of
    # one generate past them would fail their reduction.
    assert _reduce_slots(EngineCaptureConfig(), _vllm_config(16384, max_num_seqs=1024)) == 1024
    # Asked for: kept, beyond max_num_seqs too (room for requests that wait preempted).
    assert _reduce_slots(EngineCaptureConfig(reduce_slots=8), _vllm_config(512, 64)) == 8
    assert _reduce_slots(EngineCaptureConfig(reduce_slots=96), _vllm_config(512, 64)) == 96


@pytest.mark.parametrize("field,value", [("buffer_bytes", 0), ("buffer_bytes", True),
                                         ("reduce_slots", -1), ("ring_slots", 1.5),
                                         ("components", "hidden_states"), ("components", []),
                                         ("components", None),
                                         ("components", ["hidden_states", "hidden_states"]),
                                         ("version", True)])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineCaptureConfig(**{field: value})


def test_engine_kwargs_carry_the_config_through_additional_config():
    kw = engine_kwargs(components=("hidden_states",), max_model_len=64)
    cfg = EngineCaptureConfig.from_vllm_config(SimpleNamespace(additional_config=kw["additional_config"]))
    assert cfg == EngineCaptureConfig(components=("hidden_states",))
    assert kw["max_model_len"] == 64


def test_engine_kwargs_refuse_capture_options_inside_additional_config():
    """They would be replaced by the call's own (the defaults), the caller's buffer cap lost."""
    with pytest.raises(ValueError, match=r"^additional_config\['capture'\]: set by engine_kwargs"):
        engine_kwargs(additional_config={"capture": {"buffer_bytes": 2 ** 30}})
    with pytest.raises(ValueError, match="^additional_config: expected a dict"):
        engine_kwargs(additional_config='{"a": 1}')
    # Any iterable of names; a set's in a fixed order (the config enters the compile-cache hash).
    assert EngineCaptureConfig(components={"router_logits", "hidden_states"}).components == (
        "hidden_states", "router_logits")
    kw = engine_kwargs(buffer_bytes=2 ** 30, additional_config={"other": 1})
    assert kw["additional_config"]["other"] == 1
    assert kw["additional_config"]["capture"]["buffer_bytes"] == 2 ** 30


def _parallel_config(**overrides):
    parallel = dict(enable_dbo=False, data_parallel_size=1)
    passes = dict(enable_sp=False, fuse_gemm_comms=False)
    speculative = overrides.pop("speculative_config", None)
    for key in list(overrides):
        (passes if key in passes else parallel)[key] = overrides.pop(key)
    return SimpleNamespace(speculative_config=speculative,
                           parallel_config=SimpleNamespace(**parallel),
                           compilation_config=SimpleNamespace(
                               pass_config=SimpleNamespace(**passes)))


@pytest.mark.parametrize("setting, named", [
    (dict(speculative_config=object()), "speculative_config"),
    (dict(enable_dbo=True), "enable_dbo"),
    (dict(data_parallel_size=2), "data_parallel_size=2"),
    (dict(enable_sp=True), "pass_config.enable_sp"),
    (dict(fuse_gemm_comms=True), "pass_config.fuse_gemm_comms"),
])
def test_configurations_that_would_lose_or_misplace_rows_are_refused_by_name(setting, named):
    check_supported(_parallel_config())  # the default passes
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        check_supported(_parallel_config(**setting))
