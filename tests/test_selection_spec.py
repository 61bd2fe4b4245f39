"""SelectSpec: validation, wire form and the semantics helpers the planner uses."""

import dataclasses
import json
import warnings

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.select_reference import selected
from vllm_capture.selection import SelectSpec

INCLUDES = (
    "prompt_tokens",
    "prompt_positions",
    "prompt_window",
    "generation_tokens",
    "generation_positions",
    "generation_window",
)
EXCLUDES = tuple(f"exclude_{name}" for name in INCLUDES)
ALL_KEYS = ("prompt", "generation") + INCLUDES + EXCLUDES


# ---- strategies (shared with tests/test_planner.py) -----------------------------------------

VOCAB = 5


def _valid(**kwargs) -> bool:
    try:
        SelectSpec(**kwargs)
    except ValueError:
        return False
    return True


def _opt_int(lo, hi):
    return st.none() | st.integers(lo, hi)


_token_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3)
_selector_values = {
    "prompt_tokens": _token_lists,
    "prompt_positions": st.lists(st.integers(-12, 12), min_size=1, max_size=3),
    "prompt_window": st.tuples(_opt_int(-12, 12), _opt_int(-12, 12)).filter(
        lambda w: _valid(prompt="all", prompt_window=w)
    ),
    "generation_tokens": _token_lists,
    "generation_positions": st.lists(st.integers(0, 8), min_size=1, max_size=3),
    "generation_window": st.tuples(st.integers(0, 8), _opt_int(0, 8)).filter(
        lambda w: _valid(generation="all", generation_window=w)
    ),
}


@st.composite
def select_spec_kwargs(draw) -> dict:
    """Clause fields with excludes only on covered phases and at least one phase covered."""
    phases = draw(st.sampled_from([("prompt",), ("generation",), ("prompt", "generation")]))
    kwargs = {}
    for phase in phases:
        kinds = [k for k in _selector_values if k.startswith(phase)]
        if draw(st.booleans()):
            kwargs[phase] = "all"
        for kind in kinds:
            if draw(st.integers(0, 2)) == 0:
                kwargs[kind] = draw(_selector_values[kind])
        if phase not in kwargs and not any(k in kwargs for k in kinds):
            kind = draw(st.sampled_from(kinds))
            kwargs[kind] = draw(_selector_values[kind])
        for kind in kinds:
            if draw(st.integers(0, 3)) == 0:
                kwargs[f"exclude_{kind}"] = draw(_selector_values[kind])
    return kwargs


@st.composite
def select_specs(draw) -> SelectSpec:
    """Valid clauses: those of ``select_spec_kwargs`` but the ones whose excludes leave a phase
    no row (refused; see test_excludes_that_leave_a_phase_no_row_are_refused)."""
    kwargs = draw(select_spec_kwargs())
    try:
        return SelectSpec(**kwargs)
    except ValueError as exc:
        assume("selects nothing" not in str(exc))
        raise


