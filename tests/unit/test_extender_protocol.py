"""The extender's prioritize answer written as JSON directly equals the dicts through json."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st
from kvgpu.extender.protocol import MAX_EXTENDER_PRIORITY, priority_json, priority_list

names = st.one_of(
    st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,30}[a-z0-9])?", fullmatch=True),  # what node names look like
    st.text(max_size=20),  # anything else: quotes, backslashes, control and non-ASCII characters
)


@given(st.dictionaries(names, st.integers(min_value=-50, max_value=250), max_size=60))
def test_priority_json_is_the_priority_list(scores: dict[str, int]) -> None:
    assert json.loads(priority_json(scores)) == priority_list(scores)


@given(st.dictionaries(names, st.integers(min_value=-1000, max_value=1000), max_size=30))
def test_scores_are_on_the_extender_scale(scores: dict[str, int]) -> None:
    out = priority_list(scores)
    assert [e["host"] for e in out] == list(scores)
    assert all(0 <= e["score"] <= MAX_EXTENDER_PRIORITY for e in out)
    assert all(e["score"] == round(scores[e["host"]] / 10) for e in out if 0 <= scores[e["host"]] <= 100)
