"""Request bodies of the Responses API. Unknown fields are ignored: agents send fields that change nothing for a
stateless server (store, include, prompt_cache_key, ...). Items of other types than those below
(images, files, built-in tools' calls) are refused by validation with the list of those accepted; tools of other
types than function and namespace are left out (OtherTool)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from fastdecode.server.schemas import FUNCTION_NAME, MAX_TOOLS, Lenient, echoable


class TextPart(Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningText(Lenient):
    type: str  # reasoning_text
    text: str = ""


class ReasoningItem(Lenient):  # an earlier reply's reasoning: the reasoning_content of the assistant turn it opens
    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None


def item_type(item) -> str:
    """A message may leave out its type (the SDK's EasyInputMessage)."""
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")


Item = Annotated[Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
                       Annotated[FunctionCallOutputItem, Tag("function_call_output")],
                       Annotated[ReasoningItem, Tag("reasoning")]], Discriminator(item_type)]


class FunctionTool(Lenient):
    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(Lenient):
    """Function tools grouped under a name (Codex sends its sub-agent tools so); each is offered as it is, and a call
    of one names its namespace."""
    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool] = Field(max_length=MAX_TOOLS)


class OtherTool(Lenient):
    """A tool this server cannot offer: the API's hosted ones (web_search, file_search, code_interpreter, ...) run on
    OpenAI's side, and freeform `custom` tools need a grammar over raw text. Agents send them by default; they are
    left out of the prompt (logged), not refused."""
    type: str


def tool_type(tool) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else getattr(tool, "type", None)
    return kind if kind in ("function", "namespace") else "other"


Tool = Annotated[Union[Annotated[FunctionTool, Tag("function")], Annotated[NamespaceTool, Tag("namespace")],
                       Annotated[OtherTool, Tag("other")]], Discriminator(tool_type)]


class NamedFunction(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # json_schema: the output follows it
    name: str | None = None
    strict: bool | None = None  # False: keywords the grammar does not implement are ignored, not refused


class TextConfig(Lenient):
    format: TextFormat | None = None


class Reasoning(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: str | None = None  # accepted; reasoning comes back as its text, not a summary


class ResponsesRequest(Lenient):
    model: str
    input: str | list[Item]
    instructions: str | None = None
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # a namespace's functions count on conversion
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stream: bool | None = False
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None  # refused: this server keeps no responses
    parallel_tool_calls: bool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # names the conversation (Codex's): routing only

    @field_validator("instructions", "tools", "tool_choice", "metadata")
    @classmethod
    def echoed(cls, value):
        """The fields a response repeats (ResponsesFormatter.request): NaN, 1e999 or a lone surrogate in them was a
        500, or a stream cut short, after the whole generation."""
        return echoable(value)

    def functions(self) -> list[tuple[str | None, FunctionTool]]:
        """(namespace or None, tool) of every function the model is offered, namespaces' members included."""
        out = []
        for t in self.tools or []:
            if t.type == "function":
                out.append((None, t))
            elif t.type == "namespace":
                out += [(t.name, f) for f in t.tools]
        return out
