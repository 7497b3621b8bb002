"""llama.cpp's K-quants (Q4_K, Q5_K, Q6_K: what Q4_K_M and Q5_K_M files are made of) held as the file has them.

A super-block holds 256 weights of a row:
- Q4_K (144 bytes): fp16 d and dmin, 12 bytes of 6-bit scales sc and mins m for 8 sub-blocks of 32, 128 bytes of
  4-bit q; w = d * sc * q - dmin * m.
- Q5_K (176 bytes): the same with a fifth bit of q (32 bytes), q in 0..31.
- Q6_K (210 bytes): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales for sub-blocks of 16, fp16 d;
  w = d * sc * (q - 32), q in 0..63.

At load the blocks are repacked, byte for byte, into the tile-major layout the native kernel reads in one sequential
stream (kernels/kquant.cpp describes it; 592, 720 and 840 bytes per 4 rows of a super-block, 3% above the file for
the unpacked 6-bit scales). No value is rounded on the way: `dequantize` of the packed form equals gguf's own
dequantization bit for bit (d * sc and dmin * m are exact in float32, and the rest is gguf's arithmetic in its order).

Backends: "native" (kq_linear: activations quantized to int8 per block of 32, integer dot products, the only one the
whole-model native step takes); "dequant" (no kernel: the same packed bytes dequantized and multiplied in float at
every forward).
"""
import torch

from fastdecode import memory
from fastdecode.quant.kernels import native_ops
from fastdecode.quant.linear import QuantLinear
from fastdecode.quant.repack import move

QK_K = 256
FILE_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # a super-block in the file
TILE_BYTES = {"q4_k": 592, "q5_k": 720, "q6_k": 840}  # 4 rows of a super-block, packed
KINDS = tuple(FILE_BYTES)


def halves(t: torch.Tensor) -> torch.Tensor:
    """(..., 2k) uint8 -> (..., k) the little-endian fp16 values they hold, as float32."""
    return t.contiguous().view(torch.float16).float()


def bytes_of(word: int, value: int) -> int:
    """`value` repeated in every byte of a signed int`8 * word`: a bytewise mask for torch's signed integer types."""
    v = int.from_bytes(bytes([value]) * word, "little")
    return v - (1 << 8 * word) if v >= 1 << (8 * word - 1) else v


