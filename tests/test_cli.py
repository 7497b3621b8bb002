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


def test_the_speed_tables_prefill_ceiling_is_its_flops_at_the_matrix_peak_or_one_read_of_the_weights(smollm2_path):
    from types import SimpleNamespace

    from fastdecode.engine.cli import prefill_rows
    from fastdecode.engine.timings import Timings
    from fastdecode.roofline.models import get_model

    spec = get_model(str(smollm2_path))
    llm = SimpleNamespace(path=smollm2_path, quant="gguf", decode_path="native")
    peaks = {"fp32": 0.1, "bf16": 0.2, "int8": 0.8}
    t = Timings(prompt_tokens=2000, cached_tokens=500, prefill_s=1.5)  # 1,000 computed tokens a second
    rows = dict(prefill_rows(llm, t, peaks, read_s=0.001))
    ceiling = 1500 / (spec.flops(1500, 500, sampled=1) / 0.8e12)
    assert rows["matrix peak (probe)"] == "800 GOP/s int8 GEMM (torch)"
    assert rows["prefill ceiling"] == f"{ceiling:,.0f} tok/s (compute-bound)"
    assert rows["share of prefill ceiling"].startswith(f"{100 * 1000 / ceiling:.0f}% (")
    short = dict(prefill_rows(llm, Timings(prompt_tokens=7, prefill_s=0.1), peaks, read_s=0.05))
    assert short["prefill ceiling"] == "140 tok/s (memory-bound)"  # 7 tokens in one 50 ms read of the weights
    floats = dict(prefill_rows(SimpleNamespace(path=smollm2_path, quant=None, decode_path="pytorch"), t, peaks,
                               read_s=0.001))
    assert floats["share of prefill ceiling"].endswith("float32 prompt attention)")
    assert floats["matrix peak (probe)"] == "200 GFLOP/s bf16"
    assert prefill_rows(llm, t, {}, read_s=0.001) == []  # no probe figure, no row
    # Where the kernels' own int8 path outruns the library's int8 GEMM (torch's is a scalar loop without AVX-512), the
    # integer formats are set against the path.
    avx2 = dict(prefill_rows(llm, t, {**peaks, "int8": 0.002, "kernels": {"int8 avx2": 0.12, "fp32 fma": 0.06}},
                             read_s=0.001))
    assert avx2["matrix peak (probe)"] == "120 GOP/s int8 avx2 instructions"
