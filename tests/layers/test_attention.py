"""Attention with gpt-oss's sinks: both ways of adding the sink to the softmax's denominator equal transformers' eager
formula (scores and sink concatenated, softmaxed, the sink's column dropped)."""
import pytest
import torch

from fastdecode.layers.attention import attend, sink_attention_key, sink_attention_lse


def eager(q, k, v, mask, scale, sinks):
    """transformers' gpt_oss eager_attention_forward, with k/v repeated per query group."""
    n = q.shape[-3] // k.shape[-3]
    scores = q @ k.repeat_interleave(n, -3).transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks[:, None, None].expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(logits, dim=-1)[..., :-1] @ v.repeat_interleave(n, -3)


@pytest.mark.parametrize("batched", [True, False], ids=["static", "paged"])  # the static cache's (B, ...) or not
@pytest.mark.parametrize("masked", [True, False])
def test_sink_attention_equals_transformers_eager(batched, masked):
    g = torch.Generator().manual_seed(0)
    lead = (2,) if batched else ()
    q, k, v = (torch.randn(*lead, h, t, 16, generator=g) for h, t in ((8, 5), (2, 12), (2, 12)))  # 4 q heads a kv
    mask = torch.rand(5, 12, generator=g) > 0.3 if masked else None
    sinks = torch.randn(8, generator=g) * 3
    expected = eager(q, k, v, mask, 0.25, sinks)
    assert (attend(q, k, v, mask, 0.25, sinks) - expected).abs().max() < 1e-6
    bias = None if mask is None else torch.zeros(5, 12).masked_fill(~mask, float("-inf"))
    for way in (sink_attention_lse, sink_attention_key):  # the CPU kernel's; any device's
        assert (way(q, k, v, bias, 0.25, sinks) - expected).abs().max() < 1e-6
