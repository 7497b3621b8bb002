"""Tool calls that parse: forced and `auto` calls in each tool-call format, with sampled decoding, through the whole
server (prompt, grammar, engine, parser, response), counted as a client sees them.

Each case is a model and the chat template that teaches it a format:
    hermes        SmolLM2-135M and Gemma 3 270M with their own templates (tools in the system message, Hermes calls)
    qwen3_coder   SmolLM2-135M taught Qwen3-Coder's XML calls (tests/helpers/chat_models.py's template)
    llama3        SmolLM2-135M taught Llama 3.1's `{"name", "parameters"}` reply
    harmony       the tiny random gpt-oss-vocabulary model (harmony's markers are special tokens SmolLM2 lacks)
    mistral       the tiny random model with Mistral's `[TOOL_CALLS]NAME[ARGS]{...}` template
Requests cycle through tool_choice "required", a named tool, "auto", and "auto" with parallel_tool_calls false, at
temperature 1 with a seed each. A reply counts as parsed when every call names an offered tool with arguments valid
against its schema (jsonschema), a forced reply holds calls only, and a reply with parallel_tool_calls false holds
at most one; replies cut by max_tokens are counted apart.

    python bench/tool_calls.py                       # every case, 100 requests each
    python bench/tool_calls.py --cases hermes-smollm2 --requests 20

Writes bench/results/tool_calls.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import uvicorn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from common import command_line, machine, markdown_table, write_json  # noqa: E402

from fastdecode import LLM  # noqa: E402
from fastdecode.loading.catalog import cached_path  # noqa: E402
from fastdecode.server.app import create_app  # noqa: E402
from fastdecode.server.config import ServerConfig  # noqa: E402
from tests.helpers.chat_models import QWEN3_CODER, chat_model  # noqa: E402
from tests.server.conftest import free_port  # noqa: E402

# Llama 3.1's instruction to answer a call as JSON, on ChatML turns: what selects the llama3 format.
LLAMA3 = """{%- if tools %}<|im_start|>system
Given the following functions, please respond with a JSON for a function call with its proper arguments that best
answers the given prompt. Respond in the format {"name": function name, "parameters": dictionary of argument name
and its value}. Do not use variables.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content | default("", true) }}<|im_end|>
{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

CASES = {  # name: (model path, chat template or None for the model's own)
    "hermes-smollm2": (lambda: cached_path("smollm2-135m"), None),
    "hermes-gemma3": (lambda: cached_path("gemma3-270m"), None),
    "qwen3_coder-smollm2": (lambda: cached_path("smollm2-135m"), QWEN3_CODER),
    "llama3-smollm2": (lambda: cached_path("smollm2-135m"), LLAMA3),
    "harmony-tiny": (lambda: chat_model("harmony"), None),  # random weights: the native kernels want real shapes
    "mistral-tiny": (lambda: chat_model("mistral"), None),
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "edit_file", "description": "Replace text in a file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 80},
                                         "old_string": {"type": "string", "maxLength": 200},
                                         "new_string": {"type": "string", "maxLength": 200},
                                         "replace_all": {"type": "boolean"}},
        "required": ["path", "old_string", "new_string"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "search", "description": "Search the code base.", "parameters": {
        "type": "object", "properties": {
            "query": {"type": "string", "maxLength": 60}, "max_results": {"type": "integer", "minimum": 1,
                                                                         "maximum": 20},
            "filters": {"type": "object", "properties": {"lang": {"enum": ["python", "rust", "go"]},
                                                         "paths": {"type": "array", "items": {"type": "string",
                                                                                              "maxLength": 40},
                                                                   "maxItems": 3}},
                        "additionalProperties": False}},
        "required": ["query"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["What is the weather in Oslo?", "In app.py replace `return None` with `return 0`.",
        "Find where the request timeout is set in the Python code.", "Check the weather in Lima and in Kyoto.",
        "Rename the function foo to bar in utils/helpers.py."]
MODES = [("required", {"tool_choice": "required"}),
         ("named", {"tool_choice": {"type": "function", "function": {"name": "search"}}}),
         ("auto", {"tool_choice": "auto"}),
         ("auto, one call", {"tool_choice": "auto", "parallel_tool_calls": False})]


def judge(reply: dict, mode: str, extra: dict, max_tokens: int) -> tuple[str, str]:
    """-> (verdict, detail): parsed, text (auto only), length, or broken. A reply with calls reports `tool_calls`
    even when max_tokens cut what followed them: its token count tells."""
    choice = reply["choices"][0]
    message, finish = choice["message"], choice["finish_reason"]
    if reply["usage"]["completion_tokens"] >= max_tokens:
        finish = "length"
    if finish == "length":  # a call the cut closed early may hold a value the grammar had not yet ended
        return "length", ""
    calls = message.get("tool_calls") or []
    for call in calls:
        name = call["function"]["name"]
        if name not in SCHEMAS:
            return "broken", f"a call to {name}"
        try:
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            return "broken", f"{name}: {str(e).splitlines()[0]}"
    if mode in ("required", "named"):
        if not calls or (message.get("content") or "").strip():
            return "broken", f"forced, but {len(calls)} calls and text {message.get('content')!r:.80}"
        if mode == "named" and any(c["function"]["name"] != "search" for c in calls):
            return "broken", "a call to another tool than the named one"
    if extra.get("parallel_tool_calls") is False and len(calls) > 1:
        return "broken", f"{len(calls)} calls with parallel_tool_calls false"
    return ("parsed", f"{len(calls)} calls") if calls else ("text", "")


def serve(llm: LLM):
    server = uvicorn.Server(uvicorn.Config(create_app(llm, ServerConfig()), host="127.0.0.1", port=free_port(),
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server, f"http://127.0.0.1:{server.config.port}"


def run_case(name: str, a) -> dict:
    path, template = CASES[name]
    llm = LLM(str(path()), threads=a.threads, max_seq_len=4096, kv_disk_gb=0, native=not name.endswith("-tiny"))
    if template is not None:
        llm.tokenizer.chat_template = template
    server, url = serve(llm)

    def one(i: int) -> dict:
        mode, extra = MODES[i % len(MODES)]
        body = {"model": llm.name, "messages": [{"role": "user", "content": ASKS[i % len(ASKS)]}], "tools": TOOLS,
                "temperature": 1.0, "seed": i, "max_tokens": a.max_tokens, **extra}
        t0 = time.perf_counter()
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        if response.status_code != 200:
            return {"i": i, "mode": mode, "verdict": "error", "detail": response.text[:200]}
        verdict, detail = judge(response.json(), mode, extra, a.max_tokens)
        return {"i": i, "mode": mode, "verdict": verdict, "detail": detail, "s": time.perf_counter() - t0,
                "tokens": response.json()["usage"]["completion_tokens"]}
    try:
        with ThreadPoolExecutor(a.concurrency) as pool:
            replies = list(pool.map(one, range(a.requests)))
    finally:
        server.should_exit = True
        llm.close()
    counts = {v: sum(r["verdict"] == v for r in replies) for v in ("parsed", "text", "length", "broken", "error")}
    calls = sum(int(r["detail"].split()[0]) for r in replies if r["verdict"] == "parsed")
    print(name, counts, "calls:", calls, flush=True)
    return {"case": name, "counts": counts, "calls": calls, "replies": replies}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/tool_calls")
    a = parser.parse_args()
    results = [run_case(name, a) for name in a.cases.split(",")]
    data = {"command": command_line(), "machine": machine(), "requests": a.requests, "max_tokens": a.max_tokens,
            "results": results}
    write_json(Path(a.out + ".json"), data)
    rows = []
    for r in results:
        c = r["counts"]
        finished = a.requests - c["length"] - c["error"]
        rows.append([r["case"], str(a.requests), str(c["parsed"]), str(r["calls"]), str(c["text"]), str(c["length"]),
                     str(c["broken"]), str(c["error"]),
                     f"{100 * (c['parsed'] + c['text']) / finished:.0f}%" if finished else "-"])
    table = markdown_table(["case", "requests", "with calls", "calls", "text (auto)", "cut by max_tokens",
                            "broken", "errors", "finished replies that parse"], rows)
    broken = [f"- {r['case']} #{x['i']} ({x['mode']}): {x['detail']}" for r in results for x in r["replies"]
              if x["verdict"] in ("broken", "error")]
    Path(a.out + ".md").write_text(f"# Tool calls under each format's grammar\n\n`{data['command']}`\n\n"
                                   f"{data['machine']['cpu']}, {data['machine']['date']}. Sampled (temperature 1, "
                                   f"a seed per request), max_tokens {a.max_tokens}; modes cycle through "
                                   f"{', '.join(m for m, _ in MODES)}.\n\n{table}\n"
                                   + ("\nBroken or failed replies:\n" + "\n".join(broken) + "\n" if broken else ""))
    print(table)


if __name__ == "__main__":
    main()
