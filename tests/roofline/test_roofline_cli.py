"""`fastdecode roofline` and `fastdecode probe` through click, bad input included."""
import json

import pytest
from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.roofline import cli as roofline_cli

BENCH = {"model": "smollm2-135m", "threads": 2, "bandwidth_gb_s": 28.1, "prompt_tokens": 615, "new_tokens": 256,
         "rows": [{"engine": "fastdecode", "format": "int8", "decode_tok_s": {"min": 40.0, "median": 45.3, "max": 47.0},
                   "prefill_tok_s": {"min": 900, "median": 1000, "max": 1100}, "bytes_per_token": 1.4e8},
                  {"engine": "llama.cpp", "format": "Q4_1", "decode_tok_s": {"min": 73.0, "median": 79.0, "max": 84.0},
                   "prefill_tok_s": {"median": 330}}]}
PROBE = {"threads": 2, "bandwidth_gb_s": 25.0, "working_set_gb_s": 50.0, "working_set_bytes": 10**8,
         "matmul_tflops": {"fp32": 0.2, "bf16": 0.5}, "path": "probe.json", "cached": True}


@pytest.fixture(autouse=True)
def quiet_probe(monkeypatch, tmp_path):
    """No real probe in CLI tests: a fixed measurement, and a throwaway FASTDECODE_HOME."""
    monkeypatch.setenv("FASTDECODE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(roofline_cli, "cached_probe", lambda size, threads=None: dict(PROBE))


def run(*args):
    return CliRunner().invoke(main, list(args))


def test_json_has_the_ceiling_bytes_and_bound():
    result = run("roofline", "-m", "llama-3.1-8b", "--hw", "h200", "--dtype", "bf16", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert 290 < doc["decode_tok_s_ceiling"] < 330 and doc["bound"] == "memory"
    assert 14e9 < doc["bytes_per_token"] < 16.5e9
    assert {"ttft_s", "cost_per_million_tokens", "speculation_multiplier", "chips"} <= doc.keys()


def test_table_output_names_the_ceiling():
    result = run("roofline", "-m", "qwen3-coder-30b-a3b", "--hw", "b200", "--context", "32768")
    assert result.exit_code == 0, result.output
    assert "decode ceiling" in result.output and "tok/s" in result.output and "TTFT" in result.output


def test_compare_lists_every_route():
    result = run("roofline", "-m", "llama-3.3-70b", "--compare", "--json")
    assert result.exit_code == 0, result.output
    routes = [r["route"] for r in json.loads(result.output)["routes"]]
    for route in ("HBM GPU", "speculation", "8-way tensor parallel", "SRAM wafer", "hardwired"):
        assert any(route in r for r in routes), routes


@pytest.mark.parametrize("args, message", [
    (["--hw", "h300"], "unknown hardware 'h300'"),
    (["-m", "gpt-5"], "unknown model 'gpt-5'"),
    (["--dtype", "int3"], "unknown weight format 'int3'"),
    (["--accept-length", "9", "--draft-tokens", "2"], "exceeds 2 drafted tokens"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    base = {"-m": "llama-3.1-8b", "--hw": "h200"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    result = run("roofline", *[x for kv in base.items() for x in kv])
    assert result.exit_code == 2
    assert message in result.output and len(result.output.strip().splitlines()) == 1


def test_measured_bench_file_prints_each_rows_efficiency(tmp_path):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    result = run("roofline", "-m", "smollm2-135m", "--hw", "this-machine", "--measured", str(bench), "--json")
    assert result.exit_code == 0, result.output
    fastdecode, llama_cpp = json.loads(result.output)["measured"]
    # the row's own bytes per token, at the bandwidth measured with the run: 28.1 GB/s / 140 MB = 200.7 tok/s
    assert fastdecode["ceiling_tok_s"] == pytest.approx(28.1e9 / 1.4e8)
    assert fastdecode["efficiency"] == pytest.approx(45.3 / (28.1e9 / 1.4e8))
    assert fastdecode["probe_ceiling_tok_s"] == pytest.approx(50e9 / 1.4e8)  # beside it, the probe's figure
    assert llama_cpp["format"] == "Q4_1" and 0 < llama_cpp["efficiency"] < 1
    table = run("roofline", "-m", "smollm2-135m", "--hw", "this-machine", "--measured", str(bench))
    assert table.exit_code == 0 and "fastdecode" in table.output and "23%" in table.output


def test_measured_accepts_a_plain_and_a_speed_lab_file(tmp_path):
    plain, lab = tmp_path / "plain.json", tmp_path / "lab.json"
    plain.write_text(json.dumps({"output_tok_s": 150.0}))
    lab.write_text(json.dumps({"runs": [{"ttft_s": 0.1}], "summary": {"output_tok_s": {"median": 120, "floor": 90}}}))
    for path, speed in ((plain, 150.0), (lab, 120.0)):
        result = run("roofline", "-m", "llama-3.1-8b", "--hw", "h200", "--measured", str(path), "--json")
        assert result.exit_code == 0, result.output
        (row,) = json.loads(result.output)["measured"]
        assert row["decode_tok_s"] == speed
        assert row["efficiency"] == pytest.approx(speed / json.loads(result.output)["decode_tok_s_ceiling"])


def test_measured_file_without_a_speed_is_exit_code_2(tmp_path):
    for text in ("not json", json.dumps({"rows": [{"engine": "x"}]})):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        result = run("roofline", "-m", "llama-3.1-8b", "--hw", "h200", "--measured", str(bad))
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "roofline.png"
    result = run("roofline", "-m", "gpt-oss-120b", "--compare", "--plot", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_probe_command_prints_a_table_and_json(monkeypatch):
    fake = {"threads": 2, "repeats": 3, "bandwidth_gb_s": 25.0, "working_set_gb_s": 50.0,
            "large": {"bytes": 10**9, "gb_s": 25.0, "min": 20.0, "max": 30.0},
            "working_set": {"bytes": 10**8, "gb_s": 50.0, "min": 40.0, "max": 60.0}}
    monkeypatch.setattr(roofline_cli, "measure_bandwidth", lambda *a: dict(fake))
    monkeypatch.setattr(roofline_cli, "measure_matmul", lambda *a: {"fp32": 0.2, "bf16": 0.5})
    table = run("probe")
    assert table.exit_code == 0 and "50.0" in table.output and "GFLOPS" in table.output
    doc = json.loads(run("probe", "--json").output)
    assert doc["working_set_gb_s"] == 50.0 and doc["matmul_tflops"]["bf16"] == 0.5
