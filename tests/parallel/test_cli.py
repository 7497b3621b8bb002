"""`--tp` on the command line: torchrun runs generate on two ranks and only rank 0 prints; serve batches requests
on two ranks; a model that cannot be split is one error line; a rank that dies takes the other one down within
seconds, it never hangs."""
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.engine.llm import LLM
from fastdecode.engine.sampling import SamplingParams
from fastdecode.lab.local_server import LocalServer
from tests.helpers.checkpoints import checkpoint
from tests.parallel.ranks import WORLD, free_port

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(WORLD), "--master-port"]
ONE_THREAD = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def torchrun(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHRUN, str(free_port()), "-m", "fastdecode", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, **ONE_THREAD, **(env or {})})


def test_torchrun_generate_tp2_prints_tp1_tokens_once():
    path = str(checkpoint("llama_uneven").gguf_path)  # uneven heads, MLP and vocabulary (tests/parallel/helpers)
    prompt = "abcabcabcab"
    # No --max-seq-len: the ranks agree on the default context (the trained one, as far as every rank's budget holds).
    result = torchrun("generate", "-m", path, "-p", prompt, "--max-tokens", "16", "--json",
                      "--speculate", "ngram", "--threads", "1", "--tp", "2")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1  # rank 1 prints nothing
    one = LLM(path, max_seq_len=96).generate(prompt, SamplingParams(max_tokens=16, temperature=0))
    assert json.loads(lines[0])["token_ids"] == one.token_ids


def test_torchrun_serve_tp2_answers_requests_at_once_as_one_process_does():
    """`serve --tp 2` (torchrun, as LocalServer launches it): 3 requests at once share the engine's steps, and each
    reply is the one one process gives it alone. With --kv-cache-gb and no --max-seq-len, the ranks agree on the
    context one process chooses (its float16 KV cache holds 96 tokens of this model, 128 trained)."""
    path = str(checkpoint("llama_uneven").gguf_path)
    prompts = ["abcabcab", "hello there", "xyzzy xyzzy"]
    kv_cache_gb = 96 * 384 / 1e9  # 2 layers x 3 KV heads x 16 x (key, value) x 2 bytes = 384 bytes a token
    one = LLM(path, kv_cache_gb=kv_cache_gb)
    assert one.context.tokens == 96
    want = [one.generate(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).text for p in prompts]
    args = f"--tp 2 --threads 1 --kv-cache-gb {kv_cache_gb!r} --speculate none --max-batch 4"
    with LocalServer(path, serve_args=(args,), startup_timeout_s=120) as server:
        card = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]
        assert card["max_model_len"] == one.context.tokens
        def complete(prompt: str) -> str:
            body = {"model": server.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, prompts))
        assert httpx.get(f"{server.base_url}/health").json()["engine_running"] == 0
    assert got == want


def config_dir(path: Path, heads: int) -> Path:
    """A Llama config.json alone: enough for every check made before the ranks meet."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 16 * heads,
              "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": heads,
              "num_key_value_heads": heads}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("heads,args,message", [
    (1, [], "error: cannot split 1 attention heads across 2 ranks: every rank needs a query head of its own "
            "(--tp 1 at most)"),
    (2, ["--quant", "gguf"], "error: --quant gguf keeps a GGUF file's own quantized weights; {dir} is not a GGUF "
                             "file"),
    (2, [], "error: --tp 2 runs one process per rank: launch it as `torchrun --nproc-per-node 2 -m fastdecode ...` "
            "(this process sees WORLD_SIZE=1)"),
], ids=["one-head", "quant-gguf", "no-torchrun"])
def test_what_tp_cannot_do_is_one_error_line(tmp_path, heads, args, message):
    result = CliRunner().invoke(main, ["generate", "-m", str(config_dir(tmp_path, heads)), "-p", "hi", "--tp", "2",
                                       *args])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == message.format(dir=tmp_path)


def launch_chat_ranks(path: str, tmp: Path, shm: str = "1") -> list[subprocess.Popen]:
    """Two ranks started by hand (no torchrun to kill the survivor): the test sees what our own timeout and error
    handling do. FASTDECODE_TP_TIMEOUT=6: rank 0 pings an idle group every 3 s. shm "0": the ranks talk over gloo."""
    env = {**os.environ, **ONE_THREAD, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "FASTDECODE_TP_TIMEOUT": "6", "FASTDECODE_TP_SHM": shm}
    ranks = []
    for rank in range(WORLD):
        ranks.append(subprocess.Popen(
            [sys.executable, "-m", "fastdecode", "chat", "-m", path, "--max-seq-len", "96", "--max-tokens", "8",
             "--speculate", "none", "--threads", "1", "--tp", str(WORLD)],
            stdin=subprocess.PIPE, stdout=open(tmp / f"out{rank}", "w"), stderr=open(tmp / f"err{rank}", "w"),
            text=True, cwd=REPO, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}))
    ranks[0].stdin.write("abcab\n")  # one answer proves the group works before a rank is killed
    ranks[0].stdin.flush()
    deadline = time.monotonic() + 90
    while "tok/s" not in (tmp / "err0").read_text():
        assert time.monotonic() < deadline and ranks[0].poll() is None, (tmp / "err0").read_text()
        time.sleep(0.2)
    return ranks


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
@pytest.mark.parametrize("dead", [1, 0], ids=["follower-dies", "rank0-dies"])
def test_a_dead_rank_makes_the_other_exit_nonzero(tmp_path, dead, shm):
    ranks = launch_chat_ranks(str(checkpoint("mistral").gguf_path), tmp_path, shm)
    survivor = ranks[1 - dead]
    try:
        ranks[dead].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        code = survivor.wait(timeout=30)  # rank 0 idles in chat, so only the keep-alive can notice
        assert code != 0 and time.monotonic() - t0 < 20
        assert "tensor-parallel group failed" in (tmp_path / f"err{1 - dead}").read_text()
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
