"""The dashboard: its data (numbers only, behind the key, a tenant's own requests), and its page in headless Chromium
(Debian's /usr/bin/chromium driven by playwright, as tests/lab/test_report.py) during load on the real server: charts
drawn, then changed a few seconds later, the chat box answered, and nothing shown without the key."""
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from fastdecode.engine.timings import Timings
from fastdecode.engine.llm import Completion, StreamChunk
from fastdecode.server.dashboard import Recorder, summary
from tests.helpers.chromium import headless_chromium
from tests.server.conftest import API_KEY
from tests.server.stub import Chunks, stub_client

KEY, OTHER_KEY = "k3y", "other-k3y"
PROMPT = "the secret plans of tenant one"


class TimedLLM:
    """Answers any prompt with two tokens and fixed timings: 8 prompt tokens, 4 of them cached, 3 of 4 drafts
    accepted."""
    name, max_seq_len, engine = "stub", 64, None
    slots = 1
    config = SimpleNamespace(vocab_size=100)
    tokenizer = SimpleNamespace(max_token_chars=4)

    @staticmethod
    def context_hint() -> str:
        return ""

    @staticmethod
    def encode_prompt(text: str) -> list[int]:
        return [ord(c) % 100 for c in text[:8]]

    def astream(self, prompt_ids, params, logits_processor=None, **kw):
        return Chunks(self.stream(prompt_ids))

    def stream(self, prompt_ids):
        timings = Timings(prompt_tokens=len(prompt_ids), output_tokens=2, ttft_s=0.05, prefill_s=0.04, decode_s=0.02,
                          cached_tokens=4)
        yield StreamChunk("he", [1])
        yield StreamChunk("llo", [2], completion=Completion("hello", [1, 2], prompt_ids, "stop", timings,
                                                            {"drafted": 4, "accepted": 3}))


def complete(client, key: str, prompt: str = PROMPT):
    response = client.post("/v1/completions", json={"model": "stub", "prompt": prompt, "max_tokens": 2},
                           headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text


@pytest.fixture()
def keyed():
    with stub_client(TimedLLM(), api_key=KEY, api_keys={OTHER_KEY: "other"}) as client:
        yield client


def test_data_gives_each_finished_request_as_numbers(keyed):
    for _ in range(3):
        complete(keyed, KEY)
    response = keyed.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY}"})
    data = response.json()
    assert response.status_code == 200 and PROMPT not in response.text and "hello" not in response.text
    assert data["requests"]["ttft_s"] == [0.05] * 3 and data["requests"]["decode_tok_s"] == [50.0] * 3
    assert data["summary"] == {"requests": 3, "ttft_s_median": 0.05, "decode_tok_s_mean": 50.0,
                               "decode_tok_s_floor": 50.0, "prompt_tokens": 24, "cached_tokens": 12, "hit_rate": 0.5,
                               "drafted": 12, "accepted": 9, "acceptance": 0.75}
    # The single-request loop: no paged KV cache, and a stub has no roofline; the gauges are sampled all the same.
    assert data["kv_capacity_tokens"] is None and data["ceiling"] is None
    assert data["gauges"]["running"][-1] == 0 and data["gauges"]["queued"][-1] == 0