@given(select_spec_kwargs())
@settings(max_examples=400, deadline=None)
def test_excludes_that_leave_a_phase_no_row_are_refused(kwargs):
    """A clause refused because its excludes leave a phase no row selects, by the brute-force
    reference, no row of that phase at any prompt length, position or token: the refusal never
    takes a clause that would capture something there."""
    try:
        SelectSpec(**kwargs)
        return
    except ValueError as exc:
        if "selects nothing" not in str(exc):
            raise
        phase = "prompt" if "SelectSpec.exclude_prompt" in str(exc) else "generation"
    tokens = range(VOCAB + 1)
    for prompt_len in range(1, 14):
        indices = range(prompt_len) if phase == "prompt" else range(12)
        offset = 0 if phase == "prompt" else prompt_len
        assert not any(selected(kwargs, prompt_len, offset + i, t) for i in indices for t in tokens)


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({}, "selects nothing"),
        ({"prompt": "some"}, "prompt"),
        ({"prompt": ["all"]}, "prompt"),
        ({"generation": True}, "generation"),
        ({"prompt_tokens": []}, "prompt_tokens"),
        ({"prompt_tokens": [-1]}, "prompt_tokens"),
        ({"prompt_tokens": "12"}, "prompt_tokens"),
        ({"prompt_tokens": 3}, "prompt_tokens"),
        ({"generation_tokens": [1.0]}, "generation_tokens"),
        ({"prompt_positions": [True]}, "prompt_positions"),
        ({"prompt_positions": []}, "prompt_positions"),
        ({"generation_positions": [-1]}, "generation_positions"),
        ({"generation_positions": [0, "1"]}, "generation_positions"),
        ({"prompt": "all", "exclude_prompt_window": (None, None)}, "exclude_prompt_window"),
        ({"prompt_positions": [1], "exclude_prompt_window": (0, None)}, "exclude_prompt_window"),
        ({"prompt_positions": [3, -1], "exclude_prompt_positions": [-1, 3, 4]},
         "exclude_prompt_positions"),
        ({"generation_tokens": [2], "exclude_generation_tokens": [2, 3]},
         "exclude_generation_tokens"),
        ({"prompt_tokens": [1], "prompt_positions": [0], "exclude_prompt_tokens": [1],
          "exclude_prompt_positions": [0]}, "exclude_prompt_tokens and exclude_prompt_positions"),
        ({"prompt_window": (1,)}, "prompt_window"),
        ({"prompt_window": (1, 2, 3)}, "prompt_window"),
        ({"prompt_window": "ab"}, "prompt_window"),
        ({"prompt_window": (3, 3)}, "prompt_window"),
        ({"prompt_window": (5, 2)}, "prompt_window"),
        ({"prompt_window": (-2, -4)}, "prompt_window"),
        ({"prompt_window": (-3, 0)}, "prompt_window"),
        ({"prompt_window": (None, 0)}, "prompt_window"),
        ({"prompt_window": (0.5, 2)}, "prompt_window"),
        ({"generation_window": (-1, 5)}, "generation_window"),
        ({"generation_window": (1, -1)}, "generation_window"),
        ({"generation_window": (None, 3)}, "generation_window"),
        ({"generation_window": (3, 3)}, "generation_window"),
        ({"generation": "all", "exclude_prompt_tokens": [1]}, "exclude_prompt_tokens"),
        ({"generation": "all", "exclude_prompt_positions": [0]}, "exclude_prompt_positions"),
        ({"generation_tokens": [1], "exclude_prompt_window": (0, 2)}, "exclude_prompt_window"),
        ({"prompt": "all", "exclude_generation_window": (0, 2)}, "exclude_generation_window"),
        (
            {"prompt_positions": [0], "exclude_generation_positions": [0]},
            "exclude_generation_positions",
        ),
        ({"prompt": "all", "exclude_generation_tokens": [0]}, "exclude_generation_tokens"),
        # Exclude twins are validated like their includes.
        ({"prompt": "all", "exclude_prompt_tokens": []}, "exclude_prompt_tokens"),
        ({"prompt": "all", "exclude_prompt_window": (4, 1)}, "exclude_prompt_window"),
        (
            {"generation": "all", "exclude_generation_positions": [-2]},
            "exclude_generation_positions",
        ),
        ({"generation": "all", "exclude_generation_tokens": [False]}, "exclude_generation_tokens"),
        # Past int32 no label can match; past int64 numpy raised OverflowError mid-step.
        ({"prompt_positions": [2 ** 63]}, "prompt_positions.*out of range"),
        ({"prompt_tokens": [10 ** 30]}, "prompt_tokens.*out of range"),
        ({"generation_positions": [2 ** 31]}, "generation_positions.*out of range"),
        ({"prompt_window": (-(2 ** 70), None)}, "prompt_window.*out of range"),
    ],
)
def test_invalid_clauses_name_the_field(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SelectSpec(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"prompt_window": (2, -2)},  # mixed signs: non-empty for long prompts
        {"prompt_window": (-3, 2)},
        {"prompt_window": (None, -1)},
        {"prompt_window": (None, None)},
        {"prompt_window": (-5, None)},
        {"generation_window": (2, None)},
        {"prompt": "all", "exclude_prompt_window": (2, -2)},
        {"prompt_positions": [np.int64(-1), np.int32(3)]},
        {"prompt_positions": [2 ** 31 - 1, -(2 ** 31 - 1)]},
    ],
)
def test_valid_edge_clauses_accepted(kwargs):
    SelectSpec(**kwargs)


def test_normalisation_makes_equal_clauses_hash_equal():
    a = SelectSpec(prompt_tokens=[5, 3, 5], prompt_window=[-4, None], generation="all")
    b = SelectSpec(prompt_tokens=(3, 5), prompt_window=(-4, None), generation="all")
    assert a.prompt_tokens == (3, 5)
    assert a.prompt_window == (-4, None)
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a.interned() is b.interned()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.prompt = None


