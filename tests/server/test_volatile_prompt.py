"""What an agent sends that changes between sessions and is no instruction stays out of the prompt, so that the
prefix cache reuses the long system prompt and tool schemas of an earlier session (docs/agents.md). Real template
and tokenizer (a tiny Qwen3-style chat model); nothing is generated."""
import pytest

from fastdecode.engine.llm import LLM
from fastdecode.server.anthropic.convert import chat_body
from fastdecode.server.anthropic.schemas import MessagesRequest
from fastdecode.server.prepare import ServedModel, chat_prompt
from tests.helpers.chat_models import chat_model

# Claude Code 2.1's billing header: its suffix (8f6, 82c) is a digest of the session's first user message.
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{}; cc_entrypoint=sdk-cli;"
TOOL = {"name": "Read", "description": "Reads a file.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}}}


@pytest.fixture(scope="module")
def served():
    llm = LLM(str(chat_model("qwen3")), max_seq_len=4096, native=False)
    yield ServedModel(llm)
    llm.close()


def prompt_ids(served, system, task: str) -> list[int]:
    body = MessagesRequest.model_validate({"model": served.id, "max_tokens": 8, "system": system, "tools": [TOOL],
                                           "messages": [{"role": "user", "content": task}]})
    return chat_prompt(chat_body(body), served).ids


def claude_code_system(suffix: str) -> list[dict]:
    return [{"type": "text", "text": BILLING.format(suffix)},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]


def test_sessions_differing_only_in_the_billing_header_render_the_same_tokens(served):
    first = prompt_ids(served, claude_code_system("8f6"), "Fix the bug in calc.py")
    assert first == prompt_ids(served, claude_code_system("82c"), "Fix the bug in calc.py")
    # and the same as a request that never had the header
    assert first == prompt_ids(served, claude_code_system("8f6")[1:], "Fix the bug in calc.py")


def test_a_new_task_shares_the_prompt_up_to_the_task(served):
    """The header's digest changes with the task; left out, two tasks' prompts part only where the tasks do."""
    fix = prompt_ids(served, claude_code_system("8f6"), "Fix the bug in calc.py")
    doc = prompt_ids(served, claude_code_system("82c"), "Add a docstring to calc.py")
    parted = next(i for i, (a, b) in enumerate(zip(fix, doc)) if a != b)
    assert served.llm.tokenizer.decode(fix[parted:]).startswith("Fix the bug")  # one token per byte: no merges
