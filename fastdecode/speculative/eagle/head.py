"""Trained drafter heads that read the target's hidden states.

EagleHead (EAGLE-3, Li et al. 2025): the residual stream after a low, a middle and a high layer of the target is fused
(fc: 3D -> D), joined with the target's own embedding of the next token, and run through one decoder layer with its
own one-layer KV cache; the layer's output both predicts the token after next (final norm + a draft-vocabulary LM
head) and stands in for the fused feature at the next draft step, so the head drafts autoregressively.

MTPHead (multi-token prediction, Medusa / DeepSeek-MTP style, no attention): the same fused feature and embedding,
then k residual MLP heads predict the tokens 1..k ahead of the root in one pass.

Both keep a reduced draft vocabulary: the N tokens the target predicted most often on the training data; `draft_ids`
maps a draft-vocabulary index back to the full vocabulary. The full LM head would cost about a fifth of a target step
per draft token on SmolLM2-135M.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
import torch.nn.functional as F

from fastdecode.errors import InvalidRequestError
from fastdecode.layers.rotary import apply_rotary

CONFIG_FILE, WEIGHTS_FILE = "config.json", "head.safetensors"


@dataclass
class HeadConfig:
    kind: str  # "eagle" | "mtp"
    target: str  # the target model's name, as given to -m
    fingerprint: str  # target_fingerprint() of the target: a head only loads onto that target
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    taps: list[int]  # target layers whose output residual is fused (low, mid, high)
    draft_vocab_size: int
    mtp_depth: int = 4  # MTP: tokens predicted per pass
    training: dict = field(default_factory=dict)  # what produced it: data size, wall time, held-out acceptance

    def save(self, out: Path):
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> "HeadConfig":
        return cls(**json.loads((path / CONFIG_FILE).read_text()))


def default_taps(num_layers: int) -> list[int]:
    """EAGLE-3's choice: after layer 2, the middle layer and the third from last (clamped for tiny models)."""
    return sorted({min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3)})


