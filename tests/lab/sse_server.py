"""A scripted OpenAI-compatible chat endpoint on a loopback port: each request's `model` names a Script whose
chunks arrive at known times, so the lab's measurements can be checked against the truth."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


WORDS = [" the", " of", " and", " to", " in", " is", " that", " for", " it", " with"]  # one BPE token each


@dataclass
class Script:
    ttft_s: float = 0.25  # first token this long after the request arrives
    itl_s: float = 0.03  # per token after the first
    tokens: int = 40  # answer tokens
    per_chunk: int = 1  # tokens per chunk after the first chunk (which carries one)
    reasoning_tokens: int = 0  # streamed as delta.reasoning_content before the answer
    usage: bool = True
    stall_after: int | None = None  # token index after which the stream stalls
    stall_s: float = 0.0
    mode: str = "sse"  # sse | json (a server that does not stream) | http500
    prompt_tokens: int = 17
    fail_every: int | None = None  # every n-th request to this script answers HTTP 500


class Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        if self.path == "/health":
            self.reply(200, {"status": "ok"})
        else:
            self.reply(404, {"error": {"message": "not found"}})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.server.bodies.append(body)
        if self.server.api_key and self.headers.get("Authorization") != f"Bearer {self.server.api_key}":
            return self.reply(401, {"error": {"message": "Incorrect API key provided", "type": "invalid_api_key"}})
        if not self.path.endswith("/v1/chat/completions"):
            return self.reply(404, {"error": {"message": f"no route {self.path}"}})
        script = self.server.scripts.get(body.get("model"))
        if script is None:
            return self.reply(404, {"error": {"message": f"model {body.get('model')!r} not found"}})
        self.server.counts[body["model"]] = n = self.server.counts.get(body["model"], 0) + 1
        if script.mode == "http500" or (script.fail_every and n % script.fail_every == 0):
            return self.reply(500, {"error": {"message": "scripted failure"}})
        if script.mode == "json":
            return self.reply(200, {"choices": [{"message": {"role": "assistant", "content": "hi"}}]})
        self.stream(script)

    def reply(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def event(self, obj):
        self.wfile.write(f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n".encode())
        self.wfile.flush()

    def stream(self, s: Script):
        start = time.perf_counter()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "scripted"}
        self.event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
        self.wfile.write(b": keep-alive\n\n")
        # token k (0-based over reasoning then answer) is due at ttft + k * itl (+ the stall once passed)
        kinds = ["reasoning_content"] * s.reasoning_tokens + ["content"] * s.tokens
        k, total = 0, len(kinds)
        while k < total:
            n = 1 if k == 0 else min(s.per_chunk, total - k)
            last = k + n - 1
            due = s.ttft_s + last * s.itl_s + (s.stall_s if s.stall_after is not None and last > s.stall_after else 0)
            time.sleep(max(0.0, start + due - time.perf_counter()))
            delta: dict = {}
            for j in range(k, k + n):
                delta[kinds[j]] = delta.get(kinds[j], "") + WORDS[j % len(WORDS)]
            self.event({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            k += n
        self.event({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        if s.usage:
            self.event({**base, "choices": [], "usage": {"prompt_tokens": s.prompt_tokens, "completion_tokens": total,
                                                         "total_tokens": s.prompt_tokens + total}})
        self.event("[DONE]")


class ScriptedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, scripts: dict[str, Script], api_key: str | None = None):
        super().__init__(("127.0.0.1", 0), Handler)
        self.scripts, self.api_key, self.bodies, self.counts = scripts, api_key, [], {}
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()
