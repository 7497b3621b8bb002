"""Tokenizer: GGUF vocabularies against transformers' own GGUF tokenizer, chat templates, sandbox, bad files.

The reference tokenizers take ~15 s to build (Gemma's merges are derived in Python), so each is built once.
"""
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import normalizers
from tokenizers.models import BPE

from fastdecode.errors import InvalidRequestError, ModelFileError, UnsupportedModelError
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading import tokenizer as tokenizer_module
from fastdecode.loading.tokenizer import (GEMMA_TEMPLATE, Tokenizer, bytes_to_unicode, derive_merges, exact_splits,
                                          implied_merges, merge_pieces, order_merges)


BASE = [
    "", " ", "  ", "\t", "\n", "\n\n\n", " \n ", "\r\n", "a", "Hello world", " Hello world", "Hello world ",
    "  leading two", "trailing two  ", "tabs\tand\t\ttabs", "many     spaces     here", "line\nbreaks\n\nand\n\n\n",
    "def add(a, b):\n    return a + b\n", "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "fn main() {\n\tprintln!(\"{}\", 42);\n}", "SELECT id, name FROM users WHERE age >= 18;",
    "<div class=\"x\">&amp;</div>", "import numpy as np\nx = np.zeros((3, 4))  # shape",
    "#!/bin/bash\nfor f in *.txt; do echo \"$f\"; done", "{\"key\": [1, 2.5, null, true]}",
    "0", "7", "42", "2024", "3.14159", "1,000,000", "a1b2c3", "x  1", "a  12", "v1.2.3-rc4", "123456789012345",
    "日本語のテキストです。", "中文分词测试", "한국어 문장입니다", "Привет, мир!", "Ελληνικά",
    "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "café naïve résumé façade", "Ångström über straße",
    "e\u0301 combining", "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦", "🤗", "math ∑∫√∞ ≠ ≤", "zero\u200bwidth", "nbsp\u00a0here",
    "\u3000ideographic space",
    "don't won't I'm we'll they've she'd", "DON'T SHOUT", "CamelCaseIdentifier snake_case_name",
    "<|im_start|>user\nhi<|im_end|>\n", "<|im_start|><|im_end|>", "text<|endoftext|>more",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n", "<bos>hello<eos>", "<pad><unk>",
    "<unused0> and <mask>", "<0x0A> literal", "▁already▁spaced", "<|im_start", "im_end|>",
    "\x00\x01 control \x7f", "a\u2581b", "...!!!???", "---===***", "@user #tag $100 %50 ^&*",
]
JOINERS = ["", " ", "\n", "  ", "\t"]


def strings():
    """BASE plus every tenth pairing of it: 336 strings, no randomness."""
    out = list(BASE)
    for i, (a, b) in enumerate(itertools.islice(itertools.combinations(BASE, 2), 0, None, 10)):
        out.append(a + JOINERS[i % len(JOINERS)] + b)
    return out


def load(path: Path):
    return Tokenizer.from_gguf(GGUFFile(path).metadata)


def reference(path: Path):
    transformers = pytest.importorskip("transformers")
    # The backend AutoTokenizer.from_pretrained(dir, gguf_file=name) builds (checked equal), minus its config
    # lookup, which reads Gemma's whole file through gguf.GGUFReader first (~28 s).
    return transformers.TokenizersBackend.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm(smollm2_path):
    return load(smollm2_path)


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    return load(gemma3_path)


@pytest.fixture(scope="module")
def smollm_ref(smollm2_path):
    from tokenizers import pre_tokenizers

    ref = reference(smollm2_path)
    # transformers splits `smollm` text with GPT-2's regex; the upstream tokenizer.json and llama.cpp split digits
    # first (see tokenizer.DIGIT_SPLIT_PRES), which we follow. Give the reference the upstream pre-tokenizer.
    ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return ref


@pytest.fixture(scope="module")
def gemma_ref(gemma3_path):
    return reference(gemma3_path)


def mismatches(ours, ref, texts):
    bad = []
    for s in texts:
        ids, want = ours.encode(s), ref.encode(s)
        if ids != want:
            bad.append(("encode", s, ids, want))
        elif ours.encode(s, add_special_tokens=False) != ref.encode(s, add_special_tokens=False):
            bad.append(("encode without specials", s))
        elif ours.decode(ids) != ref.decode(want):
            bad.append(("decode", s, ours.decode(ids), ref.decode(want)))
        elif ours.decode(ids, skip_special_tokens=True) != ref.decode(want, skip_special_tokens=True):
            bad.append(("decode skipping specials", s))
    return bad


def test_smollm2_matches_transformers_on_300_strings(smollm, smollm_ref):
    texts = strings()
    assert len(texts) >= 200
    assert mismatches(smollm, smollm_ref, texts) == []


def test_gemma3_matches_transformers_on_300_strings(gemma, gemma_ref):
    assert mismatches(gemma, gemma_ref, strings()) == []


def random_texts(backend, n: int, seed: int = 0) -> list[str]:
    """Texts of vocabulary pieces, added tokens and single characters (some outside the vocabulary: byte fallback),
    joined at random: pairs that merge across pieces, runs of spaces and newlines, specials in the middle of words."""
    rng = np.random.default_rng(seed)
    size = backend.get_vocab_size()
    pieces = [backend.id_to_token(int(i)).replace("\u2581", " ") for i in rng.integers(0, size, 3000)]
    added = [t.content for t in backend.get_added_tokens_decoder().values()]
    chars = list(" \n\t  ab.,;:()[]{}=+-*/\\'\"#@é日本😀\u2581<>_0123456789\x00\u0301\U0010ffff")
    texts = []
    for _ in range(n):
        parts = []
        for _ in range(rng.integers(1, 40)):
            kind = rng.random()
            source = pieces if kind < 0.45 else added if kind < 0.5 and added else chars
            parts.append(source[rng.integers(len(source))])
        texts.append("".join(parts))
    return texts


@pytest.mark.parametrize("whole", [True, False], ids=["native-pipeline", "tokenizers-pipeline"])
def test_gemma3_implied_merges_encode_as_the_listed_merges_do(gemma3_path, whole):
    """The native table (ImpliedBPE) against `tokenizers` with all 515k merges listed, both ways it runs: Gemma's
    whole pipeline in the table, or `tokenizers` up to the model and the table merging."""
    tok = load(gemma3_path)
    assert tok.implied is not None and tok.implied.whole
    tok.implied.whole = whole
    listed = tok.complete_backend
    texts = strings() + random_texts(listed, 1500) + [" " * 40 + "x", "\n" * 70, "\t\t\n  \n", "<" * 50]
    for text in texts:
        for specials in (True, False):
            assert tok.encode(text, specials) == listed.encode(text, add_special_tokens=specials).ids, repr(text)


def tiny_sentencepiece(**changes) -> dict:
    """A llama-style vocabulary with scores and no merges, a repeated token, byte fallback for a few bytes only."""
    tokens = ["<unk>", "<s>", "</s>", "<0x41>", "<0xC3>", "<0xA9>", "\u2581", "a", "b", "c", "ab", "bc", "abc", "\u2581a",
              "\u2581ab", "ca", "cab", "bca", "ab", "<ctl>"]
    scores = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -2.0, -2.0, -3.0, -3.0, -5.0, -4.0, -6.0, -3.0, -7.0, -7.0,
              -3.5, 0.0]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 3 + [1] * 13 + [3],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    return {**meta, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()}}


