"""An OpenAI request -> what the engine runs: prompt token ids, SamplingParams and a logits processor, plus how the
reply is read (its tool-call format and reasoning, chosen from the chat template). Every mistake in the request
raises ApiError (400/404) here, before the request takes a place in the queue."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from pydantic import ValidationError

from fastdecode.engine.grammar import GrammarCompiler, GrammarProcessor, lark_grammar
from fastdecode.engine.sampling import MIN_TEMPERATURE, SamplingParams
from fastdecode.errors import FastdecodeError
from fastdecode.server.errors import ApiError
from fastdecode.server.formats import ReplyFormat, reasoning_in, tool_format
from fastdecode.server.formats.base import valid_unicode
from fastdecode.server.formats.lark import vocabulary_tokens
from fastdecode.server.schemas import ChatCompletionRequest, CompletionRequest, Sampling
from fastdecode.server.structured import output_grammar
from fastdecode.server.tools import template_knows_tools, template_messages

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request names none
PROMPT_TAIL_TOKENS = 16  # enough to see whether the generation prompt ends by opening `<think>`


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    logits_processor: Callable | None = None
    reply: ReplyFormat | None = None  # what the reply is parsed for; None: it is plain text
    echo: str | None = None  # prompt text that /v1/completions puts before the output
    cache_salt: str | None = None  # vLLM's: requests share cached prefixes only within one salt (and tenant)
    session: str | None = None  # the conversation the body names (prompt_cache_key, user): a cluster keeps it on one


class ServedModel:
    """The engine, what the API calls it, and the grammars compiled for its vocabulary."""

    def __init__(self, llm, name: str | None = None):
        self.llm = llm
        self.id = name or llm.name
        self.aliases = {self.id, llm.name, Path(llm.name).name, Path(llm.name).stem}

    @functools.cached_property
    def grammars(self) -> GrammarCompiler:
        return GrammarCompiler(self.llm.tokenizer)

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """The vocabulary's added tokens by their text: a tool-call grammar writes a format's markers as them."""
        return vocabulary_tokens(self.llm.tokenizer)

    def check_model(self, model: str):
        if model not in self.aliases:
            raise ApiError(404, f"The model `{model}` does not exist; this server serves `{self.id}`", "model",
                           "model_not_found")


def as_chat_request(fields: dict) -> ChatCompletionRequest:
    """Another API's request, converted into Chat Completions fields, as a checked ChatCompletionRequest."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # the other API's schema admitted something Chat Completions does not
        first = e.errors()[0]
        raise ApiError(400, f"{first['msg']} at {'.'.join(str(p) for p in first['loc'])}") from None


@dataclass
class ChatPrompt:
    """A chat request's prompt: its token ids, how the reply is read, and the tools one of which the reply must
    call (tool_choice "required" or a named tool)."""
    ids: list[int]
    reply: ReplyFormat | None  # None: no tools shown and no reasoning, the reply is plain text
    forced: list[dict] | None = None
    template: str = ""  # the chat template, which says the tool-call format's variant
    strict: frozenset[str] = frozenset()  # the tools marked `strict`: their schemas are followed to the letter


