"""Packing's byte moves: the native strided copy and numpy's agree with torch's copy on every kind of view a packer
makes, and the shard arena joins as torch.cat does without letting a module keep a view of it."""
import pytest
import torch
from torch import nn

from fastdecode.kernels import native_ops
from fastdecode.quant import repack
from fastdecode.quant.repack import ShardArena, move

# (shape, permutation of the source, slice of the last axis, dtype): transposed tiles, runs of 2/4/16/32 bytes and of
# odd sizes, a lone element, a size-1 axis between strided ones, a view of every other element.
VIEWS = [((7, 5, 3), (2, 0, 1), None, torch.uint8),
         ((6, 4, 2, 16), (0, 2, 1, 3), None, torch.uint8),
         ((64, 33), (1, 0), None, torch.float16),
         ((8, 9, 18), (0, 1, 2), slice(2, 18), torch.uint8),
         ((8, 9, 18), (1, 0, 2), slice(0, 2), torch.uint8),
         ((1, 9, 1, 4), (3, 1, 2, 0), None, torch.int64),
         ((5, 12), (0, 1), slice(None, None, 2), torch.int32),
         ((3,), (0,), None, torch.float32),
         ((0, 4), (1, 0), None, torch.uint8)]


def source(shape, perm, last, dtype):
    t = torch.randint(0, 120, shape, generator=torch.Generator().manual_seed(len(shape))).to(dtype).permute(perm)
    return t if last is None else t[..., last]


@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
@pytest.mark.parametrize("view", VIEWS, ids=range(len(VIEWS)))
def test_move_copies_any_view(monkeypatch, native, view):
    if native and native_ops() is None:
        pytest.skip("no native kernels")
    if not native:
        monkeypatch.setattr(repack, "native_ops", lambda: None)
    src = source(*view)
    into_plain = torch.full(src.shape, 7, dtype=src.dtype)
    assert torch.equal(move(into_plain, src), src)
    # into a strided view too, leaving the bytes between its elements alone
    wide = torch.full((*src.shape[:-1], 2 * src.shape[-1]) if src.dim() else (), 7, dtype=src.dtype)
    into_strided = wide[..., ::2] if src.dim() else wide
    move(into_strided, src)
    assert torch.equal(into_strided, src)
    if src.dim() and src.numel():
        assert (wide[..., 1::2] == 7).all()


def test_move_refuses_mismatched_tensors():
    with pytest.raises(ValueError):
        move(torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))


def test_arena_joins_as_cat_and_modules_keep_no_view_of_it():
    parts = [{"q": torch.randint(-100, 100, (n, 3, 32), dtype=torch.int8), "d": torch.rand(n, 3).half()}
             for n in (8, 4, 12)]
    arena = ShardArena()
    joined = arena.join(parts)
    for k in ("q", "d"):
        assert torch.equal(joined[k], torch.cat([p[k] for p in parts]))
    assert arena.join(parts[:1]) is parts[0]  # one part: nothing to join

    module = nn.Module()
    module.register_buffer("scales", joined["d"])  # as a backend that keeps its input would
    module.register_buffer("own", joined["d"].clone())
    arena.release(module)
    kept = module.scales.clone()
    arena.join([{k: torch.zeros_like(v) for k, v in p.items()} for p in parts])  # the next module's shards
    assert torch.equal(module.scales, kept) and module.scales.abs().sum() > 0
    assert module.own.data_ptr() != module.scales.data_ptr()
