"""The lab's own server for a local model: started, waited for, stopped; and the whole lab against a real
`fastdecode serve` on SmolLM2-135M."""
import json
import sys

import httpx
import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.agents.server import ServerStartError
from fastdecode.lab.local_server import LocalServer


def test_server_is_waited_for_then_stopped(tmp_path):
    (tmp_path / "health").write_text("ok")
    server = LocalServer("any")
    server.command = [sys.executable, "-m", "http.server", str(server.port), "--bind", "127.0.0.1",
                      "--directory", str(tmp_path)]  # a stand-in whose GET /health answers 200
    with server:
        assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert server.process.poll() is not None


def test_a_server_that_exits_is_one_error_with_its_log():
    server = LocalServer("any")
    server.command = [sys.executable, "-c", "import sys; print('boom: model not found'); sys.exit(3)"]
    with pytest.raises(ServerStartError, match="exited with code 3: boom: model not found"):
        with server:
            pass


def test_serve_args_split_into_words():
    server = LocalServer("m", speculate="ngram", serve_args=("--quant int4", "--threads=2"))
    words = ["-m", "m", "--host", "127.0.0.1", "--port", str(server.port), "--speculate", "ngram", "--quant", "int4",
             "--threads=2"]
    assert server.command[-len(words):] == words
    assert server.command_line() == "fastdecode serve " + " ".join(words)


def test_lab_against_real_fastdecode_serve(smollm2_path, tmp_path):
    result = CliRunner().invoke(main, [
        "bench", "-m", "smollm2-135m", "--speculate", "none", "--workload", "code_edit", "--per-category", "2",
        "--max-tokens", "24",
        "--mode", "sequential", "--mode", "sweep", "--concurrency", "1,2", "--requests-per-user", "1",
        "--hw", "none", "--db", str(tmp_path / "lab.sqlite"), "--json", str(tmp_path / "s.json"),
        "--report", str(tmp_path / "r.html")])
    assert result.exit_code == 0, result.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["overall"]["requests"] == 2 + 1 + 2 and s["overall"]["errors"] == 0
    assert 0 < s["overall"]["output_tokens"]["max"] <= 24
    assert s["overall"]["output_tok_s"]["median"] > 1 and s["overall"]["ttft_s"]["median"] > 0
    assert "plot-concurrency" in (tmp_path / "r.html").read_text()
