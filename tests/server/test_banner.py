"""What `fastdecode serve` prints once loaded: the context and what set it, the KV budget, the decode ceiling, and
the lines that connect each agent; never the API key."""
from tests.server.conftest import API_KEY


def banner(server) -> str:
    text = server.log.read_text(errors="replace")
    return text[:text.index("Started server process")] if "Started server process" in text else text


def test_the_banner_says_the_context_the_kv_budget_and_the_ceiling(server):
    text = banner(server)
    assert "context    2,048 tokens (--max-seq-len; the model was trained for 8,192)" in text
    assert "KV cache   " in text and " GB at most" in text
    assert "decode ceiling " in text and " tok/s for one stream" in text
    assert f"dashboard  {server.base_url}/" in text


def test_the_banner_connects_each_agent_without_showing_the_key(server):
    text = banner(server)
    assert API_KEY not in text
    for line in ("Claude Code: ANTHROPIC_BASE_URL=" + server.base_url, "Codex CLI: FASTDECODE_API_KEY=YOUR_KEY codex",
                 "opencode: OPENCODE_CONFIG_CONTENT="):
        assert line in text, line
