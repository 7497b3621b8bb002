"""Trained drafter heads (EAGLE-3 style and multi-token prediction) that read the target's hidden states; trained by
`fastdecode train-drafter` (fastdecode/train/), used with `--speculate eagle[:DIR]` or `auto+eagle[:DIR]`."""
from __future__ import annotations

from pathlib import Path

from fastdecode.speculative.eagle.head import HeadConfig, load_head


def default_head_dir(model: str) -> Path:
    """Where `make drafter` puts the head for a registered model: $FASTDECODE_HOME/drafters/<model>."""
    from fastdecode.loading.catalog import fastdecode_home

    return fastdecode_home() / "drafters" / Path(model).name


def head_drafters(path: str | Path | None, llm):
    """-> (a maker of one request's drafter over the head in `path` (None: the default one for llm's model), bound
    to llm's model, the target layers whose residuals it reads). The head's linears get int8 weights when the target
    is quantized (a draft step then reads a quarter of the bytes)."""
    from fastdecode.layers.rotary import rope_cache
    from fastdecode.speculative.eagle.drafter import EagleDrafter, MTPDrafter

    head, cfg = load_head(path or default_head_dir(llm.name), llm.model)
    if llm.quant:
        from fastdecode.quant import quantize_model
        quantize_model(head, "int8", lm_head_scheme="int8")
    if cfg.kind == "mtp":
        return (lambda: MTPDrafter(head, cfg, llm.model, top_k=4)), cfg.taps
    c = llm.model.config
    rope = rope_cache(cfg.head_dim, llm.max_seq_len + 64, c.rope_theta, c.rope_scaling)
    # Small trees: on a CPU verifying a node costs a good share of a decode step (docs/speculative.md).
    return (lambda: EagleDrafter(head, cfg, llm.model, rope, top_k=4, depth=4, min_score=0.05)), cfg.taps


__all__ = ["HeadConfig", "head_drafters", "default_head_dir", "load_head"]
