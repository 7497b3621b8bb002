"""Ctrl-C on `fastdecode serve` with requests in flight: each gets a 503 it can read (a stream, that error as its last
event), no traceback reaches the log, and the process exits without waiting out uvicorn's grace period."""
import json
import signal
import threading
import time

import httpx

from tests.server.conftest import Server

GRACE_S = 5  # uvicorn's timeout_graceful_shutdown in `fastdecode serve`: before, every request ran into it


def test_ctrl_c_answers_every_request_503_and_exits_at_once(smollm2_path, tmp_path):
    server = Server(smollm2_path, tmp_path, "--speculate", "none", "--max-batch", "1").start()
    try:
        body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
        events, answers = [], []
        first_token = threading.Event()

        def stream():
            with httpx.stream("POST", f"{server.base_url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        first_token.set()

        def plain():
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
            answers.append((r.status_code, r.json()))

        threads = [threading.Thread(target=stream)]
        threads[0].start()
        assert first_token.wait(60)
        threads += [threading.Thread(target=plain) for _ in range(2)]  # these two wait for the one slot
        for t in threads[1:]:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.base_url}/health").json()["queue_depth"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)

        started = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=30)
        seconds = time.monotonic() - started
        for t in threads:
            t.join(30)
    finally:
        server.stop()
    log = server.log.read_text(errors="replace")
    assert seconds < GRACE_S, log[-2000:]
    assert "Traceback" not in log and " 500 " not in log, log[-2000:]
    assert [status for status, _ in answers] == [503, 503]
    assert all(answer["error"]["code"] == "shutting_down" for _, answer in answers)
    assert "choices" in events[0] and events[-1]["error"]["message"].startswith("the server is shutting down")
