"""Per-request selections as they arrive in SamplingParams.extra_args["capture"]."""

import json

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
