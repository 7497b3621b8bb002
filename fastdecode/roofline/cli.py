"""`fastdecode roofline` and `fastdecode probe`."""
from __future__ import annotations

import json
from dataclasses import replace

import click
from rich.console import Console
from rich.table import Table

from fastdecode.console import table_console
from fastdecode.errors import FastdecodeError
from fastdecode.roofline.calc import Result, Scenario, roofline
from fastdecode.roofline.hardware import (THIS_MACHINE, Hardware, get_hardware, load_catalog, this_machine,
                                          with_bandwidth)
from fastdecode.roofline.measured import Measured, read_measured
from fastdecode.roofline.models import DTYPES, bits_per_weight, get_model
from fastdecode.roofline.models import load_catalog as catalog_models
from fastdecode.roofline.probe import (LARGE_BYTES, WORKING_SET_BYTES, cached_probe, describe_peaks,
                                       measure_bandwidth, measure_matmul, save_probe)

SPECULATION_DEFAULT = (3.0, 0.1)  # --compare's assumed drafter: 3 tokens per step at a tenth of a step's cost


# ---- formatting ------------------------------------------------------------------------------------------------
def _bytes(n: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{v:.2f} {unit}" if v < 10 else f"{v:.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"
    return f"{n:,.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.3g}"


# ---- scenario building -----------------------------------------------------------------------------------------
def _this_machine(model, opts: dict, working_set: float) -> Hardware:
    """this-machine from the cached probe, at the working set the scenario reads per token (cache-resident sets
    read faster than DRAM), unless --bandwidth gives the figure."""
    probe = cached_probe(int(working_set), opts["threads"])
    if opts["bandwidth"]:
        return this_machine(opts["bandwidth"], probe["matmul_tflops"], probe["threads"], "--bandwidth")
    note = (f"probe: {probe['working_set_gb_s']:.1f} GB/s at a {probe['working_set_bytes'] / 1e6:.0f} MB working set "
            f"({probe['bandwidth_gb_s']:.1f} GB/s at 1 GB), {probe['threads']} threads, {probe['path']}")
    if probe.get("busy"):
        note += f"; the machine was busy ({probe['busy']}): figures read low, rerun `fastdecode probe` when quiet"
    return this_machine(probe["working_set_gb_s"], probe["matmul_tflops"], probe["threads"], note)


def _hardware(name: str, model, opts: dict, catalog: dict) -> Hardware:
    if name.strip().lower() == THIS_MACHINE:
        return _this_machine(model, opts, _read_per_token(model, opts))
    hw = get_hardware(name, catalog)
    return with_bandwidth(hw, opts["bandwidth"]) if opts["bandwidth"] else hw


def _scenario(model, hw: Hardware, opts: dict, **overrides) -> Scenario:
    fields = dict(model=model, hardware=hw, dtype=opts["dtype"], kv_dtype=opts["kv_dtype"],
                  group_size=opts["group_size"], context=opts["context"], prompt=opts["prompt"], tp=opts["tp"],
                  pp=opts["pp"], accept_length=opts["accept_length"], draft_tokens=opts["draft_tokens"],
                  draft_cost=opts["draft_cost"], allreduce_us=opts["allreduce_us"], price_per_hour=opts["price"])
    return Scenario(**{**fields, **overrides})


def _routes(model, hw: Hardware | None, opts: dict, catalog: dict) -> list[tuple[str, Scenario]]:
    """One model on each route to fast decode: HBM GPU, GPU + speculation, 8-way TP, SRAM wafer, SRAM chips,
    hardwired chip (and the --hw given, if it is not a GPU)."""
    gpu = hw if hw is not None and hw.kind == "gpu" else catalog["h200"]
    accept, cost = ((opts["accept_length"], opts["draft_cost"]) if opts["accept_length"] > 1
                    else SPECULATION_DEFAULT)
    plain = dict(accept_length=1.0, draft_cost=0.0, tp=None, pp=None)
    routes = [(f"HBM GPU ({gpu.name})", _scenario(model, gpu, opts, **plain)),
              (f"{gpu.name} + speculation (accept {accept:g}, draft cost {cost:g})",
               _scenario(model, gpu, opts, **{**plain, "accept_length": accept, "draft_cost": cost})),
              (f"8-way tensor parallel ({gpu.name})", _scenario(model, gpu, opts, **{**plain, "tp": 8})),
              ("SRAM wafer (wse-3)", _scenario(model, catalog["wse-3"], opts, **plain)),
              ("SRAM chips (groq-lpu)", _scenario(model, catalog["groq-lpu"], opts, **plain)),
              ("hardwired chip (taalas-hc1)", _scenario(model, catalog["taalas-hc1"], opts, **plain))]
    if hw is not None and hw.kind != "gpu":
        routes.insert(0, (hw.name, _scenario(model, hw, opts)))
    return routes


def _hold_against(measured: Measured, model, hw_name: str, opts: dict, catalog: dict) -> list[dict]:
    """Each measured row against the ceiling for its own bytes per token (or weight format) on the hardware.

    On this-machine the bandwidth is, first found: --bandwidth, the row's or the file's own figure (measured side
    by side with the runs, so under the same load), else the probe at the row's working set. A probe run at another
    moment of a shared machine can be far off, so where the file has a figure the probe's ceiling is shown beside."""
    rows = []
    context = measured.context if measured.context is not None else opts["context"]
    base = {**opts, "context": context, "threads": opts["threads"] or measured.threads}
    here = hw_name.strip().lower() == THIS_MACHINE
    for row in measured.rows:
        fmt = row.format if row.format and _known_format(row.format) else None
        if model.gguf and fmt and fmt.upper() == model.gguf.format.upper():
            fmt = None  # the file itself: exact tensor bytes
        row_opts = {**base, "dtype": base["dtype"] or fmt}
        hw = (_this_machine(model, row_opts, row.bytes_per_token or _read_per_token(model, row_opts)) if here
              else _hardware(hw_name, model, row_opts, catalog))
        if here:
            hw = _at_least_measured_compute(hw, model, measured)
        probe_hw, source = hw, "--bandwidth" if opts["bandwidth"] else "probe" if here else hw.name
        side_by_side = row.bandwidth_gb_s or measured.bandwidth_gb_s
        if here and side_by_side and not opts["bandwidth"]:
            hw, source = replace(hw, bandwidth_gb_s=side_by_side), "measured with the run"
        result = roofline(_scenario(model, hw, row_opts, bytes_per_token=row.bytes_per_token))
        entry = {"label": f"{row.engine} {row.format or ''}".strip(), "engine": row.engine, "format": row.format,
                 "decode_tok_s": row.decode_tok_s, "bytes_per_token": result.bytes_per_token,
                 "bandwidth_gb_s": hw.bandwidth_gb_s, "bandwidth_source": source,
                 "ceiling_tok_s": result.decode_tok_s_ceiling, "bound": result.bound,
                 "efficiency": row.decode_tok_s / result.decode_tok_s_ceiling}
        if probe_hw is not hw:
            at_probe = roofline(_scenario(model, probe_hw, row_opts, bytes_per_token=row.bytes_per_token))
            entry.update(probe_bandwidth_gb_s=probe_hw.bandwidth_gb_s,
                         probe_ceiling_tok_s=at_probe.decode_tok_s_ceiling,
                         probe_efficiency=row.decode_tok_s / at_probe.decode_tok_s_ceiling)
        rows.append(entry)
    return rows


def _at_least_measured_compute(hw: Hardware, model, measured: Measured) -> Hardware:
    """A measured prefill proves the machine computes at least 2 x active params x its tok/s; a matmul probe taken
    while the machine is busy can read lower, and a ceiling must not fall below what was measured."""
    prefill = max((r.prefill_tok_s or 0.0 for r in measured.rows), default=0.0)
    proven = 2 * model.active_params() * prefill / 1e12
    if proven <= max(hw.tflops.values(), default=0.0):
        return hw
    return replace(hw, tflops={p: proven for p in hw.tflops} or {"fp32": proven, "bf16": proven},
                   sources={**hw.sources, "tflops": f"measured prefill: 2 x active params x {prefill:,.0f} tok/s"})


def _read_per_token(model, opts: dict) -> float:
    return model.weight_bytes(opts["dtype"], 1, opts["group_size"]) + model.kv_bytes(opts["context"], opts["kv_dtype"])


def _known_format(fmt: str) -> bool:
    try:
        bits_per_weight(fmt)
        return True
    except FastdecodeError:
        return False


# ---- output ----------------------------------------------------------------------------------------------------
def _print_result(console: Console, r: Result, model, hw: Hardware) -> None:
    t = Table(title=f"roofline: {model.name} on {hw.label}", show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    t.add_row("model", f"{model.name}: {model.total_params() / 1e9:,.3g} B parameters, "
                       f"{model.active_params() / 1e9:,.3g} B active per token")
    t.add_row("hardware", f"{hw.label} x {r.chips} (tp {r.tp}, pp {r.pp}): {_rate(hw.bandwidth_gb_s)} GB/s, "
                          f"{hw.memory_gb:g} GB per chip")
    t.add_row("weights", f"{r.weights}; {r.resident_gb:,.3g} GB resident with KV, "
                         f"{'fits' if r.fits else 'does NOT fit'} ({r.chips_needed} chip(s) needed)")
    t.add_row("bytes per token", f"{_bytes(r.bytes_per_token)} = {_bytes(r.weight_bytes_per_token)} weights + "
                                 f"{_bytes(r.kv_bytes_per_token)} KV at {r.context:,} tokens of context")
    t.add_row("decode ceiling", f"[bold green]{_rate(r.decode_tok_s_ceiling)} tok/s[/] ({r.bound}-bound; "
                                f"memory alone {_rate(r.memory_bound_tok_s)}, compute alone "
                                f"{_rate(r.compute_bound_tok_s)} tok/s)")
    st = r.step
    t.add_row("step", f"{_seconds(st['total_s'])}: memory {_seconds(st['memory_s'])}, compute "
                      f"{_seconds(st['compute_s'])}, pipeline {_seconds(st['latency_s'])}, "
                      f"interconnect {_seconds(st['comm_s'])}")
    if r.accept_length > 1:
        t.add_row("speculation", f"x{r.speculation_multiplier:.2f} (accept {r.accept_length:g} of "
                                 f"{r.draft_tokens} drafted + 1)")
    t.add_row("TTFT", f"{_seconds(r.ttft_s)} for {r.prompt_tokens:,} prompt tokens "
                      f"({_rate(r.prefill_tok_s_ceiling)} tok/s prefill, {r.prefill_bound}-bound)")
    if r.cost_per_million_tokens is not None:
        t.add_row("cost", f"${r.cost_per_million_tokens:,.3g} per million output tokens at batch 1 "
                          f"(${r.price_per_hour:g} per chip-hour x {r.chips})")
    for note in r.notes:
        t.add_row("note", note)
    if hw.name == THIS_MACHINE:
        t.add_row("bandwidth", hw.sources.get("bandwidth_gb_s", ""))
    console.print(t)


def _print_routes(console: Console, routes: list[tuple[str, Result]]) -> None:
    t = Table(title=f"routes to fast decode: {routes[0][1].model}", title_justify="left")
    for col in ("route", "chips", "weights", "bytes/token", "decode ceiling tok/s", "bound", "TTFT", "$/M tok"):
        t.add_column(col, justify="right" if col not in ("route", "weights", "bound") else "left")
    for label, r in routes:
        t.add_row(label, f"{r.chips}" + ("" if r.fits else " (!)"), r.weights, _bytes(r.bytes_per_token),
                  _rate(r.decode_tok_s_ceiling), r.bound, _seconds(r.ttft_s),
                  "-" if r.cost_per_million_tokens is None else f"{r.cost_per_million_tokens:,.3g}")
    console.print(t)


def _print_measured(console: Console, rows: list[dict], measured: Measured) -> None:
    t = Table(title=f"measured ({measured.path}) against the ceiling", title_justify="left")
    probe = any("probe_efficiency" in r for r in rows)
    columns = ["engine", "format", "tok/s", "bytes/token", "GB/s", "ceiling", "efficiency"]
    for col in columns + (["probe GB/s", "probe ceiling", "vs probe"] if probe else []):
        t.add_column(col, justify="left" if col in ("engine", "format") else "right")
    for r in rows:
        cells = [r["engine"], r["format"] or "-", _rate(r["decode_tok_s"]), _bytes(r["bytes_per_token"]),
                 f"{r['bandwidth_gb_s']:.1f}", _rate(r["ceiling_tok_s"]), f"[bold]{r['efficiency']:.0%}[/]"]
        if probe:
            cells += [f"{r['probe_bandwidth_gb_s']:.1f}", _rate(r["probe_ceiling_tok_s"]),
                      f"{r['probe_efficiency']:.0%}"]
        t.add_row(*cells)
    console.print(t)
    sources = sorted({r["bandwidth_source"] for r in rows})
    console.print(f"bandwidth: {', '.join(sources)}" + ("; probe: at each row's working set, measured now"
                                                        if probe else ""))


# ---- commands --------------------------------------------------------------------------------------------------
@click.command("roofline")
@click.option("-m", "--model", "model_name", required=True,
              help="catalog name (llama-3.1-8b, ...), or a path to a config.json, its folder, or a .gguf")
@click.option("--hw", "hw_name", default=None,
              help="hardware (h200, b200, wse-3, ..., this-machine); default h200, or this-machine with --measured")
@click.option("--dtype", default=None, help=f"weights: {'|'.join(DTYPES)} or a GGUF type (q4_1); default: as published")
@click.option("--kv-dtype", default="bf16", show_default=True, help="KV cache format")
@click.option("--group-size", default=128, show_default=True, type=click.IntRange(1), help="int4 scale group")
@click.option("--context", default=1024, show_default=True, type=click.IntRange(0), help="tokens in the KV cache")
@click.option("--prompt", default=None, type=click.IntRange(0), help="prompt tokens for TTFT [default: --context]")
@click.option("--tp", default=None, type=click.IntRange(1), help="tensor-parallel chips [default: as needed]")
@click.option("--pp", default=None, type=click.IntRange(1), help="pipeline stages [default: as needed]")
@click.option("--accept-length", default=1.0, type=click.FloatRange(1.0), help="speculation: tokens per step")
@click.option("--draft-tokens", default=None, type=click.IntRange(1), help="speculation: tokens drafted per step")
@click.option("--draft-cost", default=0.0, type=click.FloatRange(0.0), help="drafter time / one decode step")
@click.option("--bandwidth", default=None, type=click.FloatRange(0.0, min_open=True), help="GB/s, overrides")
@click.option("--allreduce-us", default=None, type=click.FloatRange(0.0), help="interconnect latency per step")
@click.option("--price", default=None, type=click.FloatRange(0.0), help="USD per chip-hour, overrides")
@click.option("--threads", default=None, type=click.IntRange(1), help="this-machine: threads for the probe")
@click.option("--compare", is_flag=True, help="the model on each route side by side")
@click.option("--measured", "measured_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="benchmark JSON (bench/decode.py or speed lab): print its efficiency against the ceiling")
@click.option("--plot", "plot_path", default=None, type=click.Path(dir_okay=False), help="write a PNG")
@click.option("--json", "as_json", is_flag=True, help="print JSON instead of tables")
def roofline_command(model_name, hw_name, compare, measured_path, plot_path, as_json, **opts):
    """The fastest batch-1 decode a model can reach on a hardware route: bytes per token, memory- or
    compute-bound ceiling, TP/PP, speculation, TTFT and cost."""
    for key in ("dtype", "kv_dtype"):
        if opts[key]:
            bits_per_weight(opts[key])  # unknown formats fail here, with the list
            opts[key] = opts[key].lower()
    catalog = load_catalog()
    model = get_model(model_name)
    measured = read_measured(measured_path) if measured_path else None
    hw_name = hw_name or (THIS_MACHINE if measured else None)
    hw = _hardware(hw_name, model, opts, catalog) if hw_name else None
    if compare:
        routes = [(label, roofline(s)) for label, s in _routes(model, hw, opts, catalog)]
    else:
        hw = hw or catalog["h200"]
        routes = [(hw.name, roofline(_scenario(model, hw, opts)))]
    rows = _hold_against(measured, model, hw_name, opts, catalog) if measured else []
    if plot_path:
        from fastdecode.roofline.plot import plot

        plot(routes, plot_path, rows)
    if as_json:
        if compare:
            doc = {"model": model.name, "routes": [{"route": label, **r.to_dict()} for label, r in routes]}
        else:
            doc = routes[0][1].to_dict()
        if measured:
            doc["measured"] = rows
        click.echo(json.dumps(doc, indent=2))
        return
    console = table_console(130)
    if compare:
        _print_routes(console, routes)
    else:
        _print_result(console, routes[0][1], model, hw)
    if measured:
        _print_measured(console, rows, measured)
        if measured.model and model.name in catalog_models() and measured.model.lower() != model.name:
            console.print(f"note: {measured.path} measured {measured.model}; this roofline is for {model.name}")
    if plot_path:
        console.print(f"plot written to {plot_path}")


@click.command("probe")
@click.option("--threads", default=None, type=click.IntRange(1), help="torch threads [default: torch's]")
@click.option("--size-mb", default=WORKING_SET_BYTES / 1e6, show_default=True, type=click.FloatRange(0.01),
              help="working set to measure besides 1 GB")
@click.option("--large-mb", default=LARGE_BYTES / 1e6, show_default=True, type=click.FloatRange(0.01),
              help="the large (DRAM) working set")
@click.option("--repeats", default=9, show_default=True, type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True)
def probe_command(threads, size_mb, large_mb, repeats, as_json):
    """Measure this machine's read bandwidth (at 1 GB and at a working-set size) and matmul speed with torch;
    `roofline --hw this-machine` reuses the result ($FASTDECODE_HOME/probe.json)."""
    result = measure_bandwidth(threads, int(size_mb * 1e6), repeats, int(large_mb * 1e6))
    result["matmul_tflops"] = measure_matmul(threads)
    save_probe(result, result["matmul_tflops"])  # `roofline --hw this-machine` reuses it
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    t = Table(title=f"probe: torch read bandwidth, {result['threads']} threads, median of {repeats}",
              title_justify="left")
    for col in ("working set", "GB/s (median)", "min", "max"):
        t.add_column(col, justify="right")
    for part in (result["large"], result["working_set"]):
        t.add_row(_bytes(part["bytes"]), f"{part['gb_s']:.1f}", f"{part['min']:.1f}", f"{part['max']:.1f}")
    console = table_console(130)
    console.print(t)
    for line in describe_peaks(result["matmul_tflops"]):  # (library GEMMs: best of 3, 1024 x 1024)
        console.print(line)