def test_keyword_only_and_unknown_keyword():
    with pytest.raises(TypeError):
        SelectSpec("all")
    with pytest.raises(TypeError, match="prompt_token"):
        SelectSpec(prompt_token=[1])


def test_convenience_constructors():
    assert SelectSpec.all() == SelectSpec(prompt="all", generation="all")
    assert SelectSpec.last_prompt_token() == SelectSpec(prompt_positions=[-1])


# ---- wire form --------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(select_specs())
def test_wire_round_trip(spec):
    wire = spec.to_wire()
    assert tuple(wire) == ALL_KEYS
    text = json.dumps(wire)
    assert SelectSpec.from_wire(wire) == spec
    assert SelectSpec.from_wire(json.loads(text)) == spec
    assert hash(SelectSpec.from_wire(json.loads(text))) == hash(spec)


def test_wire_values_are_plain_json():
    wire = SelectSpec(prompt_window=(-3, None), prompt_tokens=[2, 1]).to_wire()
    assert wire["prompt_window"] == [-3, None]
    assert wire["prompt_tokens"] == [1, 2]
    assert wire["generation"] is None and wire["exclude_generation_window"] is None
    assert all(type(v) in (list, str, type(None)) for v in wire.values())


def test_from_wire_accepts_missing_keys():
    assert SelectSpec.from_wire({"generation": "all"}) == SelectSpec(generation="all")


def test_from_wire_rejects_unknown_keys_naming_them():
    with pytest.raises(ValueError, match=r"unknown keys \['phases', 'tokens'\]"):
        SelectSpec.from_wire({"prompt": "all", "tokens": [1], "phases": ["prompt"]})


@pytest.mark.parametrize("data", [None, [], "prompt", [("prompt", "all")]])
def test_from_wire_rejects_non_dicts(data):
    with pytest.raises(ValueError, match="dict"):
        SelectSpec.from_wire(data)


def test_from_wire_revalidates():
    with pytest.raises(ValueError, match="generation_positions"):
        SelectSpec.from_wire({"generation_positions": [-1]})
    with pytest.raises(ValueError, match="prompt_window"):
        SelectSpec.from_wire({"prompt_window": [2.0, 4]})


# ---- semantics ----------------------------------------------------------------------------------


def test_last_prompt_token_resolves_against_any_length():
    spec = SelectSpec.last_prompt_token()
    for n in (1, 2, 7):
        assert spec.selected_prompt_positions(n).tolist() == [n - 1]


def test_positions_past_the_end_clamp_with_one_warning_per_spec():
    spec = SelectSpec(prompt_positions=[0, 99])
    with pytest.warns(UserWarning, match=r"prompt_positions.*99.*5-token prompt.*position 4"):
        assert spec.selected_prompt_positions(5).tolist() == [0, 4]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spec.selected_prompt_positions(3).tolist() == [0, 2]
        assert spec.selected_prompt_positions(200).tolist() == [0, 99]


def test_negative_positions_before_the_start_match_nothing_with_one_warning_per_spec():
    """"The last four tokens" of a 3-token prompt: -4 matches no row there, and says so once."""
    spec = SelectSpec(prompt_positions=[-4])
    with pytest.warns(UserWarning, match=r"prompt_positions: position -4 is before the start of "
                                         r"a 3-token prompt; it matches no row"):
        assert spec.selected_prompt_positions(3).tolist() == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert spec.selected_prompt_positions(2).tolist() == []
        assert spec.selected_prompt_positions(6).tolist() == [2]
    excluding = SelectSpec(prompt="all", exclude_prompt_positions=[-9])
    with pytest.warns(UserWarning, match=r"exclude_prompt_positions: position -9 is before"):
        assert excluding.selected_prompt_positions(2).tolist() == [0, 1]


def test_positions_inside_the_prompt_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SelectSpec(prompt_positions=[4, -5]).selected_prompt_positions(5).tolist() == [0, 4]


def test_exclude_positions_clamp_like_their_include_twin():
    spec = SelectSpec(prompt="all", exclude_prompt_positions=[50])
    with pytest.warns(UserWarning, match="exclude_prompt_positions"):
        assert spec.selected_prompt_positions(4).tolist() == [0, 1, 2]


