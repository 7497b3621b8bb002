"""Tokenizer: a Hugging Face `tokenizers.Tokenizer` built from a GGUF vocabulary or a model directory, plus chat
templates, rendered in a jinja2 sandbox within limits (chat_template.py).

A GGUF file has no tokenizer.json, only llama.cpp's vocabulary keys. `from_gguf` rebuilds the pipeline that
transformers' GGUF converter builds (integrations/gguf/gguf_tokenizer_mapping.py) without importing transformers,
except where llama.cpp and the upstream tokenizer.json agree against it (see DIGIT_SPLIT_PRES).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from fastdecode.errors import InvalidRequestError, ModelFileError, UnsupportedModelError

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types
MERGES_FORMAT = 1  # of the kept merges (implied_merges): a change of their order or layout changes it
# Tokens a chat model ends its turn with; generation stops on them as well as on EOS (llama.cpp's EOG list).
END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<|endoftext|>",
               "<|end_of_text|>", "<EOT>", "<｜end▁of▁sentence｜>", "<|return|>")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
               r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex applied before the byte-level mapping; anything else gets GPT-2's regex.
PRE_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral"),
                              LLAMA3_SPLIT),
              **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), QWEN2_SPLIT),
              **dict.fromkeys(("gpt-4o", "llama4"), GPT4O_SPLIT)}
# These vocabularies were trained with every digit on its own (upstream tokenizer.json: Digits + ByteLevel, and
# llama.cpp splits \p{N} first). transformers' GGUF converter uses plain GPT-2 splitting here, which differs on
# e.g. "a  1" (it gives 'Ġ','Ġ' where the model was trained on 'ĠĠ').
DIGIT_SPLIT_PRES = {"smollm", "starcoder", "refact", "codeshell"}

CHATML_TEMPLATE = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
                   "'<|im_end|>' + '\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma 3's official template (the GGUF files often omit it): no system role, it is folded into the first user turn.
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""


class Tokenizer:
    """Text <-> token ids and chat prompts for one model; `backend` is the `tokenizers.Tokenizer` doing the work.
    Where `implied` is given (a SentencePiece vocabulary without a merge list), the backend's BPE holds no merges
    and `implied` merges its output: encode through `encode`, export through `complete_backend`."""

    def __init__(self, backend: Backend, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None = None, implied: ImpliedBPE | None = None):
        self.backend = backend
        self.implied = implied
        self.bos_token_id = bos_token_id
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.special_ids = set(added.values())
        ends = [*eos_token_ids, *(added[t] for t in END_OF_TURN if t in added)]
        if "<|return|>" in added and "<|call|>" in added:
            # Harmony (gpt-oss), as llama.cpp reads it: <|end|> closes each message of a reply (the reasoning before
            # the answer), so the reply ends at <|return|> or at a tool call's <|call|>.
            ends = [i for i in ends if i != added.get("<|end|>")] + [added["<|call|>"]]
        self.eos_token_ids = list(dict.fromkeys(ends))
        if chat_template is None:
            chat_template = GEMMA_TEMPLATE if backend.token_to_id("<start_of_turn>") is not None else CHATML_TEMPLATE
        self.chat_template = chat_template
        self._compiled = (None, None)  # (source, template): compiled on first use, again if chat_template changes

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can cover: its vocabulary entry's length (byte-level entries spell
        one character per byte, SentencePiece ones the text itself), so n characters take at least n / this many
        tokens, and a prompt that cannot fit in any context is refused before it is tokenized. None where a
        normalizer could shorten the text (only character-for-character replacements and prefixes are known safe)."""
        normalizer = self.backend.normalizer
        if not length_preserving(None if normalizer is None else json.loads(normalizer.__getstate__())):
            return None
        return max(map(len, self.backend.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.implied is not None:
            return self.implied.encode(self.backend, text, add_special_tokens)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    @functools.cached_property
    def complete_backend(self) -> Backend:
        """The whole `tokenizers` pipeline, merges included: what a checkpoint's tokenizer.json holds."""
        if self.implied is None:
            return self.backend
        complete = Backend.from_str(self.backend.to_str())
        complete.model = self.implied.complete_model()
        return complete

    def decode(self, ids: list[int], skip_special_tokens: bool = False, keep: frozenset[int] | set[int] = frozenset()
               ) -> str:
        """`keep`: special tokens that stay in the text when the others are skipped."""
        if skip_special_tokens and keep:
            ids, skip_special_tokens = [i for i in ids if i in keep or i not in self.special_ids], False
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, tools=None, **extra) -> str:
        try:
            return self.render_chat_template(messages, add_generation_prompt, tools, extra)
        except Exception as e:  # a template is untrusted code: any failure is the request's, not ours
            message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"chat template failed: {message}") from None

    def render_chat_template(self, messages: list[dict], add_generation_prompt: bool, tools, extra: dict) -> str:
        """apply_chat_template's text, the template's errors raised as they come."""
        from fastdecode.loading.chat_template import ChatTemplate

        token = lambda i: self.backend.id_to_token(i) if i is not None else None  # noqa: E731
        variables = {"bos_token": token(self.bos_token_id),
                     "eos_token": token(self.eos_token_ids[0] if self.eos_token_ids else None), **extra}
        if self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, ChatTemplate(self.chat_template))
        # OpenAI clients send `"content": null` next to tool calls; templates expect the key to be absent.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        return self._compiled[1].render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        **variables)

    def check_chat_template(self) -> Tokenizer:
        """Renders two short conversations (chat_template.PROBES), so that a template that goes past its render limits
        fails the load rather than every request. Its other errors are left to the requests: a template may refuse a
        probe's roles or tools, and a request may not send them."""
        from fastdecode.loading.chat_template import PROBES, TemplateLimitError

        for messages, tools in PROBES:
            try:
                self.render_chat_template(messages, True, tools, {})
            except TemplateLimitError as e:
                raise ModelFileError(f"the model's chat template {e} rendering a short conversation") from None
            except Exception:  # noqa: BLE001 - see above
                pass
        return self

    # ---- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, metadata: dict) -> Tokenizer:
        get = lambda key, default=None: metadata.get(f"tokenizer.ggml.{key}", default)  # noqa: E731
        model, tokens = get("model"), get("tokens")
        if model is None or not tokens or not isinstance(tokens, list):
            raise ModelFileError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.model/tokens missing)")
        check_gguf_tokenizer_types(metadata)
        n = len(tokens)
        token_type = np.asarray(get("token_type", [1] * n))
        scores = get("scores")
        if len(token_type) != n or (scores is not None and len(scores) != n):
            raise ModelFileError(f"GGUF vocabulary is malformed: {n} tokens but {len(token_type)} token types "
                                 f"and {len(scores or [])} scores")
        ids = {name: get(f"{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
        if any(i is not None and not 0 <= i < n for i in ids.values()):
            raise ModelFileError(f"GGUF special token ids {ids} lie outside the {n}-token vocabulary")
        architecture = metadata.get("general.architecture", "")
        implied = None  # a vocabulary with implied merges may get them from a native table (ImpliedBPE)
        if model == "gpt2":
            backend, spelled = byte_level_backend(tokens, get("merges"), get("pre", "default"))
        elif model == "llama":
            backend, spelled, implied = sentencepiece_backend(tokens, scores, get("merges"), architecture,
                                                     get("add_space_prefix", True), ids["unknown"])
        else:
            raise UnsupportedModelError(f"GGUF tokenizer model {model!r} is not supported (gpt2 and llama are)")
        # Control tokens (and the named ones) become special added tokens so `<|im_start|>` stays one id; in a
        # byte-level vocabulary one spelled outside the byte alphabet is a llama.cpp mislabel, and is left alone.
        named = [i for i in ids.values() if i is not None and token_type[i] != USER_DEFINED]
        special = sorted(set(np.flatnonzero(token_type == CONTROL).tolist()) | set(named))
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i in special if spelled(tokens[i])])
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)  # Gemma's respelled spaces: not
                            for i in np.flatnonzero(token_type == USER_DEFINED).tolist()  # in the vocab as stored
                            if backend.token_to_id(tokens[i]) is not None])
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        add_bos = get("add_bos_token", model == "llama") and ids["bos"] is not None
        add_eos = get("add_eos_token", False) and ids["eos"] is not None
        set_bos_eos(backend, tokens[ids["bos"]] if add_bos else None, tokens[ids["eos"]] if add_eos else None)
        if implied is not None:
            implied.bind(backend, ids["bos"] if add_bos else None, ids["eos"] if add_eos else None)
        return cls(backend, ids["bos"], [ids["eos"]] if ids["eos"] is not None else [],
                   metadata.get("tokenizer.chat_template"), implied).check_chat_template()

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            backend = Backend.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise ModelFileError(f"cannot read {path / 'tokenizer.json'}: {e}") from None
        config, generation, model = (read_json(path / name) for name in
                                     ("tokenizer_config.json", "generation_config.json", "config.json"))
        content = lambda t: t.get("content") if isinstance(t, dict) else t  # noqa: E731
        bos, eos = content(config.get("bos_token")), content(config.get("eos_token"))
        bos_id = backend.token_to_id(bos) if bos else generation.get("bos_token_id", model.get("bos_token_id"))
        eos_ids = [backend.token_to_id(eos)] if eos else []
        for extra in (generation.get("eos_token_id"), model.get("eos_token_id")):
            eos_ids += extra if isinstance(extra, list) else [extra]
        if "add_bos_token" in config or "add_eos_token" in config:  # else tokenizer.json's post-processor stands
            known = lambda t, flag: t if config.get(flag) and backend.token_to_id(t or "") is not None else None  # noqa
            set_bos_eos(backend, known(bos, "add_bos_token"), known(eos, "add_eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        return cls(backend, bos_id, [i for i in eos_ids if i is not None], template).check_chat_template()


def _integer(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _list_of(*types):  # set(map(type, ...)) runs in C: 3 ms for a 150k vocabulary, against 30 for a Python loop
    return lambda v: isinstance(v, list) and set(map(type, v)) <= set(types)


VALUE_KINDS = {"a string": lambda v: isinstance(v, str), "an integer": _integer,
               "a boolean": lambda v: isinstance(v, bool), "a list of strings": _list_of(str),
               "a list of integers": _list_of(int), "a list of numbers": _list_of(int, float)}
# The tokenizer keys of a GGUF file and the kind of value each must hold (a hostile file may give any key any type).
GGUF_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "a string", "tokenizer.ggml.pre": "a string", "tokenizer.ggml.tokens": "a list of strings",
    "tokenizer.ggml.merges": "a list of strings", "tokenizer.ggml.token_type": "a list of integers",
    "tokenizer.ggml.scores": "a list of numbers", "tokenizer.ggml.bos_token_id": "an integer",
    "tokenizer.ggml.eos_token_id": "an integer", "tokenizer.ggml.unknown_token_id": "an integer",
    "tokenizer.ggml.padding_token_id": "an integer", "tokenizer.ggml.add_space_prefix": "a boolean",
    "tokenizer.ggml.add_bos_token": "a boolean", "tokenizer.ggml.add_eos_token": "a boolean",
    "tokenizer.chat_template": "a string"}


def check_gguf_tokenizer_types(metadata: dict):
    """Raises ModelFileError naming the first tokenizer key whose value is not of its kind."""
    for key, kind in GGUF_TOKENIZER_KEYS.items():
        value = metadata.get(key)
        if value is not None and not VALUE_KINDS[kind](value):
            raise ModelFileError(f"GGUF metadata {key} must be {kind}, not {type(value).__name__}")


def length_preserving(normalizer: dict | None) -> bool:
    """Whether a tokenizer.json normalizer never makes a text shorter: none, prefixes, one-character replacements."""
    if normalizer is None or normalizer.get("type") == "Prepend":
        return True
    if normalizer.get("type") == "Sequence":
        return all(map(length_preserving, normalizer.get("normalizers", [])))
    pattern = normalizer.get("pattern") or {}
    return (normalizer.get("type") == "Replace" and len(pattern.get("String", "")) == 1
            and len(normalizer.get("content", "")) >= 1)


def byte_level_backend(tokens: list[str], merges: list[str] | None, pre: str):
    """GPT-2 style BPE over bytes spelled as printable characters; GGUF stores tokens already spelled that way."""
    if not merges:
        raise ModelFileError("GGUF byte-level vocabulary has no tokenizer.ggml.merges")
    alphabet = set(bytes_to_unicode().values())
    spelled = lambda t: set(t) <= alphabet  # noqa: E731
    if not spelled("".join(tokens)):  # rare: a few tokens stored as raw text
        byte_char = bytes_to_unicode()
        tokens = [t if spelled(t) else "".join(byte_char[b] for b in t.encode()) for t in tokens]
    backend = bpe_backend(dict(zip(tokens, range(len(tokens)))), split_merges(merges))
    if pre in DIGIT_SPLIT_PRES:
        backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre in PRE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend, spelled


def sentencepiece_backend(tokens: list[str], scores, merges, architecture: str, add_space_prefix: bool, unk_id):
    """SentencePiece-style BPE with byte fallback and `▁` for spaces; merges from the file or implied by the vocab
    (then merged by an ImpliedBPE where it can be had, the backend's BPE holding no merges)."""
    gemma = architecture.startswith("gemma")
    if gemma:  # Gemma stores its runs-of-spaces tokens with real spaces; the merges need them spelled with `▁`
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = dict(zip(tokens, range(len(tokens))))
    unk = tokens[unk_id] if unk_id is not None else None
    options = {"unk_token": unk, "fuse_unk": True, "byte_fallback": True}
    implied = None
    if merges:
        merges = split_merges(merges)
    else:
        if scores is None and not gemma:
            raise ModelFileError("GGUF sentencepiece vocabulary has neither merges nor scores")
        uniq, ids = list(vocab), np.fromiter(vocab.values(), np.int64, len(vocab))
        # Gemma's scores do not follow its merge order; the token order in the file does.
        priority = -ids.astype(np.float64) if gemma else np.asarray(scores, np.float64)[ids]
        implied = ImpliedBPE.build(tokens, priority, options, whole=gemma)
        merges = [] if implied is not None else implied_merges(uniq, priority)
    backend = bpe_backend(vocab, merges, **options)
    decode = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "\u2581")
    elif architecture == "phi3":  # the prefix space comes from a normalizer, so "  hi" keeps both its spaces
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first" if add_space_prefix else "never",
                                                         split=False)
        if add_space_prefix:
            decode.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode)
    return backend, lambda t: True, implied


