"""Request bodies of the Messages API. Unknown fields are ignored, not rejected: Claude Code sends fields that change
nothing here (context_management, output_config, cache_control on blocks, ...) and new ones with each release."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from fastdecode.server.schemas import FUNCTION_NAME, Lenient

MAX_STOP_SEQUENCES = 16  # the engine checks each one after every token


class TextBlock(Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(Lenient):  # accepted by the schema so that the error can say why it is refused
    type: Literal["image", "document"]


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[Union[TextBlock, ImageBlock], Field(discriminator="type")]] | None = None
    is_error: bool | None = None


class ThinkingBlock(Lenient):  # an earlier reply's reasoning: the assistant message's reasoning_content
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None  # redacted blocks carry none


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock],
                  Field(discriminator="type")]


class Message(Lenient):
    role: Literal["user", "assistant", "system"]  # system: Claude Code's mid-conversation system messages (beta)
    content: str | list[Block]


class Tool(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # the input follows the schema to the letter (keywords it cannot follow: a 400)
    type: Literal["custom"] | None = None  # Anthropic's own tools (bash_..., web_search_...) are not served


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # for "tool"
    disable_parallel_tool_use: bool | None = None  # true: at most one call


class Thinking(Lenient):
    type: str  # enabled, adaptive (Claude Code) or disabled
    budget_tokens: int | None = None  # accepted; the reply's max_tokens bounds it


class MessagesInput(Lenient):
    """What both endpoints read: the conversation as the model sees it (and whether it may reason first)."""
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(MessagesInput):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOP_SEQUENCES)
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None  # user_id: names the session, for a cluster's router
    ignore_eos: bool | None = None  # vLLM's extension, as on Chat Completions: benchmarks and tests
