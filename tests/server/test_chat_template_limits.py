"""A chat template that passes the load's probe conversation and goes past its render limits on a request
(loading/chat_template.py): that request gets a 400 saying so, and the server goes on answering."""
from fastdecode.loading.tokenizer import Tokenizer
from tests.loading.test_tokenizer import tiny_gpt2
from tests.server.stub import MODEL, UnreachableLLM, stub_client

# 40M characters, past the limit of 32 Mi, for one word the probe conversation never says (unbounded, this is
# 40 MB to render and then a context-length error)
TEMPLATE = "{% if messages[-1].content == 'boom' %}{{ 'x' * 40000000 }}{% endif %}{{ messages[-1].content }}"


class TemplatedLLM(UnreachableLLM):
    """Renders chats with a real tokenizer's template; a request that gets past that reaches the engine (and fails)."""

    def __init__(self):
        self.tokenizer = Tokenizer.from_gguf({**tiny_gpt2(), "tokenizer.chat_template": TEMPLATE})

    def render_chat(self, messages, tools=None, template_kwargs=None) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, **(template_kwargs or {}))


def test_a_request_past_the_template_limits_is_a_400_and_the_server_goes_on():
    with stub_client(TemplatedLLM()) as client:
        response = client.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "boom"}]})
        assert response.status_code == 400, response.text
        assert "chat template failed: went past its limit" in response.json()["error"]["message"]
        assert client.get("/health").status_code == 200
