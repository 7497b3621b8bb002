"""The command line: JSON output, speed line, and one-line errors with exit code 2 for a user's mistakes."""
import json

import pytest
from click.testing import CliRunner

from fastdecode.cli import main


@pytest.fixture()
def runner():
    return CliRunner()


def test_generate_json_has_text_tokens_and_timings(runner, smollm2_path):
    result = runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "def add(a, b):", "--max-tokens", "8",
                                  "--json", "--max-seq-len", "256"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 8 and isinstance(out["text"], str) and out["prompt_tokens"] > 0
    assert {"ttft_s", "prefill_tok_s", "output_tok_s"} <= set(out["timings"])


def test_generate_streams_text_then_a_speed_line(runner, smollm2_path):
    result = runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "Hello", "--max-tokens", "6",
                                  "--max-seq-len", "128"])
    assert result.exit_code == 0, result.output
    assert "decode" in result.stderr and "tok/s" in result.stderr


@pytest.mark.parametrize("flags,quant", [([], "gguf"), (["--quant", "none"], "none"), (["--dtype", "float32"], "none"),
                                         (["--quant", "int4"], "int4")],
                         ids=["default-file-format", "quant-none", "dtype-alone", "int4"])
def test_a_gguf_runs_in_its_own_format_unless_float_or_a_scheme_is_asked(runner, smollm2_path, flags, quant):
    result = runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "Hi", "--max-tokens", "2", "--json",
                                  "--max-seq-len", "64", "--speculate", "none", *flags])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["quant"] == quant


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in result.output
    return lines[0]


def test_missing_model_file_is_one_line_error(runner, tmp_path):
    line = one_line_error(runner.invoke(main, ["generate", "-m", str(tmp_path / "x.gguf"), "-p", "hi"]))
    assert "x.gguf" in line


def test_truncated_gguf_is_one_line_error(runner, smollm2_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_path.read_bytes()[: 5_000_000])
    assert "truncated" in one_line_error(runner.invoke(main, ["generate", "-m", str(cut), "-p", "hi"]))


def test_not_a_gguf_is_one_line_error(runner, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_text("hello")
    one_line_error(runner.invoke(main, ["generate", "-m", str(bad), "-p", "hi"]))


def test_invalid_sampling_parameter_is_one_line_error(runner, smollm2_path):
    line = one_line_error(runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "hi", "--top-p", "0"]))
    assert "top_p" in line


def test_prompt_longer_than_context_is_one_line_error(runner, smollm2_path):
    line = one_line_error(runner.invoke(main, ["generate", "-m", str(smollm2_path), "-p", "word " * 200,
                                               "--max-seq-len", "64"]))
    assert "context" in line


def test_models_lists_registered_names(runner):
    result = runner.invoke(main, ["models"])
    assert result.exit_code == 0 and "smollm2-135m" in result.output and "gemma3-270m" in result.output
