"""Writers of llama.cpp's K-quant blocks (Q4_K, Q5_K, Q6_K), which the `gguf` package reads but cannot write.

A plain min/max fit per sub-block, not llama.cpp's error-minimising search: tests need valid blocks in the file's
layout whose values follow the weights, not the best ones. `random_blocks` gives raw blocks of any bit pattern, for
tests and for bench/shapes.py's real-size files (whose speed depends on shapes and bytes, not values).
"""
import numpy as np
from gguf import GGMLQuantizationType as QType

K_QUANTS = (QType.Q4_K, QType.Q5_K, QType.Q6_K)
BLOCK_BYTES = {QType.Q4_K: 144, QType.Q5_K: 176, QType.Q6_K: 210}


def fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """sc, m (B, 8) in 0..63 -> (B, 12) bytes, the inverse of gguf's Q4_K.get_scale_min."""
    lo, hi = sc[:, :4] | (sc[:, 4:] >> 4) << 6, m[:, :4] | (m[:, 4:] >> 4) << 6
    return np.concatenate([lo, hi, (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4], axis=1).astype(np.uint8)


def quantize_min_max(w: np.ndarray, levels: int):
    """w (B, 8, 32) -> d, dmin (B,) fp16, sc, m (B, 8) uint8, q (B, 8, 32) in 0..levels: w ~ d sc q - dmin m."""
    lo, hi = np.minimum(w.min(-1), 0), np.maximum(w.max(-1), 0)
    scale, mn = (hi - lo) / levels, -lo
    d, dmin = fp16(scale.max(-1) / 63), fp16(mn.max(-1) / 63)
    sc = np.where(d[:, None] > 0, np.round(scale / np.maximum(d[:, None], 1e-30)), 0).clip(0, 63).astype(np.uint8)
    m = np.where(dmin[:, None] > 0, np.round(mn / np.maximum(dmin[:, None], 1e-30)), 0).clip(0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * m
    q = np.where(step[..., None] > 0, np.round((w + offset[..., None]) / np.maximum(step[..., None], 1e-30)), 0)
    return d, dmin, sc, m, q.clip(0, levels).astype(np.uint8)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = quantize_min_max(w.reshape(-1, 8, 32), 15)
    qs = (q[:, 0::2] | q[:, 1::2] << 4).reshape(-1, 128)  # per pair of sub-blocks: low nibbles 2p, high 2p + 1
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), pack_scales(sc, m), qs], axis=1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = quantize_min_max(w.reshape(-1, 8, 32), 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # bit k of byte l: 32 k + l
    qs = ((q[:, 0::2] & 15) | (q[:, 1::2] & 15) << 4).reshape(-1, 128)
    return np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8), pack_scales(sc, m), qh, qs],
                          axis=1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    g = w.reshape(-1, 16, 16)
    scale = np.abs(g).max(-1) / 31
    d = fp16(scale.max(-1) / 127)
    sc = np.where(d[:, None] > 0, np.round(scale / np.maximum(d[:, None], 1e-30)), 0).clip(-128, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.where(step[..., None] != 0, np.round(g / np.where(step == 0, 1, step)[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (half, quarter, 32)
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q >> 4 << np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]).sum(2, dtype=np.uint8)  # (B, half, 32)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d[:, None].view(np.uint8)],
                          axis=1)


QUANTIZERS = {QType.Q4_K: quantize_q4_k, QType.Q5_K: quantize_q5_k, QType.Q6_K: quantize_q6_k}


def quantize(w: np.ndarray, qtype: QType) -> np.ndarray:
    """w (..., K) float, K % 256 == 0 -> (..., K / 256 * block bytes) uint8 as a GGUF tensor stores it."""
    blocks = QUANTIZERS[qtype](np.ascontiguousarray(w, dtype=np.float32).reshape(-1, 256))
    return blocks.reshape(*w.shape[:-1], -1)


def random_blocks(qtype: QType, n: int, rng: np.random.Generator, d_range=(1e-3, 1e-2)) -> np.ndarray:
    """n raw blocks of random bytes, their fp16 d (and dmin) drawn log-uniformly from d_range (None: any finite
    fp16, subnormals and 65504 included) -> (n, block bytes) uint8."""
    blocks = rng.integers(0, 256, (n, BLOCK_BYTES[qtype]), dtype=np.uint8)
    offsets = [208] if qtype == QType.Q6_K else [0, 2]
    for at in offsets:
        if d_range is None:
            bits = rng.integers(0, 1 << 16, n, dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # inf and NaN -> finite (exponent 0: subnormal)
            bits[:4] = [0x7BFF, 0xFBFF, 0x0001, 0x0000]  # +-65504, the smallest subnormal, zero
            d = bits.view(np.float16)
        else:
            lo, hi = np.log(d_range)
            d = fp16(np.exp(rng.uniform(lo, hi, n)))
        blocks[:, at:at + 2] = d[:, None].view(np.uint8)
    return blocks
