"""`fastdecode eval` on the real SmolLM2-135M, with a small budget."""
import json

from click.testing import CliRunner

from fastdecode.cli import main
from fastdecode.eval.cli import one_model, reference_model
from fastdecode.quant.checkpoint import save_quantized
from tests.helpers.tiny import tiny_model


def test_eval_json_reports_fidelity_against_float32(smollm2_path):
    result = CliRunner().invoke(main, ["eval", "-m", str(smollm2_path), "--quant", "int8", "--tokens", "256",
                                       "--window", "128", "--greedy-tokens", "4", "--threads", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"perplexity", "reference_perplexity", "top1_agreement", "bytes_per_token"} <= set(out)
    assert out["scored_tokens"] == 2 * 127 and len(out["corpus"]["files"]) == 2
    assert 0.9 <= out["top1_agreement"] <= 1.0 and 0 <= out["greedy_agreement"] <= 1
    assert abs(out["perplexity"] / out["reference_perplexity"] - 1) < 0.05
    assert out["bytes_per_token"] < out["reference_bytes_per_token"] / 3


def test_a_quantized_checkpoint_is_compared_with_its_source(tmp_path):
    save_quantized(tiny_model(tied=False), None, tmp_path, "int8", source="/models/original.gguf")
    assert reference_model(str(tmp_path), None) == "/models/original.gguf"
    assert reference_model(str(tmp_path), "other.gguf") == "other.gguf"
    assert reference_model("smollm2-135m", None) == "smollm2-135m"


def test_the_model_is_taken_as_m_or_positionally_but_not_two_different():
    assert one_model("a.gguf", None) == one_model(None, "a.gguf") == one_model("a.gguf", "a.gguf") == "a.gguf"
    result = CliRunner().invoke(main, ["eval", "-m", "a.gguf", "b.gguf"])
    assert result.exit_code == 2 and "two models given" in result.output
