"""Structured outputs through the API, on the real SmolLM2 server: response_format json_schema (the whole schema),
the grammar and regex extension, vLLM's structured_outputs, llama.cpp's GBNF `grammar`, on Chat Completions and
Completions, and the 400s a grammar that cannot be used answers."""
import json
import re

import httpx
import jsonschema
import pytest

from tests.server.conftest import API_KEY

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Plan a trip: give the city, the number of days and what to pack."}]
TRIP = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "season": {"enum": ["spring", "summer", "autumn", "winter"]},
    "pack": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3}},
    "required": ["city", "days", "season", "pack"], "additionalProperties": False}


def post(server, path="/v1/chat/completions", **fields):
    body = {"model": MODEL, "max_tokens": 120, **fields}
    if path.endswith("chat/completions"):
        body.setdefault("messages", ASK)
    return httpx.post(server.base_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120)


def text_of(response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_is_valid_against_the_whole_schema(server, seed):
    response = post(server, temperature=1.0, seed=seed, response_format={
        "type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}})
    assert response.json()["choices"][0]["finish_reason"] == "stop", response.text
    jsonschema.validate(json.loads(text_of(response)), TRIP)


def test_regex_and_choice_and_lark_and_gbnf(server):
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", text_of(post(server, response_format={
        "type": "regex", "regex": "[A-Z]{3}-[0-9]{4}"})))
    assert text_of(post(server, structured_outputs={"choice": ["yes", "no", "maybe"]})) in ("yes", "no", "maybe")
    assert re.fullmatch(r"(add|sub) [0-9]{1,3}", text_of(post(server, response_format={
        "type": "grammar", "grammar": 'start: OP " " NUM\nOP: "add" | "sub"\nNUM: /[0-9]{1,3}/'})))
    assert re.fullmatch(r"answer: (yes|no)", text_of(post(server, grammar='root ::= "answer: " ("yes" | "no")')))


def test_completions_take_the_same_constraints(server):
    out = text_of(post(server, "/v1/completions", prompt="The capital of France is", max_tokens=40,
                       response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": {
                           "type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
                           "required": ["capital"], "additionalProperties": False}}}))
    assert set(json.loads(out)) == {"capital"}
    assert text_of(post(server, "/v1/completions", prompt="Is water wet?", structured_outputs={
        "regex": "(Yes|No)\\."})) in ("Yes.", "No.")


@pytest.mark.parametrize("fields,param,word", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "strin"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "required": 5}}}}, "response_format", ""),
    ({"response_format": {"type": "grammar", "grammar": "start: missing_rule"}}, "response_format", "missing_rule"),
    ({"response_format": {"type": "regex", "regex": "(unclosed"}}, "response_format", "regex"),
    ({"grammar": "root ::= ((("}, "grammar", "grammar"),
    ({"grammar": "\n".join(f'r{i} ::= r{i + 1} "x"' for i in range(1001)) + '\nr1001 ::= "y"\nroot ::= r0'},
     "grammar", "at most 1,000"),
    ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar", "both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}], "tool_choice": "required"},
     "tool_choice", "strin"),
])
def test_a_grammar_that_cannot_be_used_is_a_400_naming_its_parameter(server, fields, param, word):
    response = post(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and word in error["message"], error


def test_a_strict_schema_with_a_keyword_the_grammar_cannot_follow_is_refused_and_a_loose_one_is_not(server):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10}}, "required": ["a"],
              "additionalProperties": False, "dependentSchemas": {"a": {}}}
    strict = post(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                   "strict": True}})
    assert strict.status_code == 400, strict.text
    loose = post(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                                  "strict": False}})
    assert isinstance(json.loads(text_of(loose)), dict)