class ImpliedBPE:
    """The merges of a vocabulary that lists none (implied_merges), applied by a native table over the vocabulary
    (spm_merges.cpp) instead of listed: Gemma 3's 262k tokens build the table in ~0.05 s, where `tokenizers`' BPE
    with their 515k merges took 0.5 s, and the merges' names 0.1 s more, of a 1 s load. The backend's BPE then holds
    no merges. Gemma's pipeline (a space normalizer, added tokens matched as they are) runs whole in the table; any
    other runs in `tokenizers` up to the model (one symbol per character) and is merged by the table. Either way the
    ids are exactly those of `tokenizers` with the merges listed (complete_model, derived only for export)."""

    def __init__(self, module, tokens: list[str], priority: np.ndarray, options: dict, whole: bool):
        self.module, self.tokens, self.priority, self.options = module, tokens, priority, options
        self.whole = whole  # the whole pipeline is Gemma's: the table encodes text
        self.table, self.bos, self.eos = None, -1, -1

    @classmethod
    def build(cls, tokens, priority, options, whole: bool) -> ImpliedBPE | None:
        """`priority`: of each distinct token, in the order of the tokens' first appearance (as implied_merges takes
        it). None where the native table cannot be had (no compiler, native code off): then the merges are listed."""
        module = spm_merges_module()
        return None if module is None else cls(module, tokens, priority, options, whole)

    def bind(self, backend: Backend, bos: int | None, eos: int | None):
        """Builds the table once the backend's added tokens (never merged with their neighbours) and the BOS and EOS
        its post-processor adds are known."""
        added = backend.get_added_tokens_decoder()
        self.whole = self.whole and not any(t.normalized or t.lstrip or t.rstrip or t.single_word
                                            for t in added.values())
        level = np.unique(-self.priority, return_inverse=True)[1].astype(np.int32)  # as order_merges ranks them
        unk = self.options["unk_token"]
        self.table = self.module.ImpliedMerges(
            self.tokens, level.tolist(), sorted({*added, *(i for i in (bos, eos) if i is not None)}),
            [t.content for t in added.values()], list(added), -1 if unk is None else backend.token_to_id(unk))
        self.bos, self.eos = (-1 if i is None else i for i in (bos, eos))

    def encode(self, backend: Backend, text: str, add_special_tokens: bool) -> list[int]:
        if self.whole:
            try:
                return self.table.encode(text, *((self.bos, self.eos) if add_special_tokens else (-1, -1)))
            except (TypeError, ValueError):  # not UTF-8 (lone surrogates), or no token for a character: the backend
                pass                          # says what it makes of it
        return self.table.merge(backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def complete_model(self) -> BPE:
        """`tokenizers`' BPE with the merges listed: what a tokenizer.json holds."""
        vocab = dict(zip(self.tokens, range(len(self.tokens))))
        return BPE(vocab, implied_merges(list(vocab), self.priority), **self.options)


@functools.cache
def spm_merges_module():
    from fastdecode.kernels.jit import build

    return build("fastdecode_spm_merges", [Path(__file__).with_name("spm_merges.cpp")],
                 "listing the implied merges for tokenizers' BPE")


def implied_merges(tokens: list[str], priority: np.ndarray) -> list[tuple[str, str]]:
    """derive_merges, kept under $FASTDECODE_HOME/tokenizers by a hash of the tokens and their priorities (what the
    merges follow from, so a kept file is never stale): Gemma 3's 262k tokens take 0.7-1.0 s to derive, a kept file
    a few ms to read (the 515k tuples of names then take 0.1-0.2 s). A file that cannot be read back as indices into
    the vocabulary is derived again, and one that cannot be written is not kept, silently."""
    h = hashlib.sha256(f"{MERGES_FORMAT} {len(tokens)}".encode())
    for part in (np.fromiter(map(len, tokens), np.int64, len(tokens)), "".join(tokens).encode("utf-32-le"),
                 np.asarray(priority, np.float64)):
        h.update(part)
    path = merges_dir() / f"{h.hexdigest()[:32]}.npy"
    pieces = read_pieces(path, len(tokens))
    if pieces is None:
        pieces = merge_pieces(tokens, priority)
        write_pieces(path, pieces)
    return named(tokens, pieces)


def derive_merges(tokens: list[str], priority: np.ndarray) -> list[tuple[str, str]]:
    return named(tokens, merge_pieces(tokens, priority))


def named(tokens: list[str], pieces: np.ndarray) -> list[tuple[str, str]]:
    names = np.array(tokens, dtype=object)  # fancy indexing and tolist: a third faster than a comprehension
    return list(zip(names[pieces[0]].tolist(), names[pieces[1]].tolist()))


def merges_dir() -> Path:
    from fastdecode.loading.catalog import fastdecode_home

    return fastdecode_home() / "tokenizers"


def read_pieces(path: Path, n_tokens: int) -> np.ndarray | None:
    try:
        pieces = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):  # absent, truncated, or not an array
        return None
    if pieces.dtype != np.int32 or pieces.ndim != 2 or len(pieces) != 2 or (
            pieces.size and not (pieces.min() >= 0 and pieces.max() < n_tokens)):
        return None
    return pieces


