"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) as Claude Code and the `anthropic` SDK
use it, over the same prompt building, queue and engine as Chat Completions: a request is converted into a chat
completion request (convert), and the engine's chunks are written as Anthropic's content blocks and events
(formatter)."""