def chat_prompt(body: ChatCompletionRequest, served: ServedModel) -> ChatPrompt:
    llm = served.llm
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    names = [t["function"]["name"] for t in tools]
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    forced = None
    if not isinstance(choice, str):
        if choice.function.name not in names:
            raise ApiError(400, f"tool_choice names `{choice.function.name}`, which is not among the tools",
                           "tool_choice")
        forced = [t for t in tools if t["function"]["name"] == choice.function.name]
    elif choice == "required":
        if not tools:
            raise ApiError(400, "tool_choice 'required' needs at least one tool", "tool_choice")
        forced = tools
    if choice == "none":
        tools = []
    messages = [message_dict(m) for m in body.messages]
    can_fit(llm, sum(len(m["content"] or "") for m in messages), "messages")
    template = llm.tokenizer.chat_template
    knows_tools = template_knows_tools(template)
    taught = tool_format(template)
    rendered = [taught.template_message(m) for m in template_messages(messages, tools, knows_tools,
                                                                      taught.template_call_id)]
    options = template_options(body)
    text = encode(lambda: llm.render_chat(rendered, tools if tools and knows_tools else None, options))
    # What the template made of everything else the messages carry (reasoning sent back, call arguments, tools).
    can_fit(llm, len(text), "messages")
    ids = encode(lambda: llm.tokenizer.encode(text, add_special_tokens=False))
    reasoning = reasoning_in(template, llm.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
    reply = None
    if tools or reasoning or taught.channels:
        reply = ReplyFormat(taught if tools or taught.channels else None,
                            {t["function"]["name"]: t["function"].get("parameters") for t in tools}, reasoning)
    strict = frozenset(t["function"]["name"] for t in tools if t["function"].get("strict"))
    return ChatPrompt(ids, reply, forced, template, strict)


# reasoning_effort levels at which a template that can turn reasoning off (Qwen3's enable_thinking) turns it off
NO_THINKING = ("none", "minimal")


def template_options(body: ChatCompletionRequest) -> dict:
    """The chat template's extra variables: the request's chat_template_kwargs, and from its reasoning_effort both
    `reasoning_effort` (gpt-oss's templates read the level: low, medium or high, as it cannot turn reasoning off) and
    `enable_thinking` (Qwen3's hybrid templates render an empty reasoning block when it is false, so the model answers
    at once); the kwargs win where both set one."""
    options = {}
    effort = body.reasoning_effort
    if effort is not None:
        options = {"reasoning_effort": "low" if effort in NO_THINKING else effort,
                   "enable_thinking": effort not in NO_THINKING}
    return {**options, **(body.chat_template_kwargs or {})}


def chat_request(body: ChatCompletionRequest, served: ServedModel, prompt: ChatPrompt | None = None) -> EngineRequest:
    """`prompt`: chat_prompt(body) when the caller needed it first (the Messages API sizes max_tokens to it)."""
    prompt = prompt or chat_prompt(body, served)
    max_tokens = body.max_completion_tokens or body.max_tokens
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, prompt.ids, max_tokens, logprobs, served.llm)
    ends = []
    if prompt.reply is not None:  # the format's special-token markers stay in the text for its parser
        token_id = served.llm.tokenizer.backend.token_to_id
        params.keep_token_ids = [i for i in map(token_id, prompt.reply.special_markers) if i is not None]
        # Harmony's replies end at <|return|> or <|call|>; the vocabulary's end-of-turn tokens include <|end|>,
        # which ends each message of a reply and so must not stop it.
        ends = [i for i in map(token_id, prompt.reply.stop_markers) if i is not None]
    processor = logits_processor(body, reply_grammar(body, prompt, served), params, served, ends)
    if ends and not params.ignore_eos:
        params.stop_token_ids, params.ignore_eos = [*params.stop_token_ids, *ends], True
    return EngineRequest(prompt.ids, params, processor, prompt.reply, cache_salt=body.cache_salt,
                         session=body.prompt_cache_key or body.user)


def reply_grammar(body: ChatCompletionRequest, prompt: ChatPrompt, served: ServedModel) -> tuple[str, str] | None:
    """(grammar, the parameter it came from) a chat reply follows, or None. A forced call is the whole reply (what
    response_format asks of text does not apply to it); otherwise response_format and the like; otherwise, with
    tools offered, text or well-formed calls in the format the model was taught."""
    reply = prompt.reply
    parallel = body.parallel_tool_calls is not False
    if prompt.forced:
        tools = {t["function"]["name"]: t["function"].get("parameters") for t in prompt.forced}
        # A named function is one call to it (as vLLM and OpenAI answer); "required" one or more, as the request's
        # parallel_tool_calls allows.
        return call_grammar(prompt, served, tools, True, parallel and body.tool_choice == "required"), "tool_choice"
    asked = output_grammar(body)
    if asked is not None or reply is None or not reply.tools:
        return asked
    return call_grammar(prompt, served, reply.tools, False, parallel), "tools"


def call_grammar(prompt: ChatPrompt, served: ServedModel, tools: dict, forced: bool, parallel: bool) -> str:
    lark = prompt.reply.tool_parser.call_grammar(tools, forced=forced, parallel=parallel,
                                                 reasoning=prompt.reply.reasoning, strict=prompt.strict,
                                                 template=prompt.template, added_tokens=served.added_tokens)
    return lark_grammar(lark)


def completion_request(body: CompletionRequest, served: ServedModel) -> EngineRequest:
    llm = served.llm
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ApiError(400, "this server takes one prompt per request", "prompt")
        prompt = prompt[0]
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    if not prompt:
        raise ApiError(400, "the prompt is empty", "prompt")
    if isinstance(prompt, str):
        unicode_text(prompt, "prompt")
        can_fit(llm, len(prompt), "prompt")
        prompt_ids = encode(lambda: llm.encode_prompt(prompt))
    else:
        if not all(0 <= i < llm.config.vocab_size for i in prompt):
            raise ApiError(400, f"prompt token ids must lie in [0, {llm.config.vocab_size})", "prompt")
        prompt_ids = list(prompt)
    echo = None
    if body.echo:
        echo = prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt_ids)
    params = sampling_params(body, prompt_ids, body.max_tokens, body.logprobs, llm)
    return EngineRequest(prompt_ids, params, logits_processor(body, output_grammar(body), params, served), echo=echo,
                         cache_salt=body.cache_salt, session=body.user)


