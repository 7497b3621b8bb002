"""json_problem, the check every call's arguments and every echoed request field pass: JSON that every client reads as
the same value, or the reason it is not."""
import pytest

from fastdecode.server.formats.base import MAX_DEPTH, json_problem, new_call


def nested(depth: int):
    value = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("value", [
    {"city": "Paris", "days": 3, "temp": -1.5, "ok": True, "none": None, "tags": ["a", {"b": []}]},
    {"emoji": "🌍", "big": 2**1000},  # an integer a double still holds
    nested(MAX_DEPTH),
])
def test_plain_json_has_no_problem(value):
    assert json_problem(value) is None


@pytest.mark.parametrize("value, problem", [
    ({"a": float("nan")}, "not finite"),
    ([float("inf")], "not finite"),
    ({"a": 2**1100}, "past a double's range"),  # what 1e999 is, written as an integer
    ({"a": "\ud800"}, "lone surrogate"),
    ({"\udfff": 1}, "lone surrogate"),  # in a key
    ({(1, 2): 3}, "key that is not a string"),
    ({1: "a"}, "key that is not a string"),
    ({"a": b"x"}, "bytes"),
    ({"a": 1j}, "complex"),
    ({"a": {1, 2}}, "set"),
    ([(1, 2)], "tuple"),
    (nested(MAX_DEPTH + 1), "levels deep"),
    (nested(100_000), "levels deep"),  # iterative: no RecursionError
])
def test_value_json_cannot_write_plainly_is_named(value, problem):
    assert problem in json_problem(value)


def test_call_whose_arguments_are_not_plain_json_is_no_call():
    assert new_call("f", '{"a": NaN}') is None and new_call("f", '{"a": 1e999}') is None
    assert new_call("f", '{"a": "\\ud800"}') is None and new_call("f", "[1]") is None
    assert new_call("f", '{"a": "\\ud83c\\udf0d"}')["function"]["arguments"] == '{"a": "\\ud83c\\udf0d"}'  # a pair
    assert new_call("f", {"a": 1})["function"]["arguments"] == '{"a": 1}'
