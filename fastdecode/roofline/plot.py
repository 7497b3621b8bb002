"""The roofline as a picture: left, tok/s against bytes read per token, with each route's memory roof
(chips x bandwidth / bytes) and its ceiling; right, the ceilings side by side with measured speeds."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from fastdecode.errors import FastdecodeError
from fastdecode.roofline.calc import Result


def plot(routes: list[tuple[str, Result]], path: str | Path, measured: list[dict] | None = None) -> Path:
    """Write a PNG (or any format matplotlib knows by the suffix) of `routes`, [(label, result)], and of
    `measured` rows ({"label", "decode_tok_s", "bytes_per_token", "ceiling_tok_s"})."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter, NullFormatter
    except ImportError:
        raise FastdecodeError("--plot needs matplotlib: pip install matplotlib") from None
    measured = measured or []
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.1, 1]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    byte_values = [r.bytes_per_token for _, r in routes if r.bytes_per_token > 0]
    byte_values += [m["bytes_per_token"] for m in measured if m.get("bytes_per_token")]
    lo, hi = (min(byte_values) / 10, max(byte_values) * 10) if byte_values else (1e6, 1e12)
    x = np.geomspace(lo, hi, 100)
    for i, (label, r) in enumerate(routes):
        color = colors[i % len(colors)]
        if r.bandwidth_gb_s and r.bytes_per_token:
            left.plot(x / 1e9, r.tp * r.bandwidth_gb_s * 1e9 / x, color=color, alpha=0.35, lw=1)
        if r.bytes_per_token:
            left.scatter([r.bytes_per_token / 1e9], [r.decode_tok_s_ceiling], color=color, zorder=3,
                         label=f"{label}: {r.decode_tok_s_ceiling:,.0f} tok/s ({r.bound})")
    for bandwidth in sorted({m["bandwidth_gb_s"] for m in measured if m.get("bandwidth_gb_s")}):
        left.plot(x / 1e9, bandwidth * 1e9 / x, color="black", ls="--", lw=1, alpha=0.6,
                  label=f"roof at {bandwidth:.1f} GB/s (measured rows)")
    for m in measured:
        if m.get("bytes_per_token"):
            left.scatter([m["bytes_per_token"] / 1e9], [m["decode_tok_s"]], marker="*", s=140, color="black",
                         zorder=4, label=f"measured {m['label']}: {m['decode_tok_s']:,.1f} tok/s")
    left.set(xscale="log", yscale="log", xlabel="bytes read per token (GB)", ylabel="decode tok/s (batch 1)",
             title="roofline: memory roofs and ceilings")
    left.grid(True, which="both", alpha=0.2)
    left.legend(fontsize=7, loc="lower left")

    labels = [label for label, _ in routes] + [f"measured {m['label']}" for m in measured]
    values = [r.decode_tok_s_ceiling for _, r in routes] + [m["decode_tok_s"] for m in measured]
    bar_colors = [colors[i % len(colors)] for i in range(len(routes))] + ["black"] * len(measured)
    y = np.arange(len(labels))
    right.barh(y, values, color=bar_colors, alpha=0.8)
    for m_index, m in enumerate(measured):
        if m.get("ceiling_tok_s"):
            right.plot([m["ceiling_tok_s"]] * 2, [len(routes) + m_index - 0.4, len(routes) + m_index + 0.4],
                       color="red", lw=2)
    for yi, v in zip(y, values):
        right.text(v, yi, f" {v:,.0f}", va="center", fontsize=8)
    right.set(yticks=y, yticklabels=labels, xscale="log", xlabel="decode tok/s (red: that row's ceiling)",
              title=f"{routes[0][1].model}" if routes else "")
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    right.xaxis.set_minor_formatter(NullFormatter())
    right.invert_yaxis()
    right.grid(True, axis="x", which="both", alpha=0.2)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