def message_dict(m) -> dict:
    """A message with its content as one string (text parts joined), without the fields it does not set."""
    content = m.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"content parts of type `{part.type}` are not supported: this server reads "
                                    "text", "messages")
            texts.append(part.text)
        content = "\n".join(texts)
    if content is not None:
        unicode_text(content, "messages")
    out = {"role": m.role, "content": content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.role == "assistant" and m.reasoning_content:
        out["reasoning_content"] = m.reasoning_content
    return out


def unicode_text(text: str, param: str):
    """JSON can spell lone surrogates (\\ud800); they are not text and the tokenizer cannot take them."""
    if not valid_unicode(text):
        raise ApiError(400, "the text is not valid Unicode: it holds a lone surrogate", param)


def can_fit(llm, chars: int, param: str):
    """Refuses text that takes more tokens than the context holds however it is tokenized (at least chars /
    max_token_chars), before tokenizing it: a 7 MB prompt cost 6 s of tokenizing, while other users' streams
    stalled, only to be refused after."""
    per_token = llm.tokenizer.max_token_chars
    if per_token and chars // per_token > llm.max_seq_len:
        raise ApiError(400, f"This model's maximum context length is {llm.max_seq_len} tokens "
                            f"{llm.context_hint()}. However, the "
                            f"{param} hold {chars} characters: at least {chars // per_token} tokens.", param,
                       "context_length_exceeded")


def encode(make_ids: Callable[[], list[int]]) -> list[int]:
    try:
        return make_ids()
    except FastdecodeError as e:
        raise ApiError(400, str(e), "messages") from None
    except (UnicodeError, TypeError, ValueError) as e:  # e.g. a lone surrogate the tokenizer cannot take
        raise ApiError(400, f"the prompt cannot be tokenized: {type(e).__name__}", "messages") from None


def sampling_params(body: Sampling, prompt_ids: list[int], max_tokens: int | None, logprobs: int | None,
                    llm) -> SamplingParams:
    context = llm.max_seq_len
    room = context - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room
    if max_tokens > room:
        raise ApiError(400, f"This model's maximum context length is {context} tokens {llm.context_hint()}. "
                            f"However, you requested "
                            f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the messages, {max_tokens} "
                            "in the completion). Please reduce the length of the messages or completion.",
                       "messages", "context_length_exceeded")
    if max_tokens < 1:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) fills the context of {context} tokens "
                            f"{llm.context_hint()}",
                       "messages", "context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
    top_p = 1.0 if body.top_p is None else body.top_p
    if top_p == 0 or temperature < MIN_TEMPERATURE:  # OpenAI accepts top_p 0: only the likeliest token
        temperature, top_p = 0.0, 1.0
    for s in stop:
        unicode_text(s, "stop")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=body.top_k or 0,
                              min_p=body.min_p or 0.0, repetition_penalty=body.repetition_penalty or 1.0,
                              presence_penalty=body.presence_penalty or 0.0,
                              frequency_penalty=body.frequency_penalty or 0.0, seed=body.seed, stop=stop,
                              ignore_eos=bool(body.ignore_eos), logprobs=logprobs)
    except FastdecodeError as e:
        raise ApiError(400, str(e)) from None


def logits_processor(body: Sampling, grammar: tuple[str, str] | None, params: SamplingParams, served: ServedModel,
                     ends: list[int] = ()):
    """logit_bias, then the grammar (it picks among the biased logits), as one processor. `grammar`: (llguidance
    grammar, the parameter it came from); `ends`: the tokens that end the reply when not end-of-sequence (harmony's)."""
    vocab_size = served.llm.config.vocab_size
    bias = bias_tensor(body.logit_bias, vocab_size) if body.logit_bias else None
    if grammar is None:
        return None if bias is None else lambda output_ids, logits: logits + bias
    source, param = grammar
    eos = list(ends) or served.llm.tokenizer.eos_token_ids
    try:
        matcher = served.grammars.matcher(source, eos, what=param)
    except FastdecodeError as e:
        raise ApiError(400, str(e), param) from None
    params.ignore_eos = False  # the grammar ends the reply
    return GrammarProcessor(matcher, served.grammars.vocab_size, eos, bias, source)


def bias_tensor(logit_bias: dict[str, float], vocab_size: int) -> torch.Tensor:
    bias = torch.zeros(vocab_size)
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids, not {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size or not -100 <= value <= 100:
            raise ApiError(400, f"logit_bias: token ids lie in [0, {vocab_size}) and biases in [-100, 100]",
                           "logit_bias")
        bias[token] = value
    return bias
