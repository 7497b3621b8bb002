"""The roofline ceiling drawn on the lab's speed plots: the fastest batch-1 decode the model's bytes per token allow
on the hardware (fastdecode.roofline). Known for a local model on this machine (the bandwidth probe, cached for a
day), or for a remote one when --hw and --roofline-model name the chip and model."""
from __future__ import annotations

import shlex

from fastdecode.errors import FastdecodeError
from fastdecode.roofline.calc import Scenario, roofline
from fastdecode.roofline.hardware import THIS_MACHINE, get_hardware, this_machine
from fastdecode.roofline.models import get_model

DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def serve_weight_format(serve_args: tuple[str, ...]) -> tuple[str | None, int, int | None]:
    """(roofline dtype, int4 group size, threads) that `fastdecode serve` options imply: None (the file's own
    formats, as published) where neither --quant nor --dtype is given or --quant is gguf, else the --quant scheme or
    float weights in --dtype."""
    words = [w for arg in serve_args for w in shlex.split(arg)]
    opts = {}
    for i, w in enumerate(words):
        if w.startswith("--"):
            name, eq, value = w.partition("=")
            opts[name] = value if eq else (words[i + 1] if i + 1 < len(words) else "")
    quant = opts.get("--quant", None if "--dtype" not in opts else "none")
    dtype = quant if quant in ("int8", "int4") else DTYPE_NAMES.get(opts.get("--dtype", "float32"), "fp32")
    if quant in (None, "gguf"):
        dtype = None
    threads = int(opts["--threads"]) if opts.get("--threads", "").isdigit() else None
    group = int(opts["--group-size"]) if opts.get("--group-size", "").isdigit() else 32
    return dtype, group, threads


def decode_ceiling(model: str, hw_name: str, dtype: str | None = None, group_size: int = 128,
                   threads: int | None = None, context: int = 1024) -> dict | None:
    """{"tok_s", "label", ...} or None when the model or hardware is unknown; never fails the run."""
    try:
        from fastdecode.loading.catalog import CATALOG, cached_path

        spec = get_model(str(cached_path(model)) if model in CATALOG else model)
        if hw_name.strip().lower() == THIS_MACHINE:
            from fastdecode.roofline.probe import cached_probe

            per_token = spec.weight_bytes(dtype, 1, group_size) + spec.kv_bytes(context)
            probe = cached_probe(int(per_token), threads)
            hw = this_machine(probe["working_set_gb_s"], probe["matmul_tflops"], probe["threads"])
        else:
            hw = get_hardware(hw_name)
        r = roofline(Scenario(model=spec, hardware=hw, dtype=dtype, group_size=group_size, context=context))
    except (FastdecodeError, OSError, KeyError, ValueError) as e:
        return {"tok_s": None, "label": f"no ceiling: {e}"}
    return {"tok_s": r.decode_tok_s_ceiling, "bound": r.bound, "bytes_per_token": r.bytes_per_token,
            "bandwidth_gb_s": r.bandwidth_gb_s, "hardware": hw.label, "weights": r.weights,
            "label": f"roofline {r.decode_tok_s_ceiling:,.0f} tok/s ({r.weights}, {r.bound}-bound, {hw.label}, "
                     f"{r.bandwidth_gb_s:,.1f} GB/s)"}