def target_fingerprint(model) -> str:
    """A short hash of what identifies the target whatever its weight format: shapes, every 64th embedding row and
    the final norm (quantization leaves both untouched)."""
    c = model.config
    h = hashlib.sha256(f"{c.family} {c.vocab_size} {c.hidden_size} {c.num_hidden_layers}".encode())
    rows = model.embed_tokens(torch.arange(0, c.vocab_size, 64))  # a float table or rows read out of kept blocks
    h.update(rows.detach().float().contiguous().numpy().tobytes())
    h.update(model.norm.weight.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def head_config_for(model, kind: str, target: str, draft_vocab_size: int, mtp_depth: int = 4) -> HeadConfig:
    c = model.config
    return HeadConfig(kind, target, target_fingerprint(model), c.hidden_size, c.intermediate_size,
                      c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps,
                      default_taps(c.num_hidden_layers), min(draft_vocab_size, c.vocab_size), mtp_depth)


def rms(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def fuse_input(taps: torch.Tensor, D: int, eps: float) -> torch.Tensor:
    """taps (..., n * D) -> each tap RMS-normalised: residual streams of different layers differ in scale by orders
    of magnitude, which a plain linear fuse would have to learn away."""
    return rms(taps.unflatten(-1, (-1, D)), None, eps).flatten(-2)


class DraftLMHead(nn.Module):
    """Final norm and an LM head over the draft vocabulary, both started from the target's."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.proj = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("draft_ids", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(rms(x, self.norm, self.eps))  # (..., draft vocab)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        D, H, K, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg, self.H, self.K, self.hd, self.eps = cfg, H, K, hd, cfg.rms_norm_eps
        self.fc = nn.Linear(len(cfg.taps) * D, D, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(D))
        self.hidden_norm = nn.Parameter(torch.ones(D))
        self.qkv_proj = nn.Linear(2 * D, (H + 2 * K) * hd, bias=False)  # reads [embedding, feature]
        self.o_proj = nn.Linear(H * hd, D, bias=False)
        self.post_attention_norm = nn.Parameter(torch.ones(D))
        self.gate_up_proj = nn.Linear(D, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, D, bias=False)
        self.lm_head = DraftLMHead(cfg)

    def fuse(self, taps: torch.Tensor) -> torch.Tensor:
        """the target's taps (..., n_taps * D) -> the fused feature (..., D)."""
        return self.fc(fuse_input(taps, self.cfg.hidden_size, self.eps))

    def qkv(self, feature: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """feature, emb (B, T, D); cos, sin (T, hd) -> q (B, H, T, hd), k, v (B, K, T, hd)."""
        B, T, _ = feature.shape
        x = torch.cat([rms(emb, self.embed_norm, self.eps), rms(feature, self.hidden_norm, self.eps)], -1)
        q, k, v = self.qkv_proj(x).split([self.H * self.hd, self.K * self.hd, self.K * self.hd], -1)
        q = apply_rotary(q.view(B, T, self.H, self.hd).transpose(1, 2), cos, sin)
        k = apply_rotary(k.view(B, T, self.K, self.hd).transpose(1, 2), cos, sin)
        return q, k, v.view(B, T, self.K, self.hd).transpose(1, 2)

    def finish(self, feature: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """feature (B, T, D), attention output (B, H, T, hd) -> the layer's output (B, T, D): the next feature."""
        B, _, T, _ = attn.shape
        x = feature + self.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        gate, up = self.gate_up_proj(rms(x, self.post_attention_norm, self.eps)).chunk(2, -1)
        return x + self.down_proj(F.silu(gate) * up)


class MTPHead(nn.Module):
    """k residual MLP heads on one fused input; head i predicts the token i + 1 places after the root."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        D = cfg.hidden_size
        self.cfg, self.eps = cfg, cfg.rms_norm_eps
        self.fc = nn.Linear(len(cfg.taps) * D + D, D, bias=False)  # [taps..., embedding of the root]
        self.norms = nn.Parameter(torch.ones(cfg.mtp_depth, D))
        self.up = nn.Parameter(torch.zeros(cfg.mtp_depth, 2 * D, D))
        self.down = nn.Parameter(torch.zeros(cfg.mtp_depth, D, 2 * D))
        self.lm_head = DraftLMHead(cfg)

    def forward(self, taps: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """taps (..., n_taps * D), emb (..., D) -> draft-vocabulary logits (..., depth, draft vocab)."""
        u = self.fc(fuse_input(torch.cat([taps, emb], -1), self.cfg.hidden_size, self.eps)).unsqueeze(-2)  # (..., 1, D)
        h = rms(u, None, self.eps) * self.norms  # (..., depth, D)
        h = F.silu(torch.einsum("...kd,ked->...ke", h, self.up))
        h = u + torch.einsum("...ke,kde->...kd", h, self.down)
        return self.lm_head(h)


def build_head(cfg: HeadConfig) -> nn.Module:
    return EagleHead(cfg) if cfg.kind == "eagle" else MTPHead(cfg)


def init_from_target(head: nn.Module, norm_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                     draft_ids: torch.Tensor):
    """Starts the draft LM head from the target's final norm and the (float) LM head rows of the draft vocabulary
    (the head's output then lives in the target's residual space from the first step); the rest small."""
    with torch.no_grad():
        head.lm_head.draft_ids.copy_(draft_ids)
        # Softened 4x: an untrained head's output points anywhere, and the target's sharp head would make it
        # confidently wrong (cross-entropy near 30 instead of near log(vocab)); training sharpens it back.
        head.lm_head.norm.copy_(norm_weight.float() / 4)
        head.lm_head.proj.weight.copy_(lm_head_weight.float()[draft_ids])
        nn.init.normal_(head.fc.weight, std=0.02)
        if isinstance(head, EagleHead):
            for m in (head.qkv_proj, head.o_proj, head.gate_up_proj, head.down_proj):
                nn.init.normal_(m.weight, std=0.02)
        else:
            nn.init.normal_(head.up, std=0.02)
            nn.init.normal_(head.down, std=0.02)


def save_head(head: nn.Module, cfg: HeadConfig, out: Path):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in head.state_dict().items()}, str(out / WEIGHTS_FILE))
    cfg.save(out)


def load_head(path: str | Path, model) -> tuple[nn.Module, HeadConfig]:
    """A trained head for this target model; a head trained for another target is refused."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
        raise InvalidRequestError(f"no drafter head at {path} (expected {CONFIG_FILE} and {WEIGHTS_FILE}; train one "
                                  f"with `fastdecode train-drafter`)")
    cfg = HeadConfig.read(path)
    fingerprint = target_fingerprint(model)
    if cfg.fingerprint != fingerprint:
        raise InvalidRequestError(f"the drafter head at {path} was trained for {cfg.target} (fingerprint "
                                  f"{cfg.fingerprint}), not this model (fingerprint {fingerprint})")
    head = build_head(cfg)
    head.load_state_dict(load_file(str(path / WEIGHTS_FILE)))
    return head.eval().requires_grad_(False), cfg