@pytest.mark.parametrize("add_space_prefix", [True, False])
def test_a_sentencepiece_vocabulary_with_scores_merges_as_its_listed_merges_do(add_space_prefix):
    tok = Tokenizer.from_gguf(tiny_sentencepiece(add_space_prefix=add_space_prefix, add_eos_token=True))
    assert tok.implied is not None and not tok.implied.whole  # a Metaspace pre-tokenizer: tokenizers runs it
    listed = tok.complete_backend
    rng = np.random.default_rng(1)
    alphabet = ["a", "b", "c", " ", "A", "é", "z", "<ctl>", "ab", "ca"]
    texts = ["".join(alphabet[i] for i in rng.integers(len(alphabet), size=rng.integers(0, 12))) for _ in range(400)]
    for text in texts:
        for specials in (True, False):
            assert tok.encode(text, specials) == listed.encode(text, add_special_tokens=specials).ids, repr(text)
    # merged by score (the repeated "ab" takes its last id's), not one token per character
    want = ["\u2581a", "bc"] if add_space_prefix else ["abc"]
    assert [tok.backend.id_to_token(i) for i in tok.encode("abc", False)] == want


def test_without_the_native_table_the_merges_are_listed(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "spm_merges_module", lambda: None)
    tok = Tokenizer.from_gguf(tiny_sentencepiece())
    assert tok.implied is None and tok.complete_backend is tok.backend
    assert json.loads(tok.backend.to_str())["model"]["merges"]
    assert [tok.backend.id_to_token(i) for i in tok.encode("abc cab")] == ["<s>", "\u2581a", "bc", "\u2581", "cab"]


