"""`--report out.html`: one self-contained HTML file (plots as base64 PNG, no scripts, no network) of one stored run:
the summary tables, speed per category, speed over time, per-user speed and throughput against concurrency, TTFT
against output speed, and the roofline ceiling where the model and hardware are known."""
from __future__ import annotations

import base64
import io
import json
from html import escape
from pathlib import Path

from fastdecode.lab.metrics import request_metrics, sweep_rows
from fastdecode.lab.storage import StoredRun

METRIC_ROWS = [("output_tok_s", "output tok/s", 1.0), ("window_floor_tok_s", "window floor tok/s", 1.0),
               ("ttft_s", "TTFT ms", 1e3), ("ttfc_s", "time to first content ms", 1e3),
               ("tpot_s", "TPOT ms", 1e3), ("itl_s", "ITL ms", 1e3), ("e2e_s", "end-to-end s", 1.0),
               ("output_tokens", "output tokens", 1.0), ("prompt_tokens", "prompt tokens", 1.0)]
STAT_COLUMNS = ["mean", "median", "p5", "p95", "p99", "min", "max"]
CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}figure{margin:1em 0}figure img{max-width:100%}
figcaption{color:#555;font-size:90%}pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:85%}
.err{color:#a00}"""


def write_report(run: StoredRun, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render(run), encoding="utf-8")
    return path


def render(run: StoredRun) -> str:
    s = run.summary
    ceiling = s.get("ceiling")  # {"tok_s", "label"}; tok_s None when it could not be computed (label says why)
    parts = [f"<h1>fastdecode speed lab: run {run.id}{' — ' + escape(run.label) if run.label else ''}</h1>",
             f"<p>{escape(run.target)} · modes {escape(run.modes)} · {escape(run.created_at)} · "
             f"{s['overall']['ok']} of {s['overall']['requests']} requests succeeded · window floor over "
             f"{s['window_tokens']} tokens</p>"]
    if ceiling:
        parts.append(f"<p id='ceiling'>Ceiling: {escape(ceiling['label'])}</p>")
    parts += ["<h2>All requests</h2>", stats_table(s["overall"])]
    parts += ["<h2>Per category</h2>", category_table(s["by_category"])]
    rows = sweep_rows(s)
    if rows:
        parts += ["<h2>Concurrency sweep</h2>", sweep_table(rows)]
    if s.get("compare"):
        parts += ["<h2>Compare (B against A, paired)</h2>", compare_table(s)]
    if s.get("cost"):
        parts += ["<h2>Cost</h2>", cost_table(s["cost"])]
    parts += ["<h2>Plots</h2>", *figures(run, ceiling)]
    parts += ["<h2>Errors</h2>", errors_table(run)]
    parts += ["<h2>Configuration and environment</h2>",
              f"<details><summary>configuration</summary><pre>{escape(json.dumps(run.config, indent=2))}</pre>"
              "</details>",
              f"<details open><summary>environment</summary><pre>{escape(json.dumps(run.environment, indent=2))}"
              "</pre></details>"]
    return (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>fastdecode lab run {run.id}</title>"
            f"<style>{CSS}</style></head><body>{''.join(parts)}</body></html>\n")


def fmt(x, scale=1.0) -> str:
    if x is None:
        return "–"
    v = x * scale
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def html_table(cls: str, head: list[str], rows: list[list]) -> str:
    cells = lambda tag, row: "".join(f"<{tag}>{escape(str(c))}</{tag}>" for c in row)  # noqa: E731
    body = "".join(f"<tr>{cells('td', row)}</tr>" for row in rows)
    return f"<table class='{cls}'><tr>{cells('th', head)}</tr>{body}</table>"


# Rows of cells that the HTML report and the terminal tables (tables.py) both show, each under its own headings.
def stats_rows(group: dict) -> list[list[str]]:
    return [[name, str(group[key]["n"]), *(fmt(group[key][c], scale) for c in STAT_COLUMNS)]
            for key, name, scale in METRIC_ROWS if group.get(key)]


def category_rows(by_category: dict) -> list[list[str]]:
    rows = []
    for cat, g in by_category.items():
        speed, floor, ttft = g["output_tok_s"] or {}, g["window_floor_tok_s"] or {}, g["ttft_s"] or {}
        rows.append([cat, str(g["requests"]), str(g["errors"]), fmt(speed.get("median")), fmt(speed.get("p5")),
                     fmt(floor.get("p5")), fmt(ttft.get("median"), 1e3), fmt(ttft.get("p95"), 1e3)])
    return rows


def sweep_cells(r: dict) -> list[str]:
    return [str(r["concurrency"]), fmt(r["per_user_tok_s"]), fmt(r.get("per_user_vs_first")),
            fmt(r["per_user_floor_tok_s"]), throughput_cell(r), fmt(r.get("throughput_vs_first")),
            fmt(r.get("busy_throughput_tok_s")), fmt(r["ttft_s"], 1e3), str(r["errors"])]


def stats_table(group: dict) -> str:
    extra = f"<p>throughput {fmt(group.get('throughput_tok_s'))} tok/s over {fmt(group.get('duration_s'))} s</p>"
    return html_table("stats", ["metric", "n", *STAT_COLUMNS], stats_rows(group)) + extra


def category_table(by_category: dict) -> str:
    return html_table("categories", ["category", "requests", "errors", "median tok/s", "P5 tok/s (floor)",
                                     "window floor tok/s (P5)", "median TTFT ms", "P95 TTFT ms"],
                      category_rows(by_category))


def vs_first(rows: list[dict]) -> str:
    """The heading of a sweep's columns against its lowest level."""
    return f"x {rows[0]['concurrency']} user" + ("s" if rows[0]["concurrency"] > 1 else "") if rows else ""


def throughput_cell(row: dict) -> str:
    """A sweep level's throughput, with the range of its passes where there were several."""
    passes = row.get("throughput_passes_tok_s")
    return fmt(row["throughput_tok_s"]) + (f" ({fmt(min(passes))}-{fmt(max(passes))})" if passes else "")


def sweep_table(rows: list[dict]) -> str:
    return html_table("sweep", ["users", "per-user tok/s (median)", vs_first(rows), "per-user floor (P5)",
                                "total throughput tok/s", vs_first(rows), "while all users busy", "median TTFT ms",
                                "errors"], [sweep_cells(r) for r in rows])


def compare_table(s: dict) -> str:
    c, arms = s["compare"], s.get("by_arm", {})
    rows = [[a, fmt((g["output_tok_s"] or {}).get("median")), fmt((g["ttft_s"] or {}).get("median"), 1e3),
             g["errors"]] for a, g in arms.items()]
    return (html_table("compare", ["arm", "median tok/s", "median TTFT ms", "errors"], rows) +
            f"<p>B/A output speed, median of {c['pairs']} interleaved pairs: "
            f"{fmt(c['speed_ratio_b_over_a'])} (P5 {fmt(c['speed_ratio_p5'])}, P95 {fmt(c['speed_ratio_p95'])}); "
            f"B/A TTFT {fmt(c['ttft_ratio_b_over_a'])}</p>")


def cost_table(cost: dict) -> str:
    rows = [[k, usd(v)] for k, v in cost["per_task_usd_by_category"].items()]
    return (f"<p>${cost['input_per_m']:g} / ${cost['output_per_m']:g} per million input / output tokens: "
            f"{usd(cost['per_request_usd'])} per request, {usd(cost['per_task_usd'])} per task, "
            f"{usd(cost['total_usd'])} in all.</p>" + html_table("cost", ["category", "$ per task"], rows))


def usd(x) -> str:
    return "–" if x is None else f"${x:.6f}" if x < 0.01 else f"${x:,.4f}"


def errors_table(run: StoredRun) -> str:
    failed = [r for r in run.records if not r.ok]
    if not failed:
        return "<p>none</p>"
    rows = "".join(f"<tr><td>{escape(r.item_id)}</td><td>{escape(r.phase)}</td><td>{r.status or ''}</td>"
                   f"<td class='err'>{escape(r.error or 'no tokens')}</td></tr>" for r in failed)
    return f"<table class='errors'><tr><th>item</th><th>phase</th><th>HTTP</th><th>error</th></tr>{rows}</table>"


# ---- plots -----------------------------------------------------------------------------------------------------
def figures(run: StoredRun, ceiling: dict | None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    window = run.summary["window_tokens"]
    measured = [(r, m) for r in run.records if (m := request_metrics(r, window)) is not None]
    roof = ceiling.get("tok_s") if ceiling else None
    out = []
    for plot_id, caption, draw in [
        ("speed-by-category", "Output speed per category (each dot a request; box: quartiles)", plot_by_category),
        ("speed-over-time", "Output speed over the run (dots: requests; line: median per interval)", plot_over_time),
        ("concurrency", "Per-user output speed and total throughput against concurrency", plot_concurrency),
        ("ttft-vs-speed", "TTFT against output speed", plot_ttft_vs_speed),
        ("compare", "Output speed of A and B, interleaved", plot_compare),
    ]:
        png = draw(run, measured, roof)
        if png is not None:
            out.append(f"<figure id='plot-{plot_id}'><img alt='{escape(caption)}' "
                       f"src='data:image/png;base64,{png}'><figcaption>{escape(caption)}</figcaption></figure>")
    return out


def to_png(fig) -> str:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def roof_line(ax, roof: float | None):
    if roof:
        ax.axhline(roof, color="crimson", ls="--", lw=1, label=f"roofline ceiling {roof:,.0f} tok/s")
        ax.legend(loc="best", fontsize=8)


def plot_by_category(run, measured, roof):
    import matplotlib.pyplot as plt
    import numpy as np

    cats = sorted({r.category for r, m in measured if m.output_tok_s})
    if not cats:
        return None
    data = [[m.output_tok_s for r, m in measured if r.category == c and m.output_tok_s] for c in cats]
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(cats) + 1), cats)
    rng = np.random.default_rng(0)
    for i, d in enumerate(data, 1):
        ax.scatter(i + rng.uniform(-0.15, 0.15, len(d)), d, s=10, alpha=0.6)
    ax.set_ylabel("output tok/s (excluding TTFT)")
    roof_line(ax, roof)
    return to_png(fig)


def plot_over_time(run, measured, roof):
    import matplotlib.pyplot as plt

    points = [(m.end_at, m.output_tok_s, r.phase) for r, m in measured if m.output_tok_s]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(9, 4))
    for phase in dict.fromkeys(p for _, _, p in points):
        xs = [t for t, _, p in points if p == phase]
        ax.scatter(xs, [v for _, v, p in points if p == phase], s=10, alpha=0.6, label=phase)
    series = run.summary.get("speed_over_time") or []
    if series:
        ax.plot([p["t_s"] for p in series], [p["median_tok_s"] for p in series], "o-", color="black", lw=1.5,
                label="median per interval")
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("output tok/s")
    ax.legend(loc="best", fontsize=8)
    roof_line(ax, roof)
    return to_png(fig)