def tiles(t: torch.Tensor) -> torch.Tensor:
    """(N, S, ...) per row -> (N/4, S, 4, ...): the 4 rows of each tile side by side, per super-block."""
    return t.reshape(t.shape[0] // 4, 4, *t.shape[1:]).transpose(1, 2)


def pack(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The file's blocks (N, K/256, FILE_BYTES) uint8 -> (N/4, K/256, TILE_BYTES) uint8 in kquant.cpp's layout.

    Written once into the output; blocks may be a strided view of a mapped file. Q4_K/Q5_K go through the native
    kq_pack in one pass where it is built. Otherwise byte runs are moved (repack.move), and the nibble regrouping and
    6-bit scale unpacking run on 8- and 4-byte words with bytewise masks (a shift across bytes only moves bits the mask
    drops), 8 and 4 times fewer elements than bytes."""
    N, S, _ = blocks.shape
    out = memory.weight_pages(N // 4, S, TILE_BYTES[kind], dtype=torch.uint8)
    if kind != "q6_k" and (ops := native_ops()) is not None and blocks.stride(2) == 1:
        ops.kq_pack(out, blocks)  # the same bytes in one pass (kquant.cpp); what follows is the fallback
        return out
    d_at = 208 if kind == "q6_k" else 0
    move(out[..., :8].view(N // 4, S, 4, 2), tiles(blocks[..., d_at:d_at + 2]))  # d
    if kind == "q6_k":
        move(out[..., 8:72].view(N // 4, S, 2, 4, 8), tiles(blocks[..., 192:208].reshape(N, S, 2, 8)).transpose(2, 3))
        q = out[..., 72:].view(N // 4, S, 2, 4, 96)  # per half and row: ql (64 bytes), qh (32)
        move(q[..., :64], tiles(blocks[..., :128].reshape(N, S, 2, 64)).transpose(2, 3))
        move(q[..., 64:], tiles(blocks[..., 128:192].reshape(N, S, 2, 32)).transpose(2, 3))
        return out
    if blocks.data_ptr() % 8 or any(st % 8 for st in blocks.stride()[:-1]):
        blocks = blocks.clone()  # the word views below need 8-byte alignment (file tensors and rows have it)
    move(out[..., 8:16].view(N // 4, S, 4, 2), tiles(blocks[..., 2:4]))  # dmin
    # The 12 scale bytes (gguf's get_scale_min): bytes 0-3 (lo) hold sc 0-3 in their low 6 bits, 4-7 (hi) m 0-3;
    # bytes 8-11 (mix) hold sc 4-7 and m 4-7 in their nibbles, the top 2 bits of each from the high bits of lo (sc)
    # and hi (m). sc, m (N, S, 8) in 0..63, as two 4-byte words.
    lo, hi, mix = blocks[..., 4:16].view(torch.int32).unbind(-1)  # (N, S) each
    sc = torch.stack([lo & bytes_of(4, 63), (mix & bytes_of(4, 15)) | ((lo >> 2) & bytes_of(4, 0x30))], -1)
    m = torch.stack([hi & bytes_of(4, 63), ((mix >> 4) & bytes_of(4, 15)) | ((hi >> 2) & bytes_of(4, 0x30))], -1)
    for at, v in ((16, sc), (48, m)):  # (N, S, 2) words = the 8 bytes -> per tile (pair, row, sub-block of the pair)
        move(out[..., at:at + 32].view(N // 4, S, 4, 4, 2), tiles(v.view(torch.uint8).view(N, S, 4, 2)).transpose(2, 3))
    words = blocks[..., -128:].view(torch.int64).view(N, S, 4, 2, 2)  # per pair p: bytes j and j + 16 of the 32
    lo, hi = words[..., 0, :], words[..., 1, :]
    # Sub-block 2p is the pair's low nibbles, 2p + 1 its high ones; each becomes 16 bytes of q[j] | q[j + 16] << 4.
    low = (lo & bytes_of(8, 0x0F)) | ((hi << 4) & bytes_of(8, 0xF0))
    high = ((lo >> 4) & bytes_of(8, 0x0F)) | (hi & bytes_of(8, 0xF0))
    q = out[..., -512:].view(N // 4, S, 4, 4, 2, 16)  # (pair, row, sub-block 2p | 2p + 1, 16)
    for i, v in enumerate((low, high)):
        move(q[..., i, :], tiles(v.contiguous().view(torch.uint8).view(N, S, 4, 16)).transpose(2, 3))
    if kind == "q5_k":
        # Element 32 k + l's fifth bit is bit k of the file's byte l; ours: bit 2p (2p + 1) of byte j is that of the
        # low (high) nibble of pair p's byte j.
        bits = (blocks[..., 16:48].unsqueeze(2) >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1  # (N, S, 8, 32)
        bits = bits.reshape(N, S, 4, 2, 2, 16)  # (pair, sub-block of the pair, first | second 16 elements, 16)
        low, high = bits[..., 0, :].reshape(N, S, 4, 32), bits[..., 1, :].reshape(N, S, 4, 32)
        shift = 2 * torch.arange(4, dtype=torch.uint8)[:, None]
        fifth = ((low << shift) | (high << (shift + 1))).sum(2, dtype=torch.uint8)  # disjoint bits: sum is or
        move(out[..., 80:208].view(N // 4, S, 4, 32), tiles(fifth))
    return out


def dequantize(packed: torch.Tensor, kind: str) -> torch.Tensor:
    """(T, S, TILE_BYTES) packed tiles -> (4 T, 256 S) float32, gguf.quants.dequantize's values bit for bit."""
    T, S, _ = packed.shape
    d = halves(packed[..., :8]).reshape(T, S, 4, 1)
    if kind == "q6_k":
        sc = packed[..., 8:72].contiguous().view(torch.int8).reshape(T, S, 2, 4, 8).transpose(2, 3).reshape(T, S, 4, 16)
        q = packed[..., 72:].reshape(T, S, 2, 4, 96).transpose(2, 3)  # (T, S, row, half, 96)
        ql0, ql1, qh = q[..., :32], q[..., 32:64], q[..., 64:]
        q = torch.cat([(ql0 & 15) | (qh & 3) << 4, (ql1 & 15) | (qh >> 2 & 3) << 4,
                       ql0 >> 4 | (qh >> 4 & 3) << 4, ql1 >> 4 | (qh >> 6) << 4], dim=-1)  # (T, S, row, half, 128)
        q = q.reshape(T, S, 4, 16, 16).to(torch.int8) - 32
        w = (d * sc.float()).unsqueeze(-1) * q.float()  # gguf: (d * sc) * (q - 32)
    else:
        dmin = halves(packed[..., 8:16]).reshape(T, S, 4, 1)
        sc, m = (packed[..., lo:lo + 32].reshape(T, S, 4, 4, 2).transpose(2, 3).reshape(T, S, 4, 8)
                 for lo in (16, 48))
        qs = packed[..., -512:].reshape(T, S, 4, 4, 2, 16).transpose(2, 3)  # (T, S, pair, row, sub-block, 16)
        q = torch.cat([qs & 15, qs >> 4], dim=-1)  # (T, S, row, pair, sub-block, 32)
        if kind == "q5_k":
            fifth = packed[..., 80:208].reshape(T, S, 4, 1, 32) >> (2 * torch.arange(4, dtype=torch.uint8)[:, None])
            fifth = fifth.reshape(T, S, 4, 4, 2, 16)  # (row, pair, low nibbles of sub-block 2p | of 2p + 1, 16)
            q = q | torch.cat([fifth & 1, fifth >> 1 & 1], dim=-1) << 4
        q = q.reshape(T, S, 4, 8, 32).float()
        w = (d * sc.float()).unsqueeze(-1) * q - (dmin * m.float()).unsqueeze(-1)  # gguf: d * sc * q - dmin * m
    return w.transpose(1, 2).reshape(4 * T, 256 * S)


def native_fits(out_features: int, in_features: int) -> bool:
    return native_ops() is not None and out_features % 4 == 0 and in_features % QK_K == 0


class KQuantLinear(QuantLinear):
    native_op = "kq_linear"
    row_backends = ("native", "dequant")

    def __init__(self, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None, backend: str | None = None):
        """blocks (N, K/256, FILE_BYTES[kind]) uint8: a GGUF tensor's super-blocks as they are."""
        super().__init__()
        N, S, size = blocks.shape
        if kind not in FILE_BYTES or size != FILE_BYTES[kind] or N % 4:
            raise ValueError(f"{kind}: need (N, K/256, {FILE_BYTES.get(kind)}) blocks with N % 4 == 0; got "
                             f"{tuple(blocks.shape)}")
        self.kind, self.out_features, self.in_features = kind, N, S * QK_K
        self.backend = backend or ("native" if native_fits(N, S * QK_K) else "dequant")
        if self.backend not in self.row_backends:
            raise ValueError(f"unknown K-quant backend {self.backend!r}")
        self.register_buffer("qweight", pack(blocks, kind))  # both backends: one layout, one dequantize
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @staticmethod
    def fits(out_features: int, in_features: int) -> bool:
        return out_features % 4 == 0 and in_features % QK_K == 0

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.kind)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) dequantized: (n, in_features) float32, the file's values (for QuantEmbedding)."""
        w = dequantize(self.qweight[ids // 4], self.kind).view(len(ids), 4, -1)
        return w[torch.arange(len(ids)), ids % 4]

    def mm(self, x2d: torch.Tensor) -> torch.Tensor:
        return x2d @ self.dequantize().T

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, kind={self.kind}, bias={self.bias is not None}, "
                f"backend={self.backend}")
