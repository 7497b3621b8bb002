"""Constrained decoding on llguidance: the grammars a request can ask for, on SmolLM2's vocabulary, the logits
processor's mask, and generation under a grammar (greedy output unchanged where the grammar allows the model's own
choice; speculation and batching unchanged under a grammar)."""
import json
import math
import random

import numpy as np
import pytest
import torch

from fastdecode.engine.grammar import (
    GrammarCompiler,
    GrammarProcessor,
    json_schema_grammar,
    lark_grammar,
    lark_json,
    regex_grammar,
)
from fastdecode.errors import InvalidRequestError
from fastdecode.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return load_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer)


def accepts(compiler, grammar: str, text: str) -> bool:
    """Whether `text` is a complete output of `grammar` (llguidance checks bytes, so one tokenization will do)."""
    matcher = compiler.matcher(grammar)
    ids = compiler.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def random_value(rng, depth=0):
    r = rng.random()
    if depth < 3 and r < 0.3:
        return {f"k{rng.randint(0, 9)}\"\\é": random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    if depth < 3 and r < 0.5:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return rng.choice([0, 7, -2.5e10, 1.25, True, False, None, "", "tab\there\n", "\u2603 snow", "\x01"])


def test_every_object_json_writes_is_accepted(compiler):
    rng, grammar = random.Random(0), json_schema_grammar(None)
    for _ in range(100):
        value = {"x": random_value(rng)}
        for text in (json.dumps(value), json.dumps(value, ensure_ascii=False)):
            assert accepts(compiler, grammar, text), text


@pytest.mark.parametrize("text", [
    "[]", '"x"', "1",  # not an object
    '{"a": 01}', '{"a": 1.}', '{"a": 1e}', '{"a": -}', '{"a": .5}',  # bad numbers
    '{"a": 1,}', '{"a": [1,]}', "{,}",  # trailing commas
    '{"a" 1}', "{a: 1}", "{'a': 1}", '{"a": tru}', '{"a": True}',  # bad keys and literals
    '{"a": "\x01"}', '{"a": "\\x"}', '{"a": "\\u12G4"}',  # control character, bad escapes
    '{"a": 1}}', '{"a": 1} {"b": 2}',  # anything after the object
    '{"a":1}', '{\n  "a": 1\n}',  # whitespace other than OpenAI's ", " and ": " (free whitespace lets a model loop)
])
def test_invalid_json_is_rejected(compiler, text):
    assert not accepts(compiler, json_schema_grammar(None), text)


def test_a_schema_is_followed_at_every_depth(compiler):
    schema = {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"enum": ["c", "f"]}, "stops": {"type": "array", "items": {"$ref": "#/$defs/stop"}, "maxItems": 2},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "pattern": "^[a-z]+$"}]}},
        "required": ["city", "days"], "additionalProperties": False,
        "$defs": {"stop": {"type": "object", "properties": {"at": {"type": "string", "format": "date"}},
                           "required": ["at"], "additionalProperties": False}}}
    grammar = json_schema_grammar(schema)
    assert accepts(compiler, grammar, '{"city": "Oslo", "days": 3}')
    assert accepts(compiler, grammar, '{"city": "Oslo", "days": 14, "unit": "f", "stops": [{"at": "2026-01-31"}], '
                                      '"note": null}')
    for text in ('{"city": "Oslo"}',  # days is required
                 '{"city": "Oslo", "days": 0}', '{"city": "Oslo", "days": 2.5}',  # minimum, integer
                 '{"city": "Oslo-Bergen", "days": 3}',  # maxLength
                 '{"city": "Oslo", "days": 3, "unit": "k"}',  # enum
                 '{"city": "Oslo", "days": 3, "stops": [{"at": "yesterday"}]}',  # format, through $ref
                 '{"city": "Oslo", "days": 3, "stops": [{"at": "2026-01-01"}, {"at": "2026-01-02"}, '
                 '{"at": "2026-01-03"}]}',  # maxItems
                 '{"city": "Oslo", "days": 3, "note": "A"}',  # pattern inside anyOf
                 '{"city": "Oslo", "days": 3, "x": 1}'):  # additionalProperties
        assert not accepts(compiler, grammar, text), text


