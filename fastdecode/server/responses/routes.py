"""POST /v1/responses. `answer` is the app's: the same queue, disconnect handling and metrics as Chat Completions."""
from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from fastdecode.server.prepare import ServedModel, chat_request
from fastdecode.server.responses.convert import chat_body
from fastdecode.server.responses.formatter import ResponsesFormatter
from fastdecode.server.responses.schemas import ResponsesRequest

log = logging.getLogger(__name__)


def responses_routes(served: ServedModel, answer) -> APIRouter:
    router = APIRouter()  # the API key is checked by the Guard middleware, before the body is read

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served.check_model(body.model)
        job = await run_in_threadpool(lambda: chat_request(chat_body(body), served))
        log.info("responses: %d input items, %d tools, %d prompt tokens, max_tokens %d%s",
                 1 if isinstance(body.input, str) else len(body.input), len(body.tools or []), len(job.prompt_ids),
                 job.params.max_tokens, ", streamed" if body.stream else "")
        fmt = ResponsesFormatter(served.id, served.llm.tokenizer, len(job.prompt_ids), job.reply, body)
        return await answer(request, job, fmt, bool(body.stream))

    return router