def test_negative_positions_before_the_start_are_ignored():
    spec = SelectSpec(prompt_positions=[-6, -1])
    assert spec.selected_prompt_positions(5).tolist() == [4]
    assert spec.selected_prompt_positions(6).tolist() == [0, 5]


@settings(max_examples=300, deadline=None)
@given(
    window=st.tuples(_opt_int(-9, 9), _opt_int(-9, 9)).filter(
        lambda w: _valid(prompt_window=w)
    ),
    n=st.integers(1, 12),
)
def test_prompt_window_clamps_like_a_python_slice(window, n):
    spec = SelectSpec(prompt_window=window)
    assert spec.selected_prompt_positions(n).tolist() == list(range(n)[slice(*window)])


def test_prompt_tokens_need_the_prompt():
    spec = SelectSpec(prompt_tokens=[7], exclude_prompt_positions=[0])
    assert spec.selected_prompt_positions(4, [7, 1, 7, 7]).tolist() == [2, 3]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        spec.selected_prompt_positions(4)
    with pytest.raises(ValueError, match="3 ids"):
        spec.selected_prompt_positions(4, [7, 1, 7])


def test_excludes_always_subtract():
    spec = SelectSpec(
        prompt="all",
        prompt_tokens=[1],
        exclude_prompt_tokens=[1],
        exclude_prompt_window=(0, 2),
    )
    assert spec.selected_prompt_positions(5, [1, 2, 3, 1, 4]).tolist() == [2, 4]


def test_generation_matching_with_known_tokens():
    spec = SelectSpec(
        generation_positions=[0, 5],
        generation_window=(2, 4),
        generation_tokens=[9],
        exclude_generation_tokens=[8],
    )
    steps = np.arange(8)
    tokens = np.array([1, 1, 1, 8, 1, 1, 9, 1])
    match = spec.match_generation(steps, tokens)
    assert np.flatnonzero(match.keep).tolist() == [0, 2, 5, 6]
    assert not match.keep_unless_excluded.any() and not match.keep_if_included.any()


@pytest.mark.parametrize(
    "kwargs, keep, unless_excluded, if_included",
    [
        # Selection independent of the token: decided on the host.
        ({"generation": "all"}, [0, 1, 2, 3], [], []),
        ({"generation_window": (1, 3)}, [1, 2], [], []),
        ({"generation": "all", "exclude_generation_positions": [2]}, [0, 1, 3], [], []),
        # Included by position, token exclusion pending.
        ({"generation": "all", "exclude_generation_tokens": [4]}, [], [0, 1, 2, 3], []),
        (
            {"generation_positions": [0], "exclude_generation_tokens": [4]},
            [],
            [0],
            [],
        ),
        # Only a token can include it.
        ({"generation_tokens": [4]}, [], [], [0, 1, 2, 3]),
        (
            {
                "generation_tokens": [4],
                "generation_positions": [1],
                "exclude_generation_window": (3, None),
            },
            [1],
            [],
            [0, 2],
        ),
        ({"generation_tokens": [4], "generation_positions": [0], "exclude_generation_tokens": [4]},
         [], [0], []),
        # Only prompt rows covered.
        ({"prompt": "all"}, [], [], []),
    ],
)
def test_generation_matching_with_unknown_tokens(kwargs, keep, unless_excluded, if_included):
    match = SelectSpec(**kwargs).match_generation(np.arange(4), np.full(4, -1))
    assert np.flatnonzero(match.keep).tolist() == keep
    assert np.flatnonzero(match.keep_unless_excluded).tolist() == unless_excluded
    assert np.flatnonzero(match.keep_if_included).tolist() == if_included


def test_prompt_matching_with_per_row_prompt_lengths():
    spec = SelectSpec(prompt_positions=[-1], prompt_window=(0, 1))
    match = spec.match_prompt([0, 2, 0, 4, 3], [3, 3, 5, 5, 5], [1, 1, 1, 1, 1])
    assert match.keep.tolist() == [True, True, True, True, False]


def test_phase_coverage():
    assert SelectSpec(prompt_tokens=[1]).covers_prompt
    assert not SelectSpec(prompt_tokens=[1]).covers_generation
    assert SelectSpec(generation_window=(0, None)).covers_generation
    assert SelectSpec(prompt_tokens=[1]).reads_prompt_tokens
    assert SelectSpec(prompt="all", exclude_prompt_tokens=[1]).reads_prompt_tokens
    assert not SelectSpec.all().reads_prompt_tokens
