"""POST /v1/responses. `answer` is the app's: the same queue, disconnect handling and metrics as Chat Completions."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from fastdecode.server.prepare import ServedModel, chat_request
from fastdecode.server.responses.convert import chat_body
from fastdecode.server.responses.formatter import ResponsesFormatter
from fastdecode.server.responses.schemas import ResponsesRequest


def responses_routes(served: ServedModel, answer, dependencies: list) -> APIRouter:
    router = APIRouter(dependencies=dependencies)

    @router.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        served.check_model(body.model)
        job = await run_in_threadpool(lambda: chat_request(chat_body(body), served))
        fmt = ResponsesFormatter(served.id, served.llm.tokenizer, len(job.prompt_ids), job.tool_names, body)
        return await answer(request, job, fmt, bool(body.stream))

    return router