def test_regex_and_lark_grammars(compiler):
    assert accepts(compiler, regex_grammar(r"[0-9]{3}-[a-z]{2}"), "123-ab")
    assert not accepts(compiler, regex_grammar(r"[0-9]{3}-[a-z]{2}"), "123-abc")
    lark = lark_grammar('start: "call " name " " args\nname: /[a-z]+/\nargs: ' + lark_json(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    assert accepts(compiler, lark, 'call add {"n": 2}')
    assert not accepts(compiler, lark, 'call add {"n": "2"}')


@pytest.mark.parametrize("schema,message", [({"type": "strin"}, "strin"), ({"$ref": "#/$defs/missing"}, "missing"),
                                             ({"type": "string", "pattern": "("}, "regex")])
def test_a_schema_llguidance_cannot_use_is_an_invalid_request_naming_why(compiler, schema, message):
    with pytest.raises(InvalidRequestError, match=message):
        compiler.matcher(json_schema_grammar(schema), what="response_format")


def test_an_unimplemented_keyword_is_refused_when_strict_and_ignored_when_not(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "dependentSchemas": {"a": {}}}
    with pytest.raises(InvalidRequestError):
        compiler.matcher(json_schema_grammar(schema, strict=True))
    assert accepts(compiler, json_schema_grammar(schema, strict=False), '{"a": "x"}')


def test_matchers_of_one_grammar_are_independent(compiler, tokenizer):
    grammar = json_schema_grammar({"type": "object", "properties": {"zz": {"type": "integer"}}})
    first, second = compiler.matcher(grammar), compiler.matcher(grammar)
    first.consume_tokens(tokenizer.encode('{"zz": 1', add_special_tokens=False))
    assert second.try_consume_tokens(tokenizer.encode("{", add_special_tokens=False)) == 1  # untouched by first


# ---- the processor --------------------------------------------------------------------------------------------
def processor(compiler, grammar: str, **kw) -> GrammarProcessor:
    eos = compiler.tokenizer.eos_token_ids
    return GrammarProcessor(compiler.matcher(grammar), compiler.vocab_size, eos, **kw)


def allowed(logits: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(logits)).flatten().tolist())


def test_the_mask_holds_exactly_the_tokens_that_continue_the_grammar(compiler, tokenizer):
    p = processor(compiler, regex_grammar("(yes|no)"))
    out = p([], torch.zeros(compiler.vocab_size))
    texts = {tokenizer.decode([t]) for t in allowed(out)}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert allowed(p(yes, torch.zeros(compiler.vocab_size))) <= set(tokenizer.eos_token_ids)  # complete: only EOS


def test_accepts_agrees_with_the_mask(compiler, tokenizer):
    grammar = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                   "additionalProperties": False})
    ids = tokenizer.encode('{"n": 12}', add_special_tokens=False)
    p = processor(compiler, grammar)
    for k in range(len(ids) + 1):
        mask = allowed(p(ids[:k], torch.zeros(compiler.vocab_size)))
        sample = random.Random(k).sample(range(compiler.vocab_size), 300) + list(mask)[:50] + \
            tokenizer.eos_token_ids
        assert {t for t in sample if p.accepts(ids[:k], t)} == mask & set(sample), k


def test_logits_keep_their_values_and_bias_comes_first(compiler, tokenizer):
    yes, no = (tokenizer.encode(w, add_special_tokens=False)[0] for w in ("yes", "no"))
    logits = torch.randn(compiler.vocab_size)
    bias = torch.zeros(compiler.vocab_size)
    bias[no] = 5.0
    p = processor(compiler, regex_grammar("(yes|no)"), bias=bias)
    out = p([], logits)
    assert out[yes] == logits[yes] and out[no] == logits[no] + 5 and math.isinf(out[tokenizer.eos_token_ids[0]])
    assert torch.equal(p.unmasked(logits), logits + bias)


def test_sampling_under_a_grammar_draws_from_the_masked_distribution(compiler, tokenizer):
    """Sampler draws without the mask and draws again with it when the grammar refuses: the frequencies must be
    softmax over the allowed tokens alone (chi-square against it, 4,000 draws)."""
    from fastdecode.engine.sampling import Sampler, SamplingParams
    words = ["red", "green", "blue", "cyan"]
    ids = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    logits = torch.full((compiler.vocab_size,), -4.0)
    logits[ids] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    logits[100:110] = 2.5  # likely tokens the grammar refuses: half the draws need the mask
    grammar = regex_grammar("(red|green|blue|cyan)")
    allowed_ids = sorted(allowed(processor(compiler, grammar)([], logits)))  # the words, and prefixes of them
    probs = torch.softmax(logits[allowed_ids], -1)
    rest = [i for i in allowed_ids if i not in ids]
    expected = torch.tensor([float(probs[allowed_ids.index(i)]) for i in ids] + [1 - sum(
        float(probs[allowed_ids.index(i)]) for i in ids)])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0), compiler.vocab_size, [], processor(compiler, grammar))
    draws = [sampler.sample(logits) for _ in range(4000)]
    assert set(draws) <= set(allowed_ids)
    counts = torch.tensor([draws.count(i) for i in ids] + [sum(draws.count(i) for i in rest)], dtype=torch.float)
    chi2 = float(((counts - 4000 * expected) ** 2 / (4000 * expected)).sum())
    assert chi2 < 18.5, (counts, expected)  # p = 0.001 at 4 degrees of freedom