@pytest.mark.parametrize("name", ["smollm", "gemma"])
def test_no_text_takes_fewer_tokens_than_its_length_over_max_token_chars(name, request):
    """The bound the server refuses over-long prompts by before tokenizing them (prepare.can_fit): here with the
    texts that pack the most characters into a token (runs of one character, whitespace) and the 300 strings."""
    tok = request.getfixturevalue(name)
    per_token = tok.max_token_chars
    assert per_token and per_token < 100
    runs = [c * n for c in (" ", "\n", "\t", "a", "=", "-", "0", "\u4e00") for n in (1, 7, 64, 1000, 5000)]
    for text in runs + strings():
        assert len(tok.encode(text, add_special_tokens=False)) * per_token >= len(text), repr(text[:40])


def test_a_normalizer_that_can_shorten_text_gives_no_bound():
    backend = Backend(BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Replace(" ", "\u2581"), normalizers.Prepend("\u2581")])
    assert Tokenizer(backend, None, []).max_token_chars == 1
    backend.normalizer = normalizers.Replace("  ", " ")  # two spaces become one
    assert Tokenizer(backend, None, []).max_token_chars is None
    backend.normalizer = normalizers.Strip()
    assert Tokenizer(backend, None, []).max_token_chars is None


def same_model_and_added_tokens(ours, ref):
    ours, ref = json.loads(ours.complete_backend.to_str()), json.loads(ref.backend_tokenizer.to_str())
    added = lambda j: sorted((t["id"], t["content"], t["special"]) for t in j["added_tokens"])  # noqa: E731
    model = lambda j: [j["model"][k] for k in ("vocab", "merges", "unk_token", "fuse_unk", "byte_fallback")]  # noqa
    return model(ours) == model(ref) and added(ours) == added(ref)


def test_smollm2_vocab_merges_and_specials_equal_transformers(smollm, smollm_ref):
    assert same_model_and_added_tokens(smollm, smollm_ref)


def test_gemma3_vocab_derived_merges_and_specials_equal_transformers(gemma, gemma_ref):
    assert same_model_and_added_tokens(gemma, gemma_ref)  # all 514,906 merges, in order


def test_smollm2_splits_digits_like_its_upstream_tokenizer(smollm):
    # transformers' GGUF converter gives 'a','Ġ','Ġ','1'; the model was trained on 'ĠĠ' before a digit.
    assert [smollm.backend.id_to_token(i) for i in smollm.encode("a  12")] == ["a", "ĠĠ", "1", "2"]


def test_special_tokens_and_bos_per_model(smollm, gemma):
    assert smollm.encode("<|im_start|>") == [1] and smollm.encode("") == []  # SmolLM2 adds no BOS
    assert gemma.encode("") == [2] and gemma.encode("<start_of_turn>", add_special_tokens=False) == [105]
    assert (smollm.vocab_size, gemma.vocab_size) == (49152, 262144)
    assert (smollm.bos_token_id, gemma.bos_token_id) == (1, 2)


def test_eos_ids_include_end_of_turn_tokens(smollm, gemma):
    assert smollm.eos_token_ids[0] == 2 and smollm.backend.token_to_id("<|endoftext|>") in smollm.eos_token_ids
    assert gemma.eos_token_ids == [1, gemma.backend.token_to_id("<end_of_turn>")]


CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke.\n"}],
    [{"role": "user", "content": "héllo 日本"}, {"role": "assistant", "content": "  spaced  "}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smollm, smollm_ref, generation_prompt):
    for messages in CONVERSATIONS:
        want = smollm_ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        assert smollm.apply_chat_template(messages, add_generation_prompt=generation_prompt) == want


def test_gemma3_without_template_uses_official_one_with_system_folded(gemma):
    assert gemma.chat_template == GEMMA_TEMPLATE
    got = gemma.apply_chat_template(CONVERSATIONS[1])
    assert got == "<bos><start_of_turn>user\nYou are terse.\n\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n"
    # the template writes <bos> itself, so a chat prompt is encoded without adding another
    assert gemma.encode(got, add_special_tokens=False)[:2] == [2, 105]


def test_template_error_is_an_invalid_request(gemma):
    with pytest.raises(InvalidRequestError, match="must alternate"):
        gemma.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ---- model-free: a tiny byte-level vocabulary ---------------------------------------------------------------------
def tiny_gpt2(**changes) -> dict:
    byte_chars = list(bytes_to_unicode().values())
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *byte_chars, "he", "ll", "hell", "hello", "Ġw"]
    meta = {"general.architecture": "llama", "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [3, 3, 3] + [1] * (len(tokens) - 3),
            "tokenizer.ggml.merges": ["h e", "l l", "he ll", "hell o", "Ġ w"],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    return {**meta, **{f"tokenizer.ggml.{k}": v for k, v in changes.items()}}


@pytest.fixture
def tiny():
    return Tokenizer.from_gguf(tiny_gpt2())


def test_tiny_vocabulary_merges_and_keeps_specials_whole(tiny):
    ids = tiny.encode("hello<|im_end|> w")
    assert [tiny.backend.id_to_token(i) for i in ids] == ["hello", "<|im_end|>", "Ġw"]
    assert tiny.decode(ids, skip_special_tokens=True) == "hello w"


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # walk to every loaded class
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",  # reach a module through a function's globals
    "{% set _ = messages.append({'role': 'x'}) %}",  # mutate the caller's data
])
def test_sandbox_blocks_template_escapes(tiny, template):
    tiny.chat_template = template
    with pytest.raises(InvalidRequestError):
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_helpers_match_transformers(tiny):
    tiny.chat_template = ("{{ bos_token }}{{ tools | tojson }}{{ strftime_now('%Y') | length }}"
                          "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}{{ eos_token }}")
    tools = [{"name": "météo", "tag": "<b>"}]
    assert tiny.apply_chat_template([{"role": "user"}], tools=tools) == "<|im_start|>" + json.dumps(
        tools, ensure_ascii=False) + "4<|im_end|>"
    with pytest.raises(InvalidRequestError, match="no messages"):
        tiny.apply_chat_template([])


def test_default_template_is_chatml(tiny):
    assert tiny.apply_chat_template([{"role": "user", "content": "hi", "tool_calls": None}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("changes, error", [
    ({"tokens": None}, ModelFileError),  # no vocabulary at all
    ({"model": "rwkv"}, UnsupportedModelError),
    ({"token_type": [1, 3]}, ModelFileError),  # one type per token
    ({"merges": ["h e", "x yz"]}, ModelFileError),  # a merge of tokens the vocabulary lacks
    ({"merges": ["h e l"]}, ModelFileError),
    ({"merges": None}, ModelFileError),
    ({"eos_token_id": 10**6}, ModelFileError),
])
def test_malformed_vocabulary_raises_one_clear_error(changes, error):
    with pytest.raises(error) as info:
        Tokenizer.from_gguf(tiny_gpt2(**changes))
    assert "\n" not in str(info.value)


def test_from_hf_dir_reads_tokenizer_json_config_and_eos_ids(tiny, tmp_path):
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
        "chat_template": [{"name": "default", "template": "default {{ messages | length }}"}]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hello") == [1, tiny.encode("hello")[0]]
    assert tok.eos_token_ids == [2, 0] and tok.bos_token_id == 1
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "default 1"
    (tmp_path / "chat_template.jinja").write_text("from jinja file")  # takes precedence, as in transformers
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([]) == "from jinja file"


def test_from_hf_dir_without_tokenizer_json_is_a_model_file_error(tmp_path):
    with pytest.raises(ModelFileError):
        Tokenizer.from_hf_dir(tmp_path)


# ---- merges derived from a vocabulary ----------------------------------------------------------------------------
def test_derived_merges_match_transformers_generate_merges():
    generate_merges = pytest.importorskip("transformers.tokenization_utils_base").generate_merges
    # ties in score, pieces of several lengths, a token with no split, and a non-ASCII one
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "▁", "▁a", "▁ab", "é", "éa", "zz"]
    scores = [0.0, 0.0, 0.0, -1.0, -1.0, -2.0, -2.0, -3.0, 0.0, -1.0, -2.0, 0.0, -1.0, -5.0]
    want = generate_merges({t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores)))
    assert derive_merges(tokens, np.array(scores)) == want


