"""OpenAI's Responses API (POST /v1/responses), stateless, as Codex CLI and the `openai` SDK use it: input items are
converted into a chat completion request (convert) and the engine's chunks are written as output items and
`response.*` events (formatter)."""