def write_pieces(path: Path, pieces: np.ndarray):
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, pieces)
        os.replace(tmp, path)  # whole or not at all: a reader never sees half a file
    except OSError:
        tmp.unlink(missing_ok=True)


def merge_pieces(tokens: list[str], priority: np.ndarray) -> np.ndarray:
    """Merges implied by a vocabulary that lists none: every split of a token into two tokens, best first, as (2, n)
    int32 indices of the left and right pieces into `tokens`.

    Same order as transformers' `generate_merges`: higher priority, then longer left piece, longer right piece,
    then vocabulary order. `tokens` are unique. Substrings are found by a polynomial hash over the whole vocabulary
    at once (a Python loop over Gemma's 1.2M split points takes seconds); every hit is then compared character by
    character, and a vocabulary whose hashes collide falls back to the plain loop.
    """
    lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    codes = np.frombuffer("".join(tokens).encode("utf-32-le"), np.uint32)
    starts = np.cumsum(lens) - lens
    base, inv = 0x9E3779B97F4A7C15, pow(0x9E3779B97F4A7C15, -1, 2**64)  # odd, so invertible mod 2**64
    powers = np.cumprod(np.full(len(codes) + 1, base, np.uint64)) * np.uint64(inv)  # base**q
    inverse = np.cumprod(np.full(len(codes) + 1, inv, np.uint64)) * np.uint64(base)  # base**-q
    prefix = np.concatenate((np.zeros(1, np.uint64), np.cumsum(codes * powers[:-1])))
    span_hash = lambda s, e: (prefix[e] - prefix[s]) * inverse[s]  # noqa: E731  hash of codes[s:e], wherever it lies
    order = np.argsort(token_hash := span_hash(starts, starts + lens))
    sorted_hash = token_hash[order]
    if (np.diff(sorted_hash) == 0).any():
        return order_merges(tokens, priority, *exact_splits(tokens))

    def lookup(h):  # -> (index into tokens, found); sorted queries search ~2x faster (cache-friendly)
        by_hash, pos = np.argsort(h), np.empty(len(h), np.int64)
        pos[by_hash] = np.minimum(np.searchsorted(sorted_hash, h[by_hash]), len(tokens) - 1)
        return order[pos], sorted_hash[pos] == h

    token, k = segments(np.maximum(lens - 1, 0))  # one row per split point; the left piece is k + 1 long
    k += 1
    left, found = lookup(span_hash(starts[token], starts[token] + k))
    token, k, left = token[found], k[found], left[found]
    right, found = lookup(span_hash(starts[token] + k, starts[token] + lens[token]))
    token, k, left, right = token[found], k[found], left[found], right[found]
    row, j = segments(lens[token])  # compare every character of each hit with its two pieces
    piece = np.where(j < k[row], starts[left][row] + j, starts[right][row] + j - k[row])
    if (lens[left] != k).any() or (codes[starts[token][row] + j] != codes[piece]).any():
        return order_merges(tokens, priority, *exact_splits(tokens))
    return order_merges(tokens, priority, token, left, right)


