"""A Messages API request -> the Chat Completions request that means the same, so that one code path (prepare)
builds every chat prompt: system blocks become the system message, `tool_use` blocks an assistant's `tool_calls`,
`tool_result` blocks `tool` messages, and `tool_choice` any/tool OpenAI's required/named choice. Claude Code's
billing header is left out (docs/agents.md: "What changes between sessions")."""
from __future__ import annotations

import json
from dataclasses import dataclass

from fastdecode.server.anthropic.schemas import Message, MessagesInput, MessagesRequest, TextBlock, ToolChoice
from fastdecode.server.errors import ApiError
from fastdecode.server.prepare import EngineRequest, ServedModel, as_chat_request, chat_prompt, chat_request
from fastdecode.server.schemas import ChatCompletionRequest

CHOICES = {"auto": "auto", "any": "required", "none": "none"}
# Claude Code's first system block, `x-anthropic-billing-header: cc_version=2.1.197.8f6; cc_entrypoint=sdk-cli;`,
# is billing metadata, not an instruction. Its suffix changes with the session's first user message: kept, it would
# part two tasks' prompts at their 26th token (Gemma 3's tokenizer) and the prefix cache would miss the rest. llama.cpp
# leaves it out too.
BILLING_HEADER = "x-anthropic-billing-header:"


@dataclass
class MessagesJob:
    job: EngineRequest
    clamped: bool  # max_tokens was cut to the context left after the prompt


def messages_job(body: MessagesRequest, served: ServedModel) -> MessagesJob:
    """max_tokens is a ceiling here, not a promise: Claude Code asks for 32k whatever the model's context, so the
    reply may run to the end of the context and then stops with `model_context_window_exceeded`."""
    chat = chat_body(body)
    prompt = chat_prompt(chat, served)
    context = served.llm.max_seq_len
    room = context - len(prompt.ids)
    if room < 1:
        raise ApiError(400, f"prompt is too long: {len(prompt.ids)} tokens > {context - 1} maximum "
                            f"{served.llm.context_hint()}")
    chat.max_tokens = min(body.max_tokens, room)
    return MessagesJob(chat_request(chat, served, prompt), body.max_tokens > room)


def count_tokens(body: MessagesInput, served: ServedModel) -> int:
    return len(chat_prompt(chat_body(body), served).ids)


def chat_body(body: MessagesInput) -> ChatCompletionRequest:
    fields = {"model": body.model, "messages": system_messages(body.system) + conversation(body.messages)}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {}),
            **({"strict": t.strict} if t.strict is not None else {})}} for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = tool_choice(body.tool_choice)
        if body.tool_choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    # As with Claude, no `thinking` means no reasoning: a template that can turn it off (Qwen3's) is told to, one that
    # can only lower it (gpt-oss's) is given the lowest level.
    thinks = body.thinking is not None and body.thinking.type != "disabled"
    fields["chat_template_kwargs"] = {"enable_thinking": thinks, **({} if thinks else {"reasoning_effort": "low"})}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, ignore_eos=body.ignore_eos)
        user = (body.metadata or {}).get("user_id")  # Claude Code's names the session: a cluster keeps it on one replica
        if isinstance(user, str):
            fields["user"] = user
    return as_chat_request(fields)


def tool_choice(choice: ToolChoice):
    if choice.type != "tool":
        return CHOICES[choice.type]
    if not choice.name:
        raise ApiError(400, "tool_choice: a choice of type `tool` needs the tool's `name`")
    return {"type": "function", "function": {"name": choice.name}}


def system_messages(system) -> list[dict]:
    texts = [] if system is None else [system] if isinstance(system, str) else [b.text for b in system]
    texts = [t for t in map(without_billing_header, texts) if t is not None]
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def without_billing_header(text: str) -> str | None:
    """The text less a first line that is Claude Code's billing header; None when that line was all of it."""
    if not text.startswith(BILLING_HEADER):
        return text
    return text.partition("\n")[2] or None


def conversation(messages: list[Message]) -> list[dict]:
    """Anthropic's turns -> OpenAI's messages; a user turn holding tool results becomes one `tool` message per
    result followed by the turn's text, if any."""
    out, tool_use_ids = [], set()
    for i, m in enumerate(messages):
        blocks = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if not blocks:
            raise ApiError(400, f"messages.{i}: content is empty")
        if m.role == "assistant":
            out.append(assistant_message(i, blocks, tool_use_ids))
        elif m.role == "system":  # said to the model at that point: a user turn keeps it there in any template
            out.append({"role": "user", "content": "\n".join(text_blocks(i, blocks))})
        else:
            out += user_messages(i, blocks, tool_use_ids)
    return out


def assistant_message(i: int, blocks, tool_use_ids: set[str]) -> dict:
    texts, calls, thoughts = [], [], []
    for b in blocks:
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "thinking" and b.thinking:
            thoughts.append(b.thinking)
        elif b.type == "tool_use":
            tool_use_ids.add(b.id)
            calls.append({"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
        elif b.type not in ("thinking", "redacted_thinking"):
            raise ApiError(400, f"messages.{i}: `{b.type}` blocks are not allowed in assistant messages")
    message = {"role": "assistant", "content": "\n".join(texts) if texts or not calls else None}
    if calls:
        message["tool_calls"] = calls
    if thoughts:  # templates decide whether an earlier turn's reasoning is shown (gpt-oss's: before a call)
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def user_messages(i: int, blocks, tool_use_ids: set[str]) -> list[dict]:
    out, texts = [], []
    for b in blocks:
        if b.type == "text":
            texts.append(b.text)
        elif b.type == "tool_result":
            if b.tool_use_id not in tool_use_ids:
                raise ApiError(400, f"messages.{i}: unexpected `tool_use_id` found in `tool_result` blocks: "
                                    f"{b.tool_use_id}. Each `tool_result` block must have a corresponding "
                                    "`tool_use` block in an earlier assistant message.")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id,
                        "content": ("Error: " if b.is_error else "") + result_text(i, b.content)})
        else:
            raise ApiError(400, f"messages.{i}: `{b.type}` blocks are not supported in user messages: this server "
                                "reads text, tool_result and (from the assistant) tool_use blocks")
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def result_text(i: int, content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(text_blocks(i, content))


def text_blocks(i: int, blocks) -> list[str]:
    """The texts of blocks that may only be text (a tool result's, a system message's)."""
    for b in blocks:
        if b.type != "text":
            raise ApiError(400, f"messages.{i}: `{b.type}` blocks are not supported here: this server reads text")
    return [b.text for b in blocks]
