"""`fastdecode bench`: measure any OpenAI-compatible endpoint (or a local model served for the occasion), store the
run, print tables, write an HTML report; `bench list | show RUN | compare RUN RUN` read stored runs."""
from __future__ import annotations

import asyncio
import json
import os
import platform
import socket
import subprocess
import time
from contextlib import ExitStack
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fastdecode.console import table_console
from fastdecode.errors import FastdecodeError
from fastdecode.lab import storage
from fastdecode.lab.ceiling import decode_ceiling, serve_weight_format
from fastdecode.lab.client import Endpoint, check_endpoint
from fastdecode.lab.cost import Prices, cost_summary, load_prices
from fastdecode.lab.local_server import LocalServer
from fastdecode.lab.metrics import summarize
from fastdecode.lab.plan import WorkloadSpec, build_items
from fastdecode.lab.report import write_report
from fastdecode.lab.runner import MODES, Lab, RunConfig, Target
from fastdecode.lab.tables import print_run_comparison, print_runs, print_summary
from fastdecode.lab.tokens import approximate_counter, tokenizer_counter
from fastdecode.roofline.hardware import THIS_MACHINE


class RichProgress:
    """The runner's progress sink: one bar per phase, the last response's speed beside it."""

    def __init__(self, progress: Progress):
        self.progress, self.task, self.errors = progress, None, 0

    def phase(self, name, total):
        self.task = self.progress.add_task(name, total=total, last="")

    def advance(self, record):
        self.errors += not record.ok
        chunks = [c for c in record.chunks if c.content or c.reasoning]
        last = ""
        if record.ok and len(chunks) > 1 and chunks[-1].t > chunks[0].t:
            last = f"~{(len(chunks) - 1) / (chunks[-1].t - chunks[0].t):.1f} chunks/s"
        if self.errors:
            last += f" [red]{self.errors} errors[/red]"
        self.progress.update(self.task, advance=1, last=last)


def api_key(var: str | None) -> str | None:
    if not var:
        return None
    if not os.environ.get(var):
        raise FastdecodeError(f"--api-key-env {var}: that environment variable is not set")
    return os.environ[var]


