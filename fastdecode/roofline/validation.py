"""Published single-user decode speeds (published.toml) beside the calculated ceiling.
`python -m fastdecode.roofline.validation` prints the markdown table for docs/roofline.md."""
from __future__ import annotations

import tomllib
from pathlib import Path

from fastdecode.roofline.calc import Scenario, roofline
from fastdecode.roofline.hardware import load_catalog as load_hardware
from fastdecode.roofline.models import load_catalog as load_models

PUBLISHED_FILE = Path(__file__).with_name("published.toml")


def validation_rows(path: Path = PUBLISHED_FILE) -> list[dict]:
    with open(path, "rb") as f:
        figures = tomllib.load(f)["figure"]
    hardware, models = load_hardware(), load_models()
    rows = []
    for fig in figures:
        model = models[fig["model"]]
        result = roofline(Scenario(model, hardware[fig["hardware"]], dtype=fig.get("dtype"),
                                   group_size=fig.get("group_size", 128), context=fig["context"],
                                   tp=fig.get("tp")))
        rows.append({**fig, "kind": fig.get("kind", "plain"), "ceiling_tok_s": result.decode_tok_s_ceiling,
                     "bound": result.bound, "chips": result.chips, "bytes_per_token": result.bytes_per_token,
                     "efficiency": fig["tok_s"] / result.decode_tok_s_ceiling,
                     "us_per_layer": 1e6 / fig["tok_s"] / model.num_hidden_layers})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| system | model | weights | chips | published tok/s | ceiling tok/s (bound) | efficiency | "
             "us per layer | kind |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        weights = (r.get("dtype") or "wired int4") + (f" g{r['group_size']}" if "group_size" in r else "")
        lines.append(f"| {r['system']} | {r['model']} | {weights} | {r['chips']} | {r['tok_s']:,} | "
                     f"{r['ceiling_tok_s']:,.0f} ({r['bound']}) | {r['efficiency']:.1%} | "
                     f"{r['us_per_layer']:.1f} | {r['kind']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(validation_rows()))