def test_data_needs_the_key_and_the_page_does_not(keyed):
    complete(keyed, KEY)
    refused = keyed.get("/dashboard/data")
    assert refused.status_code == 401 and PROMPT not in refused.text
    assert keyed.get("/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
    page = keyed.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'none'" in page.headers["content-security-policy"]  # the browser fetches nothing elsewhere
    assert "http://" not in page.text and "https://" not in page.text


def test_a_tenant_sees_only_its_own_requests(keyed):
    complete(keyed, KEY)
    other = keyed.get("/dashboard/data", headers={"Authorization": f"Bearer {OTHER_KEY}"}).json()
    assert other["requests"]["t"] == [] and other["summary"]["requests"] == 0


def test_gauges_read_the_engine_kv_cache_in_tokens():
    kv = SimpleNamespace(num_blocks=10, block_size=16, available=7, idle={1: None, 2: None}, capacity=160)
    llm = SimpleNamespace(engine=SimpleNamespace(kv=kv, num_running=2, num_waiting=1, threads=2))
    sample = Recorder(llm, SimpleNamespace(busy=2, waiting=3)).sample()
    # 3 blocks referenced, 2 of the available ones hold idle cached prefixes; queued: the server's and the engine's
    assert (sample.running, sample.queued, sample.kv_used_tokens, sample.kv_cached_tokens) == (2, 4, 48, 32)


def test_summary_of_an_empty_window_has_no_rates():
    assert summary([]) == {"requests": 0, "ttft_s_median": None, "decode_tok_s_mean": None, "decode_tok_s_floor": None,
                           "prompt_tokens": 0, "cached_tokens": 0, "hit_rate": None, "drafted": 0, "accepted": 0,
                           "acceptance": None}


# ---- the page in headless Chromium, on the real server (tests/server/conftest.py: SmolLM2, API key) ----------------
CHARTS = ["c-requests", "c-ttft", "c-decode", "c-prefill", "c-cache", "c-kv", "c-accept"]
LOAD_PROMPT = "Name three colours of the rainbow, then stop."


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as browser:
        yield browser


class Load:
    """Two clients sending short streamed chats, one after another each, until stopped; every status kept."""

    def __init__(self, base_url: str):
        self.base_url, self.statuses, self.stopping = base_url, [], threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(2)]

    def _client(self):
        with httpx.Client(base_url=self.base_url, timeout=60, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            while not self.stopping.is_set():
                body = {"model": "smollm2-135m", "max_tokens": 12, "temperature": 0, "stream": True,
                        "messages": [{"role": "user", "content": LOAD_PROMPT}]}
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    r.read()
                    self.statuses.append(r.status_code)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stopping.set()
        for t in self.threads:
            t.join(60)


def open_page(browser, base_url: str, key: str | None):
    context = browser.new_context(viewport={"width": 1280, "height": 1400})
    if key:
        context.add_init_script(f"sessionStorage.setItem('fastdecode-api-key', {key!r})")
    page = context.new_page()
    page.statuses = []
    page.on("response", lambda r: page.statuses.append(r.status))
    page.on("request", lambda r: page.statuses.append(0) if not r.url.startswith(base_url) else None)
    page.goto(base_url + "/")
    return page


def drawn(page) -> dict:
    """Each chart's data points and its pixels other than the white background."""
    return page.evaluate("""ids => Object.fromEntries(ids.map(id => {
        const c = document.getElementById(id), px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let ink = 0;
        for (let i = 0; i < px.length; i += 4) if (px[i] < 250 || px[i + 1] < 250 || px[i + 2] < 250) ink++;
        return [id, [+c.dataset.points, ink, c.width * c.height]]; }))""", CHARTS)


def test_dashboard_charts_render_and_update_under_load(browser, server):
    with Load(server.base_url) as load:
        page = open_page(browser, server.base_url, API_KEY)
        page.wait_for_function("() => +document.getElementById('c-decode').dataset.points >= 2", timeout=20_000)
        first = page.locator("#charts").screenshot()
        before = drawn(page)
        time.sleep(2)
        page.wait_for_function(f"() => +document.getElementById('c-ttft').dataset.points > {before['c-ttft'][0]}",
                               timeout=20_000)
        second = page.locator("#charts").screenshot()
        after = drawn(page)
        status = page.locator("#status").text_content()
        page.context.close()
    assert first != second  # the charts moved: new requests, new samples
    for chart in ("c-requests", "c-ttft", "c-decode", "c-prefill", "c-cache", "c-kv"):
        points, ink, area = after[chart]
        assert points > 0 and ink > 0.01 * area, (chart, after[chart])  # data drawn, not an empty frame
    assert after["c-ttft"][0] > before["c-ttft"][0] and status == "live"
    assert load.statuses and all(s == 200 for s in load.statuses)
    assert page.statuses and all(0 < s < 500 for s in page.statuses), page.statuses  # no 5xx, no other origin


def test_dashboard_without_the_key_shows_nothing_of_the_requests(browser, server):
    with Load(server.base_url):
        page = open_page(browser, server.base_url, None)
        page.wait_for_function("() => document.getElementById('status').textContent === 'API key required'",
                               timeout=10_000)
        time.sleep(1.5)  # a few polls during load
        text = page.locator("body").inner_text()
        points = drawn(page)
        page.context.close()
    assert LOAD_PROMPT not in text and "rainbow" not in text.lower()
    assert all(p[0] == 0 for p in points.values())
    assert 401 in page.statuses and all(s < 500 for s in page.statuses)


def test_dashboard_chat_box_streams_a_reply(browser, server):
    page = open_page(browser, server.base_url, API_KEY)
    page.fill("#maxtokens", "8")
    page.fill("#prompt", "Say hello.")
    page.click("#send")
    page.wait_for_function("() => document.querySelector('#log .note').textContent.startsWith('TTFT')",
                           timeout=20_000)
    reply = page.locator("#log .assistant").text_content()
    page.context.close()
    assert reply.strip()