def segments(lengths: np.ndarray):
    """(segment, offset) for every position of consecutive segments of these lengths."""
    segment = np.repeat(np.arange(len(lengths)), lengths)
    return segment, np.arange(len(segment)) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def exact_splits(tokens: list[str]):
    """The plain loop derive_merges vectorises: (token, left, right) index arrays of every two-token split."""
    index = {t: i for i, t in enumerate(tokens)}
    rows = [(i, index[t[:k]], index[t[k:]]) for i, t in enumerate(tokens) for k in range(1, len(t))
            if t[:k] in index and t[k:] in index]
    return tuple(np.array(c, np.int64) for c in zip(*rows)) if rows else (np.zeros(0, np.int64),) * 3


def order_merges(tokens, priority, token, left, right) -> np.ndarray:
    lens = np.fromiter(map(len, tokens), np.int64, len(tokens))
    # Sort keys, most significant first; (token, left length) already fixes the split, so piece ids add nothing.
    level = np.unique(-priority, return_inverse=True)[1][token]  # 0 = highest priority
    keys = [level, lens.max() - lens[left], lens.max() - lens[right], token]
    sizes = [int(level.max(initial=0)) + 1, int(lens.max()) + 1, int(lens.max()) + 1, len(tokens)]
    if np.prod(sizes, dtype=object) < 2**63:  # one packed int64 key sorts ~4x faster than np.lexsort
        packed = keys[0]
        for key, size in zip(keys[1:], sizes[1:]):
            packed = packed * size + key
        rank = np.argsort(packed, kind="stable")
    else:
        rank = np.lexsort(keys[::-1])
    return np.stack((left[rank], right[rank])).astype(np.int32)


def bpe_backend(vocab: dict, merges: list, **options) -> Backend:
    try:
        return Backend(BPE(vocab, merges, **options))
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge naming an unknown token
        raise ModelFileError(f"GGUF vocabulary is malformed: {e}") from None


def split_merges(merges: list[str]) -> list[tuple[str, str]]:
    pairs = [tuple(m.split(" ", 2)) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise ModelFileError("GGUF tokenizer.ggml.merges has an entry that is not two tokens separated by a space")
    return pairs


def set_bos_eos(backend: Backend, bos: str | None, eos: str | None):
    """Makes `encode(add_special_tokens=True)` add BOS and/or EOS around the text."""
    single = " ".join(filter(None, [bos and f"{bos}:0", "$A:0", eos and f"{eos}:0"]))
    pair = " ".join(filter(None, [single, bos and f"{bos}:1", "$B:1", eos and f"{eos}:1"]))
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(filter(None, [bos, eos]))]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map: printable bytes stand for themselves, the rest shift past 255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(shifted)}}


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"cannot read {path}: {e}") from None
