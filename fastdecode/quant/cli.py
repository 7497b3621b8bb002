"""`fastdecode quantize`: write a quantized safetensors checkpoint that `generate -m DIR` and `LLM(DIR)` load."""
from __future__ import annotations

import click
import torch

from fastdecode.console import err, log, progress
from fastdecode.errors import InvalidRequestError
from fastdecode.loading.catalog import DEFAULT_MODEL, resolve
from fastdecode.quant import WEIGHT_SCHEMES
from fastdecode.quant.fp4 import BLOCK_SIZE


@click.command("quantize")
@click.argument("model", default=DEFAULT_MODEL)
@click.option("--to", "scheme", type=click.Choice(WEIGHT_SCHEMES), required=True, help="Weight format.")
@click.option("--group-size", type=click.Choice(["32", "64", "128", "256"]), default=None,
              help="int4 group size (default 32). MXFP4 (32) and NVFP4 (16) fix theirs.")
@click.option("--lm-head", "lm_head", type=click.Choice([*WEIGHT_SCHEMES, "same"]), default="int8", show_default=True,
              help="Format of the LM head; `same` uses --to.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False), help="Directory to write.")
def quantize_command(model, scheme, group_size, lm_head, out):
    """Quantize MODEL's matrices (float32 load, weight-only) and write DIR: model.safetensors, config.json,
    quantization_config.json and the tokenizer. Loading DIR gives the same logits as `--quant` in memory."""
    from fastdecode.loading import load_model, load_tokenizer
    from fastdecode.quant import weight_bytes
    from fastdecode.quant.checkpoint import is_quantized_checkpoint, load_quantized, save_quantized

    if group_size is not None and scheme in BLOCK_SIZE and int(group_size) != BLOCK_SIZE[scheme]:
        raise InvalidRequestError(f"{scheme} blocks are {BLOCK_SIZE[scheme]} values by definition; drop --group-size")
    group_size = int(group_size or 32)
    path = resolve(model, log=log)
    if is_quantized_checkpoint(path):
        raise InvalidRequestError(f"{path} is already quantized; quantize its source model instead")
    float_model = load_model(path, torch.float32, progress("loading weights"))
    tokenizer = load_tokenizer(path)
    with err.status(f"quantizing to {scheme}"):
        config = save_quantized(float_model, tokenizer, out, scheme, group_size,
                                None if lm_head == "same" else lm_head, source=str(path))
    before = weight_bytes(float_model)
    after = weight_bytes(load_quantized(out))
    err.print(f"[cyan]{len(config['modules'])} matrices to {scheme}"
              f"{f' (groups of {group_size})' if scheme == 'int4' else ''}, LM head {config['lm_head_scheme']}: "
              f"matrix bytes {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB[/cyan]")
    click.echo(out)