def environment(servers: dict[str, LocalServer]) -> dict:
    env = {"python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
           "processor": platform.processor(), "cpus": os.cpu_count(), "hostname": socket.gethostname(),
           "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    try:
        env["load_avg"] = os.getloadavg()
    except OSError:
        pass
    try:
        from importlib.metadata import version

        env["fastdecode"] = version("fastdecode")
    except Exception:  # noqa: BLE001 - an uninstalled checkout still runs
        pass
    try:
        env["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           timeout=5, cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        pass
    for arm, server in servers.items():
        env[f"server_{arm.lower()}"] = server.command_line()
    return env


def build_prices(price_input, price_output, prices_file, model) -> Prices | None:
    if prices_file:
        return load_prices(prices_file, model)
    if price_input is not None or price_output is not None:
        return Prices(price_input or 0.0, price_output or 0.0)
    return None


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise FastdecodeError(f"--concurrency {text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    if not levels or min(levels) < 1:
        raise FastdecodeError("--concurrency levels must be at least 1")
    return levels


@click.group("bench", invoke_without_command=True)
@click.option("--endpoint", default=None, help="OpenAI-compatible server: its root, /v1, or chat completions URL.")
@click.option("--model", default=None, help="The `model` field sent to --endpoint.")
@click.option("--api-key-env", default=None, help="Environment variable holding the endpoint's API key.")
@click.option("-m", "--local-model", default=None,
              help="Serve this model locally (`fastdecode serve`, started and stopped by the lab) and measure it.")
@click.option("--speculate", default=None, help="Passed to `fastdecode serve --speculate`.")
@click.option("--serve-arg", multiple=True, help="Extra `fastdecode serve` options, e.g. --serve-arg='--quant int4'.")
@click.option("--b-endpoint", default=None, help="compare: the second endpoint (B).")
@click.option("--b-model", default=None, help="compare: the model field for B (default: --model).")
@click.option("--b-api-key-env", default=None, help="compare: API key variable for B (default: --api-key-env).")
@click.option("--b-local-model", default=None, help="compare: a local model for B (default: -m when --b-speculate "
                                                      "or --b-serve-arg is given).")
@click.option("--b-speculate", default=None, help="compare: --speculate for B's local server.")
@click.option("--b-serve-arg", multiple=True, help="compare: extra serve options for B's local server.")
@click.option("--label-a", default="A", show_default=True)
@click.option("--label-b", default="B", show_default=True)
@click.option("--workload", default="coding-agent", show_default=True,
              help="Bundled workload (coding-agent) or one category (code_edit, refactor, ...).")
@click.option("--workload-file", type=click.Path(dir_okay=False), default=None,
              help="JSONL of {messages, max_tokens, category[, id]} (docs/workloads.md).")
@click.option("--input-tokens", type=int, default=None, help="Synthetic mode: prompt tokens per request.")
@click.option("--output-tokens", type=int, default=None, help="Synthetic mode: max_tokens per request.")
@click.option("--synthetic-requests", type=click.IntRange(1), default=8, show_default=True)
@click.option("--category", "categories", multiple=True, help="Keep only this category (repeatable).")
@click.option("--per-category", type=click.IntRange(1), default=None, help="First N items of each category.")
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="Cap every item's max_tokens.")
@click.option("--unique-prompts", is_flag=True,
              help="A nonce at the start of every prompt, so no prefix cache or drafter has seen it before.")
@click.option("--mode", "modes", multiple=True, type=click.Choice(MODES), help="Repeatable; default sequential.")
@click.option("--repeats", type=click.IntRange(1), default=1, show_default=True,
              help="Passes over the workload (sequential, compare) or over the levels (sweep).")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Sweep levels.")
@click.option("--requests-per-user", type=click.IntRange(1), default=2, show_default=True, help="Sweep.")
@click.option("--duration", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Soak seconds.")
@click.option("--users", type=click.IntRange(1), default=1, show_default=True, help="Soak users.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds per point of the speed-over-time series.")
@click.option("--warmup", type=click.IntRange(0), default=1, show_default=True,
              help="Requests per target sent first and discarded.")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=300.0, show_default=True,
              help="Seconds per request.")
@click.option("--window", type=click.IntRange(2), default=32, show_default=True,
              help="Tokens in the slowest-window floor inside a response.")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--ignore-eos", is_flag=True, help="Send ignore_eos (vLLM and fastdecode honour it) for fixed lengths.")
@click.option("--extra-body", default=None, help="JSON object merged into every request body.")
@click.option("--tokenizer", default=None,
              help="Count tokens with this model's tokenizer when the server sends no usage (remote endpoints).")
@click.option("--price-input", type=float, default=None, help="USD per million input tokens.")
@click.option("--price-output", type=float, default=None, help="USD per million output tokens.")
@click.option("--prices", "prices_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="JSON/TOML prices file (docs/lab.md).")
@click.option("--hw", default=None, help="Hardware for the roofline ceiling (default this-machine for -m; "
                                         "'none' for no ceiling).")
@click.option("--roofline-model", default=None, help="Model for the ceiling of a remote endpoint (catalog name).")
@click.option("--label", default="", help="A name for this run.")
@click.option("--db", type=click.Path(dir_okay=False), default=None, help="SQLite file [default: "
                                                                            "$FASTDECODE_HOME/lab.sqlite].")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, help="Write an HTML report.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the summary as JSON.")
@click.option("--server-timeout", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for a local server's /health.")
@click.pass_context
def bench_command(ctx, **o):
    """Measure an OpenAI-compatible endpoint (--endpoint URL --model NAME) or a local model (-m MODEL): TTFT,
    output tok/s, floors, sweeps over concurrency, soak, A/B compare; runs are stored and reported."""
    if ctx.invoked_subcommand is not None:
        return
    run_bench(o, ctx.params)


def run_bench(o: dict, params: dict) -> int:
    if bool(o["endpoint"]) == bool(o["local_model"]):
        raise FastdecodeError("give either --endpoint URL --model NAME or -m LOCAL_MODEL")
    if o["endpoint"] and not o["model"]:
        raise FastdecodeError("--endpoint needs --model NAME (the model field of each request)")
    cfg = run_config(o)
    b_local = o["b_local_model"] or (o["local_model"] if (o["b_speculate"] or o["b_serve_arg"]) else None)
    if "compare" in cfg.modes and not (o["b_endpoint"] or b_local):
        raise FastdecodeError("--mode compare needs B: --b-endpoint URL, --b-local-model, or --b-speculate / "
                              "--b-serve-arg with -m")
    counter = token_counter(o["local_model"], o["tokenizer"])
    items = build_items(WorkloadSpec(o["workload"], o["workload_file"], o["input_tokens"], o["output_tokens"],
                                     o["synthetic_requests"], tuple(o["categories"]), o["per_category"],
                                     o["max_tokens"], o["seed"] or 0), counter)
    prices = build_prices(o["price_input"], o["price_output"], o["prices_file"], o["local_model"] or o["model"])
    ceiling = ceiling_for(o)  # before any server starts: the probe must not share the CPUs with one
    err = table_console(140, stderr=True)
    with ExitStack() as stack:
        targets, servers = open_targets(o, b_local, cfg, counter, stack, err)
        env = environment(servers)
        started = time.perf_counter()
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[last]}")]
        with Progress(*columns, console=err) as progress:
            records = asyncio.run(Lab(targets, items, cfg, RichProgress(progress)).run())
    summary = summarize(records, cfg.window, cfg.interval_s)
    summary.update(wall_s=time.perf_counter() - started,
                   token_sources=sorted({r.token_source for r in records if r.token_source}))
    if prices:
        summary["cost"] = cost_summary(records, prices)
    if ceiling:
        summary["ceiling"] = ceiling
    target_text = " vs ".join(f"{t.endpoint.label} [{arm}]" if len(targets) > 1 else t.endpoint.label
                              for arm, t in targets.items())
    config = {**params, "run_config": asdict(cfg), "items": [i.id for i in items], "token_counter": counter.name}
    run_id = storage.save_run(o["db"], o["label"], list(cfg.modes), target_text, config, env, summary, records)
    print_summary(table_console(140), f"run {run_id}: {target_text}", summary)
    err.print(f"run {run_id} saved to {o['db'] or storage.default_db()}")
    if o["report_path"]:
        err.print(f"report written to {write_report(storage.load_run(o['db'], run_id), o['report_path'])}")
    if o["json_path"]:
        Path(o["json_path"]).write_text(json.dumps({"run": run_id, "target": target_text, "environment": env,
                                                    **summary}, indent=2))
    if summary["overall"]["ok"] == 0:
        kinds = ", ".join(f"{k} x{n}" for k, n in summary["overall"]["error_kinds"].items())
        raise FastdecodeError(f"all {len(records)} requests failed ({kinds}); see `fastdecode bench show {run_id}`")
    return run_id


def run_config(o: dict) -> RunConfig:
    sampling = {"temperature": o["temperature"]}
    if o["seed"] is not None:
        sampling["seed"] = o["seed"]
    if o["ignore_eos"]:
        sampling["ignore_eos"] = True
    if o["extra_body"]:
        try:
            sampling.update(json.loads(o["extra_body"]))
        except (json.JSONDecodeError, TypeError, ValueError):
            raise FastdecodeError(f"--extra-body is not a JSON object: {o['extra_body']!r}") from None
    return RunConfig(modes=tuple(o["modes"]) or ("sequential",), repeats=o["repeats"],
                     concurrency=parse_levels(o["concurrency"]), requests_per_user=o["requests_per_user"],
                     duration_s=o["duration"], soak_users=o["users"], interval_s=o["interval"], warmup=o["warmup"],
                     timeout_s=o["timeout"], unique_prompts=o["unique_prompts"], sampling=sampling,
                     window=o["window"])


def token_counter(local_model: str | None, tokenizer: str | None):
    if local_model:
        return tokenizer_counter(local_model)
    return tokenizer_counter(tokenizer) if tokenizer else approximate_counter()


def ceiling_for(o: dict) -> dict | None:
    hw = o["hw"] or (THIS_MACHINE if o["local_model"] else None)
    model = o["roofline_model"] or o["local_model"]
    if not hw or hw.lower() == "none" or not model:
        return None
    dtype, group, threads = serve_weight_format(o["serve_arg"]) if o["local_model"] else (None, 128, None)
    return decode_ceiling(model, hw, dtype, group, threads)


def open_targets(o: dict, b_local: str | None, cfg: RunConfig, counter, stack: ExitStack, err: Console):
    """A (and B for compare): start their local servers, check each endpoint; ({arm: Target}, {arm: server})."""
    arms = [("A", o["local_model"], o["speculate"], o["serve_arg"], o["endpoint"], o["model"], o["api_key_env"])]
    if "compare" in cfg.modes:
        arms.append(("B", b_local, o["b_speculate"], o["b_serve_arg"] or (o["serve_arg"] if o["b_speculate"] else ()),
                     o["b_endpoint"], o["b_model"] or o["model"], o["b_api_key_env"] or o["api_key_env"]))
    targets, servers = {}, {}
    for arm, local, speculate, serve_args, endpoint, model, key_env in arms:
        if local:
            err.print(f"[{arm}] starting `fastdecode serve -m {local}` ...")
            servers[arm] = server = stack.enter_context(LocalServer(local, speculate, tuple(serve_args),
                                                                    o["server_timeout"]))
            label = f"local {local}" + (f" --speculate {speculate}" if speculate else "")
            ep = Endpoint.from_base(server.base_url, local, label=label)
            arm_counter = counter if local == o["local_model"] else tokenizer_counter(local)
        else:
            ep = Endpoint.from_base(endpoint, model, api_key(key_env))
            arm_counter = counter if arm == "A" else token_counter(None, o["tokenizer"])
        asyncio.run(check_endpoint(ep, min(o["timeout"], 600.0)))
        targets[arm] = Target(ep, arm_counter)
    return targets, servers


@bench_command.command("list")
@click.option("--db", type=click.Path(dir_okay=False), default=None)
def list_command(db):
    """Stored runs, oldest first."""
    print_runs(table_console(140), storage.list_runs(db))


@bench_command.command("show")
@click.argument("run")
@click.option("--db", type=click.Path(dir_okay=False), default=None)
@click.option("--report", "report_path", type=click.Path(dir_okay=False), default=None, help="Write an HTML report.")
@click.option("--json", "as_json", is_flag=True, help="Print the recomputed summary as JSON.")
def show_command(run, db, report_path, as_json):
    """One stored run (a number, or `last`), its metrics recomputed from the raw chunk timings."""
    stored = storage.load_run(db, run)
    summary = resummarize(stored)
    if as_json:
        click.echo(json.dumps({"run": stored.id, "target": stored.target, **summary}, indent=2))
    else:
        print_summary(table_console(140), f"run {stored.id}: {stored.target} ({stored.created_at})", summary)
    if report_path:
        stored.summary = summary
        click.echo(f"report written to {write_report(stored, report_path)}", err=True)


@bench_command.command("compare")
@click.argument("run_a")
@click.argument("run_b")
@click.option("--db", type=click.Path(dir_okay=False), default=None)
def compare_command(run_a, run_b, db):
    """Two stored runs side by side: medians and floors, overall and per category, B/A."""
    a, b = storage.load_run(db, run_a), storage.load_run(db, run_b)
    print_run_comparison(table_console(140), (a.id, resummarize(a)), (b.id, resummarize(b)))


def resummarize(stored: storage.StoredRun) -> dict:
    cfg = stored.config.get("run_config", {})
    summary = summarize(stored.records, cfg.get("window", 32), cfg.get("interval_s", 10.0))
    for key in ("ceiling", "wall_s", "token_sources"):  # not recomputable from the records alone
        if key in stored.summary:
            summary[key] = stored.summary[key]
    if "cost" in stored.summary:
        prices = Prices(stored.summary["cost"]["input_per_m"], stored.summary["cost"]["output_per_m"])
        summary["cost"] = cost_summary(stored.records, prices)
    return summary
