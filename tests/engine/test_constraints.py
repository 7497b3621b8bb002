"""The grammar constraint: the JSON-object recognizer on strings, the parts that frame it, and the logits processor
on a tiny vocabulary and on SmolLM2."""
import json
import math
import random
import sys

import pytest
import torch

from fastdecode.engine.constraints import (Alternatives, Choice, GrammarProcessor, JsonObject, Literal, Sequence,
                                           TokenTexts, json_object_grammar)
from fastdecode.errors import InvalidRequestError


def walk(grammar, text):
    """The state after `text`, or None once it leaves the grammar."""
    state = grammar.start
    for ch in text:
        state = grammar.step(state, ch)
        if state is None:
            return None
    return state


def accepts(grammar, text) -> bool:
    state = walk(grammar, text)
    return state is not None and grammar.done(state)


def random_value(rng, depth=0):
    r = rng.random()
    if depth < 3 and r < 0.3:
        return {f"k{rng.randint(0, 9)}\"\\é": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([0, 7, -2.5e10, 1.25, True, False, None, "", "tab\there\n", "\u2603 snow", "\x01"])


def test_every_serialised_object_is_accepted_and_each_prefix_stays_alive():
    rng, grammar = random.Random(0), json_object_grammar()
    for _ in range(300):
        value = {"x": random_value(rng)}
        for text in (json.dumps(value), json.dumps(value, indent=2), json.dumps(value, separators=(",", ":")),
                     json.dumps(value, ensure_ascii=False)):
            assert accepts(grammar, text), text
            assert all(walk(grammar, text[:k]) is not None for k in range(len(text)))
            assert not any(grammar.done(walk(grammar, text[:k])) for k in range(len(text)))


@pytest.mark.parametrize("text", [
    "[]", '"x"', "1",  # not an object
    '{"a": 01}', '{"a": 1.}', '{"a": 1e}', '{"a": -}', '{"a": .5}',  # bad numbers
    '{"a": 1,}', '{"a": [1,]}', "{,}",  # trailing commas
    '{"a" 1}', "{a: 1}", "{'a': 1}", '{"a": tru}', '{"a": True}',  # bad keys and literals
    '{"a": "\x01"}', '{"a": "\\x"}', '{"a": "\\u12G4"}',  # control character, bad escapes
    '{"a": 1}}', '{"a": 1} {"b": 2}', '{"a": 1}\n',  # anything after the object
])
def test_invalid_json_is_rejected(text):
    assert not accepts(json_object_grammar(), text)


def test_whitespace_runs_are_capped():
    assert accepts(json_object_grammar(), "{" + " " * 32 + "}")
    assert walk(json_object_grammar(), "{" + " " * 33) is None


def test_schema_keys_restrict_the_top_level_and_required_keys_must_appear():
    grammar = json_object_grammar({"type": "object", "properties": {"city": {}, "unit": {}}, "required": ["city"]})
    assert accepts(grammar, '{"city": "Oslo"}') and accepts(grammar, '{"unit": {"any": [1]}, "city": 2}')
    assert walk(grammar, '{"town"') is None  # not a property
    assert walk(grammar, '{"city": 1, "city"') is None  # each key once
    assert walk(grammar, '{"unit": 1}') is None  # city is required
    assert walk(grammar, '{"city": 1, "unit": 2,') is None  # no key left after the comma
    assert accepts(json_object_grammar({"type": "object", "properties": {}}), "{}")
    assert walk(json_object_grammar({"type": "object", "properties": {}}), '{"') is None


@pytest.mark.parametrize("schema", [{"properties": {"a": {}}, "required": 5}, {"properties": {}, "required": True},
                                    {"properties": {"a": {}}, "required": [1]}, {"properties": []}, 5])
def test_schema_with_properties_or_required_of_the_wrong_type_is_an_invalid_request(schema):
    with pytest.raises(InvalidRequestError):
        json_object_grammar(schema)


def test_keys_json_would_have_to_escape_are_not_offered():
    grammar = json_object_grammar({"properties": {"a\nb": {}, "tab\t": {}, "ok": {}}})
    assert walk(grammar, '{"a') is None and walk(grammar, '{"tab') is None and accepts(grammar, '{"ok": 1}')


def test_a_step_inside_a_key_costs_the_same_for_10_or_1000_keys():
    """Counted in calls (Python and builtin, as the profiler sees them), not timed: the same work whatever the keys."""
    def calls(n_keys: int) -> int:
        grammar = json_object_grammar({"properties": {f"z{i:04d}": {} for i in range(n_keys)}})
        state, count = walk(grammar, '{"z0'), 0

        def profile(frame, event, arg):
            nonlocal count
            count += 1
        sys.setprofile(profile)
        try:
            grammar.step(state, "0"), grammar.step(state, "x")  # a key continues; nothing continues
        finally:
            sys.setprofile(None)
        return count
    assert calls(1000) == calls(10)


def test_schema_that_allows_other_keys_restricts_nothing():
    grammar = json_object_grammar({"type": "object", "properties": {"a": {}}, "additionalProperties": True})
    assert accepts(grammar, '{"b": 1}')


def test_literal_choice_alternatives_in_sequence():
    grammar = Sequence([Literal("<"), Choice(["ab>", "ac>"]), Alternatives([
        Sequence([Literal("x="), JsonObject()]), Sequence([Literal("y="), JsonObject(keys=[])])]), Literal("!")])
    assert accepts(grammar, '<ab>x={"k": 1}!') and accepts(grammar, "<ac>y={}!")
    assert walk(grammar, '<ac>y={"') is None and walk(grammar, "<ad") is None
    assert not accepts(grammar, "<ab>x={}")  # the closing literal is due
    with pytest.raises(ValueError):
        Choice(["a", "ab"])


# ---- the processor on a toy vocabulary --------------------------------------------------------------------------
TEXTS = ["{", "}", '"a"', ":", " 1", "x", "", "<s>", '{"a": 1}', "]"]
EOS = 7  # "<s>", special


def toy_processor(first_only=False, grammar=None):
    texts = TokenTexts(TEXTS, frozenset({EOS}))
    return GrammarProcessor(grammar or json_object_grammar(), texts, [EOS], first_only=first_only)


def allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_processor_masks_tokens_that_leave_the_grammar():
    logits = torch.zeros(len(TEXTS))
    assert allowed(toy_processor()([], logits)) == {0, 8}  # "{" or the whole object; never "", "x" or EOS
    assert allowed(toy_processor()([0, 2, 3], logits)) == {0, 2, 4, 8}  # after '{"a":' a value: object, string, 1


def test_processor_allows_only_end_of_sequence_once_complete():
    assert allowed(toy_processor()([8], torch.zeros(len(TEXTS)))) == {EOS}


def test_greedy_keeps_the_likeliest_valid_token_only():
    logits = torch.tensor([1.0, 0, 0, 0, 0, 9, 0, 0, 2.0, 0])  # "x" is likeliest but invalid
    out = toy_processor(first_only=True)([], logits)
    assert allowed(out) == {8} and out[8] == 2.0


def test_processor_follows_rolled_back_drafts():
    p = toy_processor()
    logits = torch.zeros(len(TEXTS))
    assert allowed(p([0, 2, 3, 4], logits)) == {1}  # {"a": 1 -> close
    assert allowed(p([0], logits)) == {1, 2}  # a verifier rejected the draft: back to after "{"
    assert allowed(p([0, 2], logits)) == {3}


def test_a_dead_end_is_an_error_not_a_complete_reply():
    """After "{" only the required key "q" may follow, and no token spells it: ending the reply would return "{"."""
    p = toy_processor(grammar=json_object_grammar({"properties": {"q": {}}, "required": ["q"]}))
    with pytest.raises(InvalidRequestError):
        p([0], torch.zeros(len(TEXTS)))


def test_processor_keeps_real_logit_values():
    logits = torch.tensor([0.5, 0, 0, 0, 0, 0, 0, 0, -0.25, 0])
    out = toy_processor()([], logits)
    assert out[0] == 0.5 and out[8] == -0.25 and math.isinf(out[5])


# ---- on the real model ---------------------------------------------------------------------------------------
def test_smollm2_greedy_json_mode_gives_an_object(smollm2_path):
    from fastdecode import LLM, SamplingParams

    llm = LLM(str(smollm2_path), max_seq_len=256)
    texts = TokenTexts.from_tokenizer(llm.tokenizer)
    assert texts.texts[llm.tokenizer.encode(" world", add_special_tokens=False)[0]] == " world"
    processor = GrammarProcessor(json_object_grammar(), texts, llm.tokenizer.eos_token_ids, first_only=True)
    prompt = llm.chat_prompt([{"role": "user", "content": "Give a JSON object with a name and an age."}])
    *_, last = llm.stream(prompt, SamplingParams(max_tokens=120), processor)
    done = last.completion
    assert done.finish_reason == "stop" and isinstance(json.loads(done.text), dict), done.text


def test_a_typed_property_starts_its_value_as_its_type_does():
    """A forced tool call's "city": {"type": "string"} must get a string; an untyped or unknown one any value."""
    grammar = JsonObject.for_schema({"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "exact": {"type": ["boolean", "null"]},
        "any": {}, "odd": {"type": "tuple"}}})
    assert accepts(grammar, '{"city": "Oslo", "days": -3, "exact": null, "any": {"x": [1]}, "odd": [2]}')
    assert accepts(grammar, '{"exact": true}')
    for text in ('{"city": {', '{"city": 1', '{"days": "3"', '{"days": [', '{"exact": 0'):
        assert walk(grammar, text) is None, text
    assert walk(grammar, '{"city": "x", "x": [') is None  # unknown keys stay refused
