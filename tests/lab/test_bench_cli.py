"""`fastdecode bench` end to end against the scripted SSE server: modes, storage, list/show/compare, reports,
and one-line errors with exit code 2."""
import json
import sqlite3

import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.lab.local_server import free_port
from tests.lab.sse_server import Script, ScriptedServer

# Plumbing tests, with loose timing checks (20%); tests/lab/test_client.py holds the lab to 10% of a script.
FAST = Script(ttft_s=0.05, itl_s=0.02, tokens=12)
SCRIPTS = {"fast": FAST, "slow": Script(ttft_s=0.05, itl_s=0.04, tokens=12), "json": Script(mode="json"),
           "flaky": Script(ttft_s=0.02, itl_s=0.005, tokens=6, fail_every=3)}


@pytest.fixture(scope="module")
def server():
    with ScriptedServer(SCRIPTS) as s:
        yield s


def bench(*args, db=None):
    result = CliRunner().invoke(main, ["bench", *args, *(["--db", str(db)] if db else [])])
    return result


def run_ok(server, tmp_path, *args, model="fast"):
    result = bench("--endpoint", server.url, "--model", model, "--workload", "explanation", "--per-category", "2",
                   *args, db=tmp_path / "lab.sqlite")
    assert result.exit_code == 0, result.output
    return result


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output, result.output
    return lines[0]


def test_sequential_and_sweep_store_a_run_and_write_report_and_json(server, tmp_path):
    result = run_ok(server, tmp_path, "--mode", "sequential", "--mode", "sweep", "--concurrency", "1,2",
                    "--requests-per-user", "1", "--report", str(tmp_path / "r.html"), "--json",
                    str(tmp_path / "r.json"), "--price-input", "1", "--price-output", "2")
    assert "concurrency sweep" in result.stdout and "output tok/s" in result.stdout
    summary = json.loads((tmp_path / "r.json").read_text())
    assert summary["overall"]["requests"] == 2 + 1 + 2 and summary["overall"]["errors"] == 0
    assert summary["by_phase"]["c=2"]["concurrency"] == 2
    assert summary["overall"]["output_tok_s"]["median"] == pytest.approx(50, rel=0.2)
    assert summary["cost"]["per_request_usd"] == pytest.approx((17 * 1 + 12 * 2) / 1e6)
    assert "python" in summary["environment"] and "git_commit" in summary["environment"]  # what was measured
    html = (tmp_path / "r.html").read_text()
    for plot in ("speed-by-category", "speed-over-time", "concurrency", "ttft-vs-speed"):
        assert f"id='plot-{plot}'" in html
    with sqlite3.connect(tmp_path / "lab.sqlite") as db:
        assert db.execute("SELECT count(*) FROM requests").fetchone() == (5,)
        config, env = db.execute("SELECT config, environment FROM runs").fetchone()
    assert json.loads(config)["modes"] == ["sequential", "sweep"] and "python" in json.loads(env)


def test_a_sweep_with_repeats_passes_over_every_level_in_turn(server, tmp_path):
    result = run_ok(server, tmp_path, "--mode", "sweep", "--concurrency", "1,2", "--requests-per-user", "1",
                    "--repeats", "2", "--json", str(tmp_path / "r.json"), "--report", str(tmp_path / "r.html"))
    assert "x 1 user" in result.stdout and "median of the passes" in result.stdout
    assert "<th>x 1 user</th>" in (tmp_path / "r.html").read_text()
    level = json.loads((tmp_path / "r.json").read_text())["by_phase"]["c=2"]
    assert level["passes"] == 2 and len(level["throughput_passes_tok_s"]) == 2 and level["requests"] == 4
    with sqlite3.connect(tmp_path / "lab.sqlite") as db:
        sent = db.execute("SELECT phase, repeat, min(sent_at), max(sent_at) FROM requests GROUP BY phase, repeat "
                          "ORDER BY min(sent_at)").fetchall()
    assert [(phase, repeat) for phase, repeat, _, _ in sent] == [("c=1", 0), ("c=2", 0), ("c=1", 1), ("c=2", 1)]
    assert all(earlier[3] < later[2] for earlier, later in zip(sent, sent[1:]))  # one pass of a level at a time