def plot_concurrency(run, measured, roof):
    import matplotlib.pyplot as plt

    rows = [r for r in sweep_rows(run.summary) if r["per_user_tok_s"]]
    if not rows:
        return None
    users = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(users, [r["per_user_tok_s"] for r in rows], "o-", label="median")
    left.plot(users, [r["per_user_floor_tok_s"] for r in rows], "v--", label="P5 (floor)")
    left.set_xlabel("concurrent users")
    left.set_ylabel("per-user output tok/s")
    left.legend(fontsize=8)
    roof_line(left, roof)
    right.plot(users, [r["throughput_tok_s"] or 0 for r in rows], "s-", color="darkgreen")
    right.set_xlabel("concurrent users")
    right.set_ylabel("total output tok/s")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(users, [str(u) for u in users])
    return to_png(fig)


def plot_ttft_vs_speed(run, measured, roof):
    import matplotlib.pyplot as plt

    if not any(m.output_tok_s for _, m in measured):
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for cat in sorted({r.category for r, _ in measured}):
        pts = [(m.ttft_s * 1e3, m.output_tok_s) for r, m in measured if r.category == cat and m.output_tok_s]
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=12, alpha=0.7, label=cat)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("output tok/s")
    ax.legend(loc="best", fontsize=8)
    return to_png(fig)


def plot_compare(run, measured, roof):
    import matplotlib.pyplot as plt

    arms = sorted({r.arm for r, _ in measured if r.arm})
    if len(arms) < 2:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot([[m.output_tok_s for r, m in measured if r.arm == a and m.output_tok_s] for a in arms])
    ax.set_xticks(range(1, len(arms) + 1), [run.config.get(f"label_{a.lower()}") or a for a in arms])
    ax.set_ylabel("output tok/s")
    roof_line(ax, roof)
    return to_png(fig)
