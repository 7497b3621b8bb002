"""Tenants: each API key's prefix cache is its own, so a client learns nothing from another's cached prompts (a
hit's count or its speed), unless the server is told to share; a request's `cache_salt` splits a tenant's cache
further. In process: the real engine on SmolLM2-135M behind the app."""
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from fastdecode.engine.llm import LLM
from fastdecode.server.app import cache_salt, create_app
from fastdecode.server.cli import read_keys_file
from fastdecode.server.config import ServerConfig

KEYS = {"alice-key": "alice", "bob-key": "bob"}
DOCUMENT = "The vault PIN is 4711. " + "Keep this document to yourself. " * 20


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = LLM(str(smollm2_path), threads=2, max_seq_len=1024, kv_disk_gb=0)
    yield llm
    llm.close()


def client(llm, **config):
    config = ServerConfig(api_keys=KEYS, served_model_name="smollm2-135m", **config)
    return TestClient(create_app(llm, config), base_url="http://127.0.0.1:8000")


def cached(http, key: str, prompt: str, **extra) -> int:
    response = http.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 1, **extra})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_tenant_never_hits_another_tenants_cached_prompt(llm):
    llm.kv.clear()
    with client(llm) as http:
        cached(http, "alice-key", DOCUMENT)
        assert cached(http, "alice-key", DOCUMENT) > 100  # alice's own repeat hits
        assert cached(http, "bob-key", DOCUMENT) == 0  # as for a document nobody sent
        assert cached(http, "bob-key", DOCUMENT) > 100  # bob's own cache now has it


def test_a_shared_prefix_cache_is_an_explicit_choice(llm):
    llm.kv.clear()
    with client(llm, share_prefix_cache=True) as http:
        cached(http, "alice-key", DOCUMENT)
        assert cached(http, "bob-key", DOCUMENT) > 100


def test_a_cache_salt_splits_a_tenants_cache(llm):
    llm.kv.clear()
    with client(llm) as http:
        cached(http, "alice-key", DOCUMENT, cache_salt="project-a")
        assert cached(http, "alice-key", DOCUMENT, cache_salt="project-b") == 0
        assert cached(http, "alice-key", DOCUMENT, cache_salt="project-a") > 100


def test_salts_of_tenants_and_requests_never_collide():
    salts = {cache_salt(t, s) for t in (None, "a", "b") for s in (None, "x", "tenant:a")}
    assert len(salts) == 9 and cache_salt(None, None) == "" and cache_salt("a", "x", shared=True) == cache_salt(None, "x")


def test_a_keys_file_names_its_tenants_and_a_bad_line_is_one_error(tmp_path):
    good = tmp_path / "keys"
    good.write_text("# team keys\nalice sk-a1\n\nbob sk-b2\n")
    assert read_keys_file(str(good)) == {"sk-a1": "alice", "sk-b2": "bob"}
    bad = tmp_path / "bad"
    bad.write_text("alice\n")
    from fastdecode.cli import main

    result = CliRunner().invoke(main, ["serve", "--api-keys-file", str(bad)])
    assert result.exit_code == 2 and "NAME KEY" in result.output


def test_a_cache_salt_that_is_not_text_is_a_400_and_the_engine_goes_on(llm):
    """A lone surrogate (valid JSON, not UTF-8) is refused at the edge; the engine's salt hash takes any str anyway."""
    body = b'{"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 1, "cache_salt": "\\ud800"}'
    with client(llm) as http:
        response = http.post("/v1/completions", content=body,
                             headers={"Authorization": "Bearer alice-key", "Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "cache_salt"
        assert cached(http, "alice-key", "Hello", cache_salt="x") == 0  # the engine still serves