def test_list_show_and_compare_read_stored_runs(server, tmp_path):
    run_ok(server, tmp_path, "--label", "first")
    run_ok(server, tmp_path, "--label", "second", model="slow")
    listed = bench("list", db=tmp_path / "lab.sqlite")
    assert listed.exit_code == 0 and "first" in listed.stdout and "second" in listed.stdout
    shown = bench("show", "2", "--json", db=tmp_path / "lab.sqlite")
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["overall"]["output_tok_s"]["median"] == pytest.approx(25, rel=0.2)
    report = bench("show", "last", "--report", str(tmp_path / "again.html"), db=tmp_path / "lab.sqlite")
    assert report.exit_code == 0 and "plot-speed-by-category" in (tmp_path / "again.html").read_text()
    compared = bench("compare", "1", "2", db=tmp_path / "lab.sqlite")
    assert compared.exit_code == 0 and "run 2 against run 1" in compared.stdout
    row = next(line for line in compared.stdout.splitlines() if "all" in line and "median tok/s" in line)
    assert float(row.split("│")[-2]) == pytest.approx(0.5, rel=0.2)  # run 2 decodes at half the speed
    assert "no run 9" in one_line_error(bench("show", "9", db=tmp_path / "lab.sqlite"))


def test_compare_mode_interleaves_two_endpoints(server, tmp_path):
    run_ok(server, tmp_path, "--mode", "compare", "--b-endpoint", server.url, "--b-model", "slow",
           "--json", str(tmp_path / "c.json"))
    s = json.loads((tmp_path / "c.json").read_text())
    assert s["compare"]["pairs"] == 2 and s["compare"]["speed_ratio_b_over_a"] == pytest.approx(0.5, rel=0.2)
    models = [b["model"] for b in server.bodies[-4:]]
    assert models == ["fast", "slow", "fast", "slow"]  # A B A B


def test_soak_gives_speed_over_time(server, tmp_path):
    run_ok(server, tmp_path, "--mode", "soak", "--duration", "1.5", "--interval", "0.5", "--json",
           str(tmp_path / "s.json"))
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["by_phase"]["soak"]["requests"] >= 4 and len(s["speed_over_time"]) >= 2


def test_unique_prompts_put_a_different_nonce_first_in_every_request(server, tmp_path):
    before = len(server.bodies)
    run_ok(server, tmp_path, "--unique-prompts", "--warmup", "0")
    firsts = [b["messages"][0]["content"] for b in server.bodies[before + 1:]]  # after the endpoint check
    assert len(firsts) == 2 and all(f.startswith("[request ") for f in firsts) and firsts[0] != firsts[1]


def test_synthetic_and_file_workloads(server, tmp_path):
    before = len(server.bodies)
    result = bench("--endpoint", server.url, "--model", "fast", "--input-tokens", "40", "--output-tokens", "9",
                   "--synthetic-requests", "2", "--warmup", "0", db=tmp_path / "lab.sqlite")
    assert result.exit_code == 0, result.output
    assert [b["max_tokens"] for b in server.bodies[before + 1:]] == [9, 9]
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "q"}], "max_tokens": 5, "category": "mine"})
                    + "\n")
    result = bench("--endpoint", server.url, "--model", "fast", "--workload-file", str(path), "--warmup", "0",
                   db=tmp_path / "lab.sqlite")
    assert result.exit_code == 0 and server.bodies[-1]["max_tokens"] == 5


def test_failed_requests_are_recorded_and_shown(server, tmp_path):
    # flaky fails every 3rd request: the check (1) and warm-up (2) pass, then requests 3 and 6 fail
    result = run_ok(server, tmp_path, "--per-category", "4", "--json", str(tmp_path / "f.json"), model="flaky")
    s = json.loads((tmp_path / "f.json").read_text())
    assert s["overall"]["requests"] == 4 and s["overall"]["errors"] == 2
    assert s["overall"]["error_kinds"] == {"http 500": 2}
    assert "errors: http 500 x2" in result.stdout


@pytest.mark.parametrize("args, says", [
    (["--endpoint", "http://127.0.0.1:{port}", "--model", "fast"], "cannot reach"),
    (["--endpoint", "{url}", "--model", "json"], "does not stream"),
    (["--endpoint", "{url}", "--model", "fast", "--api-key-env", "FASTDECODE_NO_SUCH_VAR"], "not set"),
    (["--model", "fast"], "either --endpoint"),
    (["--endpoint", "{url}"], "needs --model"),
    (["--endpoint", "{url}", "--model", "fast", "--workload", "nope"], "unknown workload"),
    (["--endpoint", "{url}", "--model", "fast", "--mode", "compare"], "needs B"),
    (["--endpoint", "{url}", "--model", "fast", "--concurrency", "1,x"], "--concurrency"),
])
def test_mistakes_are_one_line_errors(server, tmp_path, args, says):
    args = [a.format(url=server.url, port=free_port()) for a in args]
    assert says in one_line_error(bench(*args, db=tmp_path / "lab.sqlite"))


def test_refused_key_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_TEST_KEY", "sk-wrong")
    with ScriptedServer({"fast": FAST}, api_key="sk-right") as s:
        line = one_line_error(bench("--endpoint", s.url, "--model", "fast", "--api-key-env", "LAB_TEST_KEY",
                                    db=tmp_path / "lab.sqlite"))
    assert "refused the API key" in line and "401" in line