def test_vectorised_splits_equal_plain_loop_on_a_real_vocabulary(smollm2_path):
    tokens = list(dict.fromkeys(GGUFFile(smollm2_path).metadata["tokenizer.ggml.tokens"]))
    priority = -np.arange(len(tokens), dtype=np.float64)
    assert np.array_equal(merge_pieces(tokens, priority), order_merges(tokens, priority, *exact_splits(tokens)))


def test_implied_merges_are_kept_by_vocabulary_and_a_bad_kept_file_is_derived_again(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTDECODE_HOME", str(tmp_path))
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab"]
    priority = -np.arange(len(tokens), dtype=np.float64)
    want, reverse = derive_merges(tokens, priority), derive_merges(tokens, priority[::-1].copy())
    assert implied_merges(tokens, priority) == want
    [kept] = (tmp_path / "tokenizers").iterdir()
    derived = []
    monkeypatch.setattr(tokenizer_module, "merge_pieces",
                        lambda *a: derived.append(1) or merge_pieces(*a))
    assert implied_merges(tokens, priority) == want and derived == []  # read back, not derived
    # other priorities: another file, other merges
    assert implied_merges(tokens, priority[::-1].copy()) == reverse != want and derived == [1]
    for bad in (b"not an array", np.array([[0, 99], [1, 2]], np.int32), np.zeros((3, 2), np.int64)):
        if isinstance(bad, bytes):
            kept.write_bytes(bad)
        else:
            np.save(kept, bad)
        assert implied_merges(tokens, priority) == want  # an index past the vocabulary, a wrong shape or dtype
    assert len(derived) == 4 and read_back(kept).shape == (2, len(want))


def read_back(path):
    return np.load(path, allow_pickle=False)


def test_harmony_replies_end_at_return_or_call_not_at_each_messages_end(tiny):
    """gpt-oss ends each message of a reply (its reasoning, then its answer) with <|end|>: stopping there would cut
    the reply after its reasoning."""
    backend = Backend.from_str(tiny.backend.to_str())
    backend.add_special_tokens(["<|end|>", "<|return|>", "<|call|>"])
    end, ret, call = map(backend.token_to_id, ("<|end|>", "<|return|>", "<|call|>"))
    tok = Tokenizer(backend, None, [end])  # a file naming <|end|> its end token is read the same way
    assert end not in tok.eos_token_ids and {ret, call} <= set(tok.eos_token_ids)
    phi = Backend.from_str(tiny.backend.to_str())
    phi.add_special_tokens(["<|end|>"])  # Phi-3: <|end|> does end the turn
    assert phi.token_to_id("<|end|>") in Tokenizer(phi, None, []).eos_token_ids


def test_the_collector_is_off_while_a_tokenizer_loads_and_as_it_was_after(monkeypatch):
    import gc

    from fastdecode import loading

    seen = []
    monkeypatch.setattr(Tokenizer, "from_hf_dir", classmethod(lambda cls, path: seen.append(gc.isenabled())))
    assert gc.isenabled()
    loading.load_tokenizer(Path(__file__).parent)  # a directory: from_hf_dir's path
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        loading.load_tokenizer(Path(__file__).parent)
        assert not gc.isenabled()  # left off where the caller had it off
    finally:
        gc.enable()
