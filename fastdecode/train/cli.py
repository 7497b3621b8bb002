"""`fastdecode train-drafter -m MODEL --out DIR`: a drafter head for MODEL, trained on MODEL's own outputs."""
from __future__ import annotations

import time
from pathlib import Path

import click

from fastdecode.errors import InvalidRequestError


@click.command("train-drafter")
@click.option("-m", "--model", default="smollm2-135m", show_default=True, help="The target the head drafts for.")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Output directory: head.safetensors, config.json, checkpoint.pt, data/ (a rerun resumes).")
@click.option("--kind", type=click.Choice(["eagle", "mtp"]), default="eagle", show_default=True)
@click.option("--data", multiple=True, default=("chat", "code"), show_default=True,
              help="chat (the target's answers to bundled and generated prompts), code (stdlib sources), a JSONL "
                   "workload file, or a text file / directory of .py files. Repeatable.")
@click.option("--data-dir", type=click.Path(path_type=Path), default=None, help="Data cache (default OUT/data).")
@click.option("--quant", type=click.Choice(["none", "int8", "int4"]), default="int4", show_default=True,
              help="The target's weights while it makes the data.")
@click.option("--threads", type=int, default=None)
@click.option("--chat-prompts", type=int, default=48, show_default=True)
@click.option("--answer-tokens", type=int, default=192, show_default=True)
@click.option("--code-tokens", type=int, default=60000, show_default=True)
@click.option("--window", type=int, default=256, show_default=True)
@click.option("--draft-vocab", type=int, default=8192, show_default=True)
@click.option("--steps", type=int, default=3, show_default=True,
              help="eagle: training-time-test depth; mtp: tokens predicted per pass.")
@click.option("--epochs", type=float, default=2.0, show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--lr", type=float, default=5e-4, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--checkpoint-every", type=int, default=20, show_default=True)
def train_drafter_command(model, out, kind, data, data_dir, quant, **kw):
    """Train a drafter head (EAGLE-3 style or multi-token prediction) on the target's own outputs."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from fastdecode.train.trainer import TrainOptions, train_drafter

    if kw["steps"] < 1 or kw["window"] < 16:
        raise InvalidRequestError("--steps must be at least 1 and --window at least 16")
    o = TrainOptions(model=model, out=out, kind=kind, data=tuple(data), data_dir=data_dir,
                     quant=None if quant == "none" else quant, **kw)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TimeRemainingColumn())
    out.mkdir(parents=True, exist_ok=True)
    logfile = open(out / "train.log", "a", encoding="utf-8")

    def log(line: str):
        progress.console.print(line)
        logfile.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        logfile.flush()

    with Progress(*columns) as progress, logfile:
        log(f"train-drafter -m {model} --out {out} --kind {kind} " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                          for k, v in kw.items() if v is not None))
        t0 = time.perf_counter()
        try:
            summary = train_drafter(o, progress, log=log)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from e
        log(f"wall time {time.perf_counter() - t0:.0f} s (this run; data {summary.get('data_s')} s, training "
            f"{summary['train_s']} s in all); {summary['data_tokens']} tokens")
