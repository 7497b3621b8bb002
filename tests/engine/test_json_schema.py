"""The limits on a JSON value in a request (a schema, a tool's parameters): how big or deep it may be."""
import pytest

from fastdecode.engine.json_schema import MAX_DEPTH, MAX_VALUES, check_size
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
