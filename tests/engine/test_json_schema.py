"""The limits on a JSON Schema: what the grammar reads from it, and how big or deep it may be."""
import pytest

from fastdecode.engine.json_schema import (MAX_DEPTH, MAX_PROPERTIES, MAX_PROPERTY_CHARS, MAX_VALUES, check_size,
                                           object_keys)
from fastdecode.errors import InvalidRequestError


def nested(depth: int):
    value = {}
    for _ in range(depth - 1):
        value = {"items": value}
    return value


def test_size_limits_are_inclusive_and_named():
    check_size(nested(MAX_DEPTH), "the schema")
    check_size({"enum": list(range(MAX_VALUES - 2))}, "the schema")  # the object, the list, their items
    with pytest.raises(InvalidRequestError, match=str(MAX_DEPTH)):
        check_size(nested(MAX_DEPTH + 1), "the schema")
    with pytest.raises(InvalidRequestError, match=str(MAX_VALUES)):
        check_size({"enum": list(range(MAX_VALUES))}, "the schema")


def test_a_deeply_nested_schema_is_refused_without_recursion():
    with pytest.raises(InvalidRequestError):
        check_size(nested(100_000), "the schema")


def test_property_count_and_length_are_capped():
    object_keys({"properties": {f"k{i}": {} for i in range(MAX_PROPERTIES)}})
    with pytest.raises(InvalidRequestError, match=str(MAX_PROPERTIES)):
        object_keys({"properties": {f"k{i}": {} for i in range(MAX_PROPERTIES + 1)}})
    with pytest.raises(InvalidRequestError, match=str(MAX_PROPERTY_CHARS)):
        object_keys({"properties": {"k" * (MAX_PROPERTY_CHARS + 1): {}}})


def test_keys_and_required_keys_come_from_the_top_level():
    schema = {"properties": {"a": {"properties": {"inner": {}}}, "b": {}}, "required": ["b", "missing"]}
    assert object_keys(schema) == (["a", "b"], ["b"])
    assert object_keys({"properties": {"a": {}}, "additionalProperties": True}) is None
    assert object_keys({"type": "object"}) is None and object_keys(None) is None
