"""Request bodies of the OpenAI API we serve, as pydantic models: they validate input and are the OpenAPI schema.

Unknown top-level fields are rejected, as OpenAI does ("Unrecognized request argument"); fields OpenAI clients send
that change nothing here (user, store, metadata, ...) are accepted and ignored. Unknown fields inside a message are
ignored so that an agent can append a response's message object as it came back. `top_k`, `min_p`,
`repetition_penalty` and `ignore_eos` are vLLM's extensions, accepted for the same reason.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from fastdecode.engine.json_schema import check_size
from fastdecode.engine.sampling import STOP_LIMITS, stop_within_limits
from fastdecode.errors import InvalidRequestError
from fastdecode.server.formats.base import json_problem

INT64 = 2**63 - 1
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
MAX_LOGIT_BIAS = 1024  # entries; each is a token the bias touches
MAX_GRAMMAR_CHARS = 100_000  # a grammar or regex as text; llguidance bounds what compiling it costs
MAX_CHOICES = 1_000


def checked_schema(value: dict | None, schema, what: str):
    """`value` unchanged, once it is within the size limits and `schema` (inside it) is a JSON Schema (an object or
    a boolean): checked while the body is validated, so a bad schema costs no tokenizing and answers 400 with its
    parameter. What the schema says is checked when its grammar is compiled."""
    try:
        check_size(value, what)
    except InvalidRequestError as e:
        raise PydanticCustomError("invalid_schema", str(e)) from None
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise PydanticCustomError("invalid_schema", f"{what} must be a JSON object")
    return value


def echoable(value):
    """`value` unchanged, once it is JSON every client reads alike (finite numbers, valid Unicode, bounded depth;
    formats.base.json_problem): a field a response repeats is checked while the body is validated, so that writing
    the response cannot fail after the generation it waited for."""
    problem = json_problem(dumped(value))
    if problem is not None:
        raise PydanticCustomError("not_plain_json", f"Value cannot be repeated in the response: it {problem}")
    return value


def dumped(value):
    """A validated field as the JSON value a response writes of it."""
    if isinstance(value, BaseModel):
        return value.model_dump()
    return [dumped(v) for v in value] if isinstance(value, list) else value


def fail_fast(schema):
    """`schema` (pydantic's core schema, nested dicts and lists) with every list-like validator set to fail fast."""
    if isinstance(schema, dict):
        if schema.get("type") in ("list", "tuple", "set", "frozenset"):
            schema["fail_fast"] = True
        for value in schema.values():
            fail_fast(value)
    elif isinstance(schema, list):
        for value in schema:
            fail_fast(value)
    return schema


class Schema(BaseModel):
    """A request body's part whose lists stop at their first bad item: otherwise pydantic goes on through every item
    and FastAPI rewrites each error (26 us an item in a union of lists: 0.5 s of the event loop for a 60 KB prompt of
    mixed ids and strings), while the client reads only the first."""

    @classmethod
    def __get_pydantic_core_schema__(cls, source, handler):
        return fail_fast(handler(source))


class Strict(Schema):
    model_config = ConfigDict(extra="forbid")


class Lenient(Schema):
    model_config = ConfigDict(extra="ignore")


class ContentPart(Lenient):
    type: str
    text: str | None = None


class FunctionCall(Lenient):
    name: str
    arguments: str = ""


class ToolCall(Lenient):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning, as this server returned it


class FunctionDefinition(Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def readable_parameters(cls, parameters):
        return checked_schema(parameters, parameters, "the function's parameters")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted; our chunks carry no padding


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema", "grammar", "regex"]
    json_schema: dict[str, Any] | None = None
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)  # our extension: a Lark grammar (llguidance's)
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)  # our extension: the whole output matches it

    @field_validator("json_schema")
    @classmethod
    def readable_schema(cls, json_schema):
        return checked_schema(json_schema, (json_schema or {}).get("schema"), "json_schema.schema")

    @model_validator(mode="after")
    def given(self):
        if self.type in ("grammar", "regex") and getattr(self, self.type) is None:
            raise PydanticCustomError("missing_field", f"a response_format of type {self.type} needs `{self.type}`")
        return self


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one of its constraints."""
    json_: dict[str, Any] | bool | None = Field(None, alias="json")
    regex: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)

    @field_validator("json_")
    @classmethod
    def readable_schema(cls, schema):
        return checked_schema(schema, schema, "structured_outputs.json")

    @model_validator(mode="after")
    def one(self):
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError("one_constraint", "structured_outputs takes exactly one of json, regex, "
                                                        "choice and grammar")
        return self


class Sampling(Strict):
    """Fields both endpoints share."""
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    n: int | None = Field(None, ge=1, le=1)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(None, ge=-INT64, le=INT64)
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10)
    ignore_eos: bool | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # prefix-cache namespace within the tenant
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = Field(None, max_length=MAX_GRAMMAR_CHARS)  # llama.cpp's: GBNF, or Lark after %llguidance

    @field_validator("stop")
    @classmethod
    def bounded_stop(cls, stop):
        """Checked here, before the prompt is tokenized; a single string counts as a list of one."""
        if not stop_within_limits([stop] if isinstance(stop, str) else stop or []):
            raise PydanticCustomError("stop_too_long", STOP_LIMITS)
        return stop


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def checked_template_kwargs(kwargs: dict | None) -> dict | None:
    """Extra chat-template variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`): JSON values within the
    size limits that cannot replace what the server itself passes the template."""
    if kwargs is None:
        return None
    taken = sorted(RESERVED_TEMPLATE_NAMES & kwargs.keys())
    if taken:
        raise PydanticCustomError("reserved_template_variable", f"chat_template_kwargs may not set {taken[0]}")
    return checked_schema(kwargs, None, "chat_template_kwargs")  # the size limits alone


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # How much the model reasons, for templates that can turn it off (Qwen3's `enable_thinking`) or take the
    # level (gpt-oss's `reasoning_effort`); see prepare.template_options.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extension

    @field_validator("chat_template_kwargs")
    @classmethod
    def bounded_template_kwargs(cls, kwargs):
        return checked_template_kwargs(kwargs)

    # accepted and ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for this endpoint
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)
    response_format: ResponseFormat | None = None