def test_the_processor_follows_rolled_back_drafts(compiler, tokenizer):
    grammar = json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                   "additionalProperties": False})
    p = processor(compiler, grammar)
    ids = tokenizer.encode('{"a": 12}', add_special_tokens=False)
    zeros = torch.zeros(compiler.vocab_size)
    assert allowed(p(ids, zeros)) <= set(tokenizer.eos_token_ids)
    assert allowed(p(ids[:1], zeros)) == allowed(processor(compiler, grammar)(ids[:1], zeros))  # rolled back
    assert p.draft_prefix(ids[:1], ids[1:]) == len(ids) - 1
    wrong = tokenizer.encode('"b"', add_special_tokens=False)
    assert p.draft_prefix(ids[:1], wrong) == 0


def test_output_outside_the_grammar_is_an_error(compiler, tokenizer):
    p = processor(compiler, regex_grammar("(yes|no)"))
    with pytest.raises(InvalidRequestError, match="left the grammar"):
        p(tokenizer.encode("maybe", add_special_tokens=False), torch.zeros(compiler.vocab_size))


def test_a_dead_end_is_an_error_not_a_complete_reply(compiler):
    """The grammar's only next token lies past the logits the model gives: ending the reply here would hand back
    output that breaks the grammar as if it were complete."""
    p = processor(compiler, lark_grammar("start: <[49151]>"))
    assert allowed(p([], torch.zeros(compiler.vocab_size))) == {49151}
    with pytest.raises(InvalidRequestError, match="cannot continue"):
        processor(compiler, lark_grammar("start: <[49151]>"))([], torch.zeros(100))


def test_the_mask_covers_logits_past_the_vocabulary(compiler):
    """A model's embedding may be padded past the tokenizer's vocabulary: those rows are never allowed."""
    out = processor(compiler, regex_grammar("a"))([], torch.zeros(compiler.vocab_size + 64))
    assert np.isinf(out[compiler.vocab_size:].numpy()).all()


# ---- on the real model ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(smollm2_path):
    from fastdecode import LLM
    return LLM(str(smollm2_path), max_seq_len=512, threads=2)


PROMPTS = ["Give a JSON object with a name and an age.", "Write a haiku about the sea.", "List three colors.",
           "What is 2 + 2?"]


def greedy(llm, prompts, processors, speculate=None):
    """Greedy outputs of chat `prompts`, submitted together (the engine batches them)."""
    from fastdecode import SamplingParams
    streams = [llm.stream(llm.chat_prompt([{"role": "user", "content": p}]), SamplingParams(max_tokens=40), proc)
               for p, proc in zip(prompts, processors)]
    return [llm._last(s).token_ids for s in streams]


def test_greedy_under_a_grammar_that_allows_everything_is_the_unconstrained_output(llm):
    compiler = GrammarCompiler(llm.tokenizer)
    free = [None] * len(PROMPTS)
    anything = [processor(compiler, lark_grammar("start: /(?s:.*)/")) for _ in PROMPTS]
    assert greedy(llm, PROMPTS, anything) == greedy(llm, PROMPTS, free)


def test_json_mode_alone_and_in_a_batch_agree_and_parse(llm):
    compiler = GrammarCompiler(llm.tokenizer)
    grammar = json_schema_grammar({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                                    "age": {"type": "integer"}},
                                   "required": ["name", "age"], "additionalProperties": False})

    def made():
        return processor(compiler, grammar)
    batch = greedy(llm, PROMPTS, [made() for _ in PROMPTS])
    alone = [greedy(llm, [p], [made()])[0] for p in PROMPTS[:2]]
    assert batch[:2] == alone
    for ids in batch:
        text = llm.tokenizer.decode(ids, skip_special_tokens=True)
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), text
