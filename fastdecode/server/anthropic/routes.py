"""POST /v1/messages and /v1/messages/count_tokens. `answer` is the app's: the same queue, disconnect handling and
metrics as Chat Completions. Query strings such as Claude Code's `?beta=true` and the anthropic-version and
anthropic-beta headers are accepted and change nothing."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from fastdecode.server.anthropic.convert import count_tokens, messages_job
from fastdecode.server.anthropic.formatter import MessagesFormatter
from fastdecode.server.anthropic.schemas import MessagesInput, MessagesRequest
from fastdecode.server.prepare import ServedModel

log = logging.getLogger(__name__)


def messages_routes(served: ServedModel, answer) -> APIRouter:
    router = APIRouter()  # the API key is checked by the Guard middleware, before the body is read

    @router.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request):
        served.check_model(body.model)
        prepared = await run_in_threadpool(messages_job, body, served)
        job = prepared.job
        log.info("messages: %d turns, %d tools, %d prompt tokens, max_tokens %d%s", len(body.messages),
                 len(body.tools or []), len(job.prompt_ids), job.params.max_tokens, ", streamed" if body.stream else "")
        fmt = MessagesFormatter(served.id, served.llm.tokenizer, len(job.prompt_ids), job.reply,
                                body.stop_sequences, prepared.clamped)
        return await answer(request, job, fmt, bool(body.stream))

    @router.post("/v1/messages/count_tokens")
    async def messages_count_tokens(body: MessagesInput):
        served.check_model(body.model)
        return {"input_tokens": await run_in_threadpool(count_tokens, body, served)}

    return router
