"""A Responses API request -> the Chat Completions request that means the same, so that one code path (prepare)
builds every chat prompt: `instructions` becomes the system message, `function_call` items an assistant's
`tool_calls`, `function_call_output` items `tool` messages, and `text.format` the response_format."""
from __future__ import annotations

import logging
from collections import Counter

from fastdecode.server.errors import ApiError
from fastdecode.server.prepare import as_chat_request
from fastdecode.server.responses.schemas import ResponsesRequest
from fastdecode.server.schemas import ChatCompletionRequest

log = logging.getLogger(__name__)


def chat_body(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: this server keeps no responses; send the whole "
                            "conversation as `input` items", "previous_response_id")
    messages = [{"role": "system", "content": body.instructions}] if body.instructions else []
    messages += conversation(body.input)
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p}
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    functions = body.functions()
    twice = sorted(name for name, n in Counter(t.name for _, t in functions).items() if n > 1)
    if twice:
        raise ApiError(400, f"two tools are named {twice[0]!r} (namespaces included): tool names must be unique",
                       "tools")
    left_out = [t.type for t in body.tools or [] if t.type not in ("function", "namespace")]
    if left_out:
        log.info("responses: tools this server cannot offer left out: %s", ", ".join(left_out))
    if functions:
        fields["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                           for _, t in functions]
    if body.tool_choice is not None:
        choice = body.tool_choice
        fields["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                        "function": {"name": choice.name}}
    if body.text is not None and body.text.format is not None:
        fmt = body.text.format
        schema = {"name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": fmt.type, **({"json_schema": schema} if fmt.type == "json_schema" else {})}
    if body.parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = body.parallel_tool_calls
    if body.prompt_cache_key is not None:  # Codex's conversation id: a cluster keeps the conversation on one replica
        fields["prompt_cache_key"] = body.prompt_cache_key
    return as_chat_request(fields)


def conversation(items) -> list[dict]:
    """Input items -> OpenAI messages; reasoning opens an assistant message, and its answer and function calls join
    it, as a chat model wrote them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out, call_ids = [], set()
    for i, item in enumerate(items):
        if item.type == "reasoning" and any(p.text for p in item.content or []):
            out.append({"role": "assistant", "content": None,
                        "reasoning_content": "\n".join(p.text for p in item.content if p.text)})
        elif item.type == "message" and item.role == "assistant" and out and out[-1]["role"] == "assistant" \
                and out[-1]["content"] is None and "tool_calls" not in out[-1]:  # the answer after its reasoning
            out[-1]["content"] = text(item.content)
        elif item.type == "message":
            out.append({"role": item.role, "content": text(item.content)})
        elif item.type == "function_call":
            call_ids.add(item.call_id)
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            if item.call_id not in call_ids:
                raise ApiError(400, f"No tool call found for function call output with call_id {item.call_id}.",
                               f"input.{i}.call_id")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": text(item.output)})
    out = [m for m in out if m["content"] is not None or "tool_calls" in m]  # reasoning that led to nothing
    if not out:
        raise ApiError(400, "input holds no message", "input")
    return out


def text(content) -> str:
    return content if isinstance(content, str) else "\n".join(p.text for p in content)
