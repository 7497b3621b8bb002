"""The lab's terminal output: rich tables of a run's summary, the list of stored runs, and two runs side by side."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from fastdecode.lab.metrics import sweep_rows
from fastdecode.lab.report import STAT_COLUMNS, category_rows, fmt, stats_rows, sweep_cells, usd, vs_first


def print_summary(console: Console, title: str, s: dict) -> None:
    o = s["overall"]
    t = Table(title=title, title_justify="left")
    for c in ["metric", "n", *STAT_COLUMNS]:
        t.add_column(c, justify="left" if c == "metric" else "right")
    for row in stats_rows(o):
        t.add_row(*row)
    console.print(t)
    line = (f"{o['ok']} of {o['requests']} requests succeeded; throughput {fmt(o.get('throughput_tok_s'))} tok/s; "
            f"window floor over {s['window_tokens']} tokens")
    if o["errors"]:
        line += f"; [red]errors: {', '.join(f'{k} x{n}' for k, n in o['error_kinds'].items())}[/red]"
    console.print(line)
    if s.get("ceiling"):
        console.print(f"ceiling: {s['ceiling']['label']}")
    if len(s["by_category"]) > 1:
        c = Table(title="per category", title_justify="left")
        for name in ["category", "requests", "errors", "median tok/s", "P5 tok/s", "window floor P5",
                     "median TTFT ms", "P95 TTFT ms"]:
            c.add_column(name, justify="left" if name == "category" else "right")
        for row in category_rows(s["by_category"]):
            c.add_row(*row)
        console.print(c)
    rows = sweep_rows(s)
    if rows:
        w = Table(title="concurrency sweep", title_justify="left")
        for name in ["users", "per-user tok/s", vs_first(rows), "per-user P5", "throughput tok/s", vs_first(rows),
                     "all busy tok/s", "median TTFT ms", "errors"]:
            w.add_column(name, justify="right")
        for r in rows:
            w.add_row(*sweep_cells(r))
        console.print(w)
        if any(r.get("throughput_passes_tok_s") for r in rows):
            console.print("throughput: the median of the passes over the levels (their range)")
    if s.get("compare"):
        cmp = s["compare"]
        for arm, g in s.get("by_arm", {}).items():
            speed, ttft = g["output_tok_s"] or {}, g["ttft_s"] or {}
            console.print(f"arm {arm}: median {fmt(speed.get('median'))} tok/s, P5 {fmt(speed.get('p5'))}, "
                          f"median TTFT {fmt(ttft.get('median'), 1e3)} ms, {g['errors']} errors")
        console.print(f"compare: B/A output speed {fmt(cmp['speed_ratio_b_over_a'])} (median of {cmp['pairs']} "
                      f"interleaved pairs, P5 {fmt(cmp['speed_ratio_p5'])}, P95 {fmt(cmp['speed_ratio_p95'])}); "
                      f"B/A TTFT {fmt(cmp['ttft_ratio_b_over_a'])}")
    if s.get("cost"):
        cost = s["cost"]
        console.print(f"cost: {usd(cost['per_request_usd'])} per request, {usd(cost['per_task_usd'])} per task, "
                      f"{usd(cost['total_usd'])} in all")


def print_runs(console: Console, runs: list[dict]) -> None:
    t = Table(title="stored runs", title_justify="left")
    for name in ["run", "when (UTC)", "label", "modes", "target", "requests", "errors", "median tok/s", "P5 tok/s",
                 "median TTFT ms"]:
        t.add_column(name, justify="right" if name in ("run", "requests", "errors") or "tok" in name or "ms" in name
                     else "left")
    for r in runs:
        o = r["summary"]["overall"]
        speed, ttft = o["output_tok_s"] or {}, o["ttft_s"] or {}
        t.add_row(str(r["id"]), r["created_at"], r["label"] or "", r["modes"], r["target"], str(o["requests"]),
                  str(o["errors"]), fmt(speed.get("median")), fmt(speed.get("p5")), fmt(ttft.get("median"), 1e3))
    console.print(t)


def print_run_comparison(console: Console, a: tuple[int, dict], b: tuple[int, dict]) -> None:
    """Two stored runs' medians and floors side by side, overall and per category, with B/A."""
    (ida, sa), (idb, sb) = a, b
    t = Table(title=f"run {idb} against run {ida}", title_justify="left")
    for name in ["group", "metric", f"run {ida}", f"run {idb}", "B/A"]:
        t.add_column(name, justify="left" if name in ("group", "metric") else "right")
    groups = [("all", sa["overall"], sb["overall"])]
    groups += [(c, sa["by_category"][c], sb["by_category"][c]) for c in sa["by_category"] if c in sb["by_category"]]
    for group, ga, gb in groups:
        for key, stat, name, scale in [("output_tok_s", "median", "median tok/s", 1.0),
                                       ("output_tok_s", "p5", "P5 tok/s (floor)", 1.0),
                                       ("ttft_s", "median", "median TTFT ms", 1e3)]:
            va = (ga.get(key) or {}).get(stat)
            vb = (gb.get(key) or {}).get(stat)
            ratio = f"{vb / va:.3f}" if va and vb else "–"
            t.add_row(group, name, fmt(va, scale), fmt(vb, scale), ratio)
    console.print(t)
