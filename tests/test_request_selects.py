"""Per-request selections as they arrive in SamplingParams.extra_args["capture"]."""

import json

import numpy as np
import pytest

from vllm_capture.selection import SelectSpec
from vllm_capture.session.session import _parse_request_selects

LAST = SelectSpec.last_prompt_token().to_wire()


def _wires(selects: dict) -> dict:
    return {stream: spec.to_wire() for stream, spec in selects.items()}


@pytest.mark.parametrize("raw", [LAST, json.dumps(LAST)])
def test_one_clause_applies_to_every_stream(raw):
    assert _wires(_parse_request_selects(raw)) == {"*": LAST}


@pytest.mark.parametrize("raw", [{"attention_heads": LAST},
                                 json.dumps({"attention_heads": LAST})])
def test_per_stream_clauses(raw):
    assert _wires(_parse_request_selects(raw)) == {"attention_heads": LAST}


@pytest.mark.parametrize("raw, needle", [
    ("{not json", "not valid JSON"),
    ('["prompt"]', "expected a SelectSpec wire dict"),
    (7, "expected a SelectSpec wire dict"),
    ({"prompt_positons": [0]}, "prompt_positons"),
    (json.dumps({"hidden_states": {"prompt": "some"}}), "prompt"),
    (json.dumps({"prompt_positions": [10 ** 30]}), "prompt_positions.*out of range"),
    # A bad clause among per-stream ones names its stream.
    ({"hidden_states": {"prompt": "all"}, "attention_heads": "x"},
     "^attention_heads: SelectSpec wire form must be a dict"),
    ({"hidden_states": {}}, "^hidden_states: SelectSpec selects nothing"),
])
def test_bad_request_selects_name_the_problem(raw, needle):
    with pytest.raises(ValueError, match=needle):
        _parse_request_selects(raw)


@pytest.fixture
def decodes(monkeypatch):
    """The payloads decoded from here on (none remembered from before)."""
    from vllm_capture.session import session

    seen = []
    real = session._decode_request_selects

    def decode(raw):
        seen.append(raw)
        return real(raw)

    monkeypatch.setattr(session, "_DECODED_SELECTS", {})
    monkeypatch.setattr(session, "_decode_request_selects", decode)
    return seen


def test_requests_that_carry_one_clause_decode_it_once(decodes):
    reordered = dict(reversed(LAST.items()))
    first = _parse_request_selects(LAST)
    assert _parse_request_selects(reordered) is first
    assert _parse_request_selects({k: tuple(v) if isinstance(v, list) else v
                                   for k, v in LAST.items()}) is first
    text = json.dumps(LAST)
    assert _wires(_parse_request_selects(text)) == {"*": LAST}
    assert _parse_request_selects(text) is _parse_request_selects(text)
    assert len(decodes) == 2  # the dict (in either order, lists or tuples) and the text


def test_a_remembered_clause_does_not_stand_in_for_one_that_decodes_otherwise(decodes):
    assert _wires(_parse_request_selects({"prompt_positions": [1]})) == {
        "*": SelectSpec(prompt_positions=(1,)).to_wire()}
    for bad in ({"prompt_positions": [True]}, {"prompt_positions": [1.0]}):
        for _ in range(2):  # a bad payload fails every request that carries it
            with pytest.raises(ValueError, match="prompt_positions"):
                _parse_request_selects(bad)
    assert len(decodes) == 5


def test_numpy_payloads_decode_each_time(decodes):
    raw = {"prompt_positions": [np.int64(-1)]}
    assert _wires(_parse_request_selects(raw)) == {"*": LAST}
    _parse_request_selects(raw)
    assert len(decodes) == 2


def test_remembered_payloads_are_bounded(decodes, monkeypatch):
    from vllm_capture.session import session

    monkeypatch.setattr(session, "DECODED_SELECTS_KEPT", 4)
    for position in range(10):
        _parse_request_selects({"prompt_positions": [position]})
        assert len(session._DECODED_SELECTS) <= 4
