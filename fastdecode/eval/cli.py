"""`fastdecode eval`: perplexity, top-1 and greedy agreement of a weight format against float32."""
from __future__ import annotations

import json

import click
from rich.console import Console
from rich.table import Table

from fastdecode.console import log, progress
from fastdecode.errors import ModelFileError
from fastdecode.loading.catalog import DEFAULT_MODEL

QUANTS = ["none", "int8", "int4", "mxfp4", "nvfp4", "gguf"]


def reference_model(model: str, given: str | None) -> str:
    """A quantized checkpoint is compared with the model it was made from (quantization_config.json says which)."""
    from fastdecode.quant.checkpoint import is_quantized_checkpoint, read_quant_config

    if given or not is_quantized_checkpoint(model):
        return given or model
    source = read_quant_config(model).get("source_model")
    if not source:
        raise ModelFileError(f"{model} does not name its source model; pass --reference")
    return source


def one_model(option: str | None, positional: str | None) -> str:
    """MODEL as `-m` (as every other command takes it) or, as before, the positional argument; not two different."""
    if option and positional and option != positional:
        raise click.UsageError(f"two models given: -m {option} and {positional}")
    return option or positional or DEFAULT_MODEL


@click.command("eval")
@click.argument("positional_model", metavar="[MODEL]", required=False)
@click.option("-m", "--model", default=None, help=f"Model to evaluate  [default: {DEFAULT_MODEL}]")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32", show_default=True)
@click.option("--quant", type=click.Choice(QUANTS), default="none", show_default=True)
@click.option("--group-size", type=int, default=32, show_default=True, help="Group size for int4.")
@click.option("--reference", default=None, help="Float model to compare with (default: MODEL, or a quantized "
                                                "checkpoint's source).")
@click.option("--tokens", type=click.IntRange(min=64), default=8192, show_default=True, help="Corpus token budget.")
@click.option("--window", type=click.IntRange(min=16), default=512, show_default=True, help="Tokens per window.")
@click.option("--greedy-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_command(positional_model, model, dtype, quant, group_size, reference, tokens, window, greedy_tokens, threads,
                 as_json):
    """Perplexity on the Python standard library's sources, top-1 agreement with the float32 model's next token on
    the same positions, and greedy agreement on fixed prompts, for MODEL (-m) in --dtype with --quant."""
    model = one_model(model, positional_model)
    from fastdecode.engine.llm import LLM
    from fastdecode.eval import EvalConfig, evaluate
    from fastdecode.eval import reference as make_reference

    config = EvalConfig(tokens=tokens, window=window, greedy_tokens=greedy_tokens)
    ref = make_reference(reference_model(model, reference), config, threads, progress, log)
    llm = LLM(model, dtype=dtype, quant=quant, group_size=group_size, threads=threads,
              max_seq_len=max(window, 256), log=log)
    label = f"{dtype}{'' if quant == 'none' else ' + ' + quant}"
    result = {"model": model, "dtype": dtype, "quant": quant, "group_size": group_size if quant == "int4" else None,
              **evaluate(llm, ref, progress, label)}
    if as_json:
        click.echo(json.dumps(result))
        return
    table = Table(title=f"{model} | {label} against float32 | {result['scored_tokens']} tokens of "
                        f"Python {result['corpus']['python']} stdlib")
    table.add_column("measure")
    table.add_column("value", justify="right")
    for name, value in [
        ("perplexity", f"{result['perplexity']:.3f}"),
        ("float32 perplexity", f"{result['reference_perplexity']:.3f}"),
        ("top-1 agreement", f"{100 * result['top1_agreement']:.2f}%"),
        ("greedy agreement", f"{100 * result['greedy_agreement']:.0f}% "
                             f"({', '.join(map(str, result['greedy_agreement_tokens']))} of {greedy_tokens} tokens)"),
        ("output tok/s", f"{result['output_tok_s']:.1f} ({result['decode_path']} decode)"),
        ("weight bytes per token", f"{result['bytes_per_token'] / 1e6:.1f} MB "
                                   f"(float32: {result['reference_bytes_per_token'] / 1e6:.1f} MB)"),
    ]:
        table.add_row(name, value)
    Console().print(table)
