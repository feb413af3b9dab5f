"""JSON and YAML parsing that refuses duplicate keys, agreeing with the plain parsers elsewhere."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsmith.pack.format import dump_yaml
from shardsmith.strict_parse import DuplicateKeyError, loads_json, loads_yaml

plain = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**63) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(plain)
def test_documents_without_repeats_parse_as_the_plain_parsers_do(doc: object) -> None:
    assert loads_json(json.dumps(doc)) == json.loads(json.dumps(doc))
    if isinstance(doc, dict):
        assert loads_yaml(dump_yaml(doc)) == yaml.safe_load(dump_yaml(doc)) == doc


def test_json_lists_every_repeat_at_any_depth() -> None:
    with pytest.raises(DuplicateKeyError) as e:
        loads_json(b'{"a": 1, "b": {"c": 1, "c": 2}, "a": 3}')
    assert e.value.keys == [("c", None), ("a", None)]
    assert str(e.value) == "duplicate keys 'c', 'a': a key may appear once in a mapping"


def test_yaml_names_each_repeat_with_its_line() -> None:
    text = "source: junk\nworld_size: 2\nranks:\n  - {rank: 0, rank: 1}\nsource: real\n"
    with pytest.raises(DuplicateKeyError) as e:
        loads_yaml(text)
    assert e.value.keys == [("rank", 4), ("source", 5)]
    assert "'rank' (line 4), 'source' (line 5)" in str(e.value)


def test_yaml_keys_equal_after_resolution_are_repeats() -> None:
    """``1`` and ``0x1`` are the same integer key once resolved, as the loader would keep one."""
    with pytest.raises(DuplicateKeyError, match=r"duplicate key 1 \(line 2\)"):
        loads_yaml("1: a\n0x1: b\n")


def test_yaml_errors_stay_pyyaml_errors() -> None:
    with pytest.raises(yaml.YAMLError):
        loads_yaml("a: [1, 2\n")
