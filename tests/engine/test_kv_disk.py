"""The prefix cache's disk tier: blocks written behind and read back bit for bit by another cache (a restarted
server), a file that is not exactly the block asked for a miss that removes it, several processes sharing one folder
under one cap without a torn read, and a disk that cannot be written one warning."""
import logging
import os
import stat
import subprocess
import sys
import textwrap

import pytest
import torch
from click.testing import CliRunner

from fastdecode.engine import kv_disk, kv_files
from fastdecode.engine.engine import Engine
from fastdecode.engine.kv_cache import BlockTable, KVCache
from fastdecode.engine.kv_disk import HEADER, DiskTier
from fastdecode.engine.kv_files import ModelIdentity
from fastdecode.engine.sampling import SamplingParams
from fastdecode.engine.scheduler import SchedulerConfig
from fastdecode.loading import load_model
from fastdecode.runners.native import NativeRunner
from tests.helpers.checkpoints import SPECS, checkpoint, prompt_tokens, single_thread
from tests.helpers.paged import paged, run
from tests.speculative.helpers import tiny_target

BS = 4
MODEL = ModelIdentity(b"m" * 16, {"model": "tiny.gguf", "quant": "gguf", "kv_dtype": "float16"})
OTHER_MODEL = ModelIdentity(b"o" * 16, {"model": "other.gguf"})


def cache(root, blocks: int = 8, model: ModelIdentity = MODEL, cap: int = 10**9) -> KVCache:
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=blocks, block_size=BS, dtype=torch.float16)
    kv.disk = DiskTier(model, kv.k, kv.v, BS, cap, root)
    return kv


def block_values(kv: KVCache, table: BlockTable, i: int) -> torch.Tensor:
    """Block i's keys and values in every layer: (2, layers, heads, BS, head_dim)."""
    s = slice(table.blocks[i] * BS, (table.blocks[i] + 1) * BS)
    return torch.stack([torch.stack([k[:, s] for k in kv.k]), torch.stack([v[:, s] for v in kv.v])])


def computed(kv: KVCache, tokens: list[int], salt: str = "", seed: int = 0) -> list[torch.Tensor]:
    """A sequence that computed `tokens` (random keys and values), committed them and let go; waits for the writer ->
    each full block's values."""
    table = BlockTable()
    kv.reserve(table, len(tokens))
    g = torch.Generator().manual_seed(seed)
    for t in (*kv.k, *kv.v):
        for slot in kv.slots(table, 0, len(tokens)):
            t[:, slot] = torch.randn(t.shape[0], t.shape[2], generator=g).half()
    kv.commit(table, tokens, len(tokens), salt)
    values = [block_values(kv, table, i).clone() for i in range(len(tokens) // BS)]
    kv.release(table)
    assert kv.disk.flush()
    return values


def block_file(kv: KVCache, tokens: list[int], i: int, salt: str = ""):
    return kv.disk.path(kv.prefix_hashes(tokens, salt)[i])


TOKENS = list(range(10, 24))  # three full blocks and two tokens


def test_blocks_written_by_one_cache_are_read_by_another_bit_for_bit(tmp_path):
    values = computed(cache(tmp_path), TOKENS)
    restarted = cache(tmp_path)
    restarted.free.reverse()  # other pool blocks than the writer's
    table = BlockTable()
    assert restarted.match_prefix(table, TOKENS + [99]) == 12 and table.from_disk == 3
    for i, want in enumerate(values):
        assert torch.equal(block_values(restarted, table, i), want)
    # Registered as if computed here: a second match finds them in memory.
    restarted.release(table)
    again = BlockTable()
    assert restarted.match_prefix(again, TOKENS) == 12 and again.from_disk == 0


def test_a_block_read_from_disk_is_not_written_again(tmp_path):
    computed(cache(tmp_path), TOKENS)
    restarted = cache(tmp_path)
    table = BlockTable()
    restarted.match_prefix(table, TOKENS)
    restarted.commit(table, TOKENS, 12)
    assert restarted.disk.flush() and restarted.disk.written == 0


def test_disk_blocks_are_shared_only_within_a_salt(tmp_path):
    computed(cache(tmp_path), TOKENS, salt="alice")
    assert cache(tmp_path).match_prefix(BlockTable(), TOKENS, salt="bob") == 0
    assert cache(tmp_path).match_prefix(BlockTable(), TOKENS, salt="alice") == 12


def test_a_model_never_reads_another_models_blocks(tmp_path):
    computed(cache(tmp_path), TOKENS)
    assert cache(tmp_path, model=OTHER_MODEL).match_prefix(BlockTable(), TOKENS) == 0


def flip(offset: int):
    def damage(path, kv):
        data = bytearray(path.read_bytes())
        data[offset] ^= 0x10
        path.write_bytes(bytes(data))
    return damage


def truncate(path, kv):
    path.write_bytes(path.read_bytes()[:-7])


def from_another_model(path, kv):
    """The same block's file, as another model wrote it, under this model's name."""
    other = cache(path.parent.parent / "elsewhere", model=OTHER_MODEL)
    computed(other, TOKENS)
    path.write_bytes(block_file(other, TOKENS, 1).read_bytes())


def from_another_salt(path, kv):
    """Another tenant's file for the same tokens, renamed to this tenant's key."""
    computed(kv, TOKENS, salt="mallory", seed=5)
    os.replace(block_file(kv, TOKENS, 1, salt="mallory"), path)


def deleted(path, kv):
    path.unlink()


@pytest.mark.parametrize("damage", [truncate, flip(HEADER.size + 4 * BS + 100), flip(HEADER.size + 2), flip(4),
                                    flip(HEADER.size - 1), from_another_model, from_another_salt, deleted],
                         ids=["truncated", "payload-bit", "token-id-bit", "format-bit", "checksum-bit",
                              "another-model", "another-salt", "deleted"])
def test_a_block_file_that_is_not_the_block_is_a_miss_and_is_removed(tmp_path, damage, caplog):
    values = computed(cache(tmp_path), TOKENS)
    kv = cache(tmp_path)
    path = block_file(kv, TOKENS, 1)
    damage(path, kv)
    free = kv.available
    table = BlockTable()
    with caplog.at_level(logging.WARNING):
        assert kv.match_prefix(table, TOKENS) == 4  # block 0 only: the chain stops at the bad block
    assert torch.equal(block_values(kv, table, 0), values[0])
    assert not path.exists()
    assert kv.available == free - 1 and kv.prefix_hashes(TOKENS)[1] not in kv.cached  # nothing kept of it


def test_the_cap_evicts_least_recently_used_files_and_a_prefix_end_before_its_start(tmp_path):
    kv = cache(tmp_path, blocks=16)
    file_bytes = kv.disk.file_bytes
    kv.disk.cap = 5 * file_bytes
    first, second = list(range(100, 112)), list(range(200, 212))  # three blocks each
    computed(kv, first)
    computed(kv, second)
    on_disk = [block_file(kv, first, i).exists() for i in range(3)]
    assert on_disk == [True, True, False]  # the first prompt's end went first
    assert all(block_file(kv, second, i).exists() for i in range(3))
    assert sum(size for _, size, _ in kv_files.block_files(tmp_path)) <= kv.disk.cap


def test_files_are_private_to_their_user(tmp_path):
    kv = cache(tmp_path / "kv")
    computed(kv, TOKENS)
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700
    assert stat.S_IMODE(kv.disk.folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(block_file(kv, TOKENS, 0).stat().st_mode) == 0o600


def test_a_disk_that_cannot_be_written_is_one_warning_and_the_cache_goes_on(tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(kv_disk.os, "writev", full)
    kv = cache(tmp_path, blocks=16)
    with caplog.at_level(logging.WARNING):
        computed(kv, TOKENS)
        computed(kv, list(range(50, 62)))
    warnings = [r for r in caplog.records if "no longer written" in r.getMessage()]
    assert len(warnings) == 1 and not kv.disk.writable
    assert not list(kv.disk.folder.glob("*.kv")) and not list(kv.disk.folder.glob(".*.tmp"))
    assert kv.match_prefix(BlockTable(), TOKENS) == 12  # the memory tier as before


def test_a_disk_without_its_reserve_takes_no_block(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kv_files, "disk_reserve", lambda path: 1 << 62)
    kv = cache(tmp_path)
    with caplog.at_level(logging.WARNING):
        computed(kv, TOKENS)
    assert not list(kv.disk.folder.glob("*.kv")) and any("no room" in r.getMessage() for r in caplog.records)


# ---- several processes ---------------------------------------------------------------------------------------------
WORKER = textwrap.dedent("""
    import random, sys, time
    from pathlib import Path
    import torch
    from fastdecode.engine.kv_cache import BlockTable, KVCache
    from fastdecode.engine.kv_disk import DiskTier, ModelIdentity

    root, me, cap_blocks, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    kv = KVCache(num_layers=2, num_kv_heads=2, head_dim=8, num_blocks=64, block_size=4, dtype=torch.float16)
    kv.disk = DiskTier(ModelIdentity(b"m" * 16, {}), kv.k, kv.v, 4, 0, Path(root))
    kv.disk.cap = cap_blocks * kv.disk.file_bytes

    def prompt(n):  # prompt n: 3 blocks, shared by both processes (the same n is the same tokens)
        return [1000 + 16 * n + i for i in range(12)]

    def expected(h):  # a block's values follow from its prefix hash, so a reader can check what it read
        g = torch.Generator().manual_seed(h % (1 << 62))
        return torch.randn(2, 2, 2, 4, 8, generator=g).half()

    rng, hits, deadline = random.Random(me), 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        tokens, table = prompt(rng.randrange(40)), BlockTable()
        got = kv.match_prefix(table, tokens)
        hashes = kv.prefix_hashes(tokens)
        for i in range(got // 4):
            s = slice(table.blocks[i] * 4, (table.blocks[i] + 1) * 4)
            read = torch.stack([torch.stack([k[:, s] for k in kv.k]), torch.stack([v[:, s] for v in kv.v])])
            if not torch.equal(read, expected(hashes[i])):
                sys.exit(f"torn or wrong block {i} of a prompt")
        hits += table.from_disk
        kv.reserve(table, 12)
        for i in range(got // 4, 3):
            s = slice(table.blocks[i] * 4, (table.blocks[i] + 1) * 4)
            values = expected(hashes[i])
            for layer in range(2):
                kv.k[layer][:, s], kv.v[layer][:, s] = values[0, layer], values[1, layer]
        kv.commit(table, tokens, 12)
        kv.release(table)
        kv.clear()  # the next match goes to the disk
    kv.disk.flush()
    print(hits, kv.disk.written)
""")


def test_two_processes_share_one_folder_under_one_cap_without_a_torn_read(tmp_path):
    cap_blocks = 30  # fewer than the 40 prompts' 120 blocks: both processes evict while the other reads
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path), str(me), str(cap_blocks), "4"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for me in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    for p, (out, errs) in zip(procs, results):
        assert p.returncode == 0, errs
    hits, written = zip(*(map(int, out.split()) for out, _ in results))
    assert min(hits) > 0 and min(written) > 0  # each read blocks from disk, the other's among them, and wrote some
    files = kv_files.block_files(tmp_path)
    file_bytes = files[0][1]
    assert len(files) <= cap_blocks
    with kv_files.Usage(tmp_path) as usage:
        assert usage.read() == len(files) * file_bytes
    assert not list(tmp_path.rglob("*.tmp"))


# ---- a model's logits ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama", "gemma3", "qwen3"])
def test_logits_after_a_disk_hit_equal_a_full_recompute_bit_for_bit(name, tmp_path):
    """The native runner on a float16 cache: a restarted cache reads the first blocks and computes the rest."""
    if name not in SPECS:
        pytest.skip(f"no {name} checkpoint")
    prompt = prompt_tokens(30)
    model = load_model(checkpoint(name).hf_dir)
    with single_thread():
        r, kv = paged(model, "native", dtype=torch.float16)
        kv.disk = DiskTier(MODEL, kv.k, kv.v, kv.block_size, 10**9, tmp_path)
        (whole,) = run(r, kv, [(first := BlockTable(), 0, prompt)])
        kv.commit(first, prompt, len(prompt))
        assert kv.disk.flush()
        r2, restarted = paged(model, "native", dtype=torch.float16)
        restarted.free.reverse()
        restarted.disk = DiskTier(MODEL, restarted.k, restarted.v, restarted.block_size, 10**9, tmp_path)
        second = BlockTable()
        hit = restarted.match_prefix(second, prompt, limit=len(prompt) - 1)
        assert hit == 24 and second.from_disk == 3
        (rest,) = run(r2, restarted, [(second, hit, prompt[hit:])])
    assert torch.equal(rest, whole[hit:])


# ---- the engine and the command line -------------------------------------------------------------------------------
def test_a_restarted_engine_answers_alike_with_the_prompt_read_from_disk(smollm2_path, tmp_path, monkeypatch):
    from fastdecode.engine.llm import LLM
    from fastdecode.engine.sampling import SamplingParams

    monkeypatch.setenv("FASTDECODE_KV_DIR", str(tmp_path))
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 12
    params = SamplingParams(max_tokens=12, temperature=0)
    answers = []
    for _ in range(2):  # a server, then the same server restarted
        llm = LLM(str(smollm2_path), threads=2, max_seq_len=1024, kv_disk_gb=1)
        answers.append(llm.generate(prompt, params))
        assert llm.kv.disk.flush()
        llm.close()
    cold, warm = answers
    assert cold.timings.disk_cached_tokens == 0
    assert warm.timings.disk_cached_tokens == warm.timings.cached_tokens >= len(cold.prompt_token_ids) - 32
    assert warm.token_ids == cold.token_ids
    assert LLM(str(smollm2_path), threads=2, max_seq_len=1024, kv_disk_gb=0).kv.disk is None


def test_the_cache_command_lists_and_clears_what_is_stored(tmp_path, monkeypatch):
    from fastdecode.cli import main

    monkeypatch.setenv("FASTDECODE_KV_DIR", str(tmp_path))
    computed(cache(tmp_path), TOKENS)
    listed = CliRunner().invoke(main, ["cache"], terminal_width=200)
    assert listed.exit_code == 0 and "tiny.gguf" in listed.output and MODEL.digest.hex()[:12] in listed.output
    cleared = CliRunner().invoke(main, ["cache", "clear"])
    assert cleared.exit_code == 0 and "removed 3 blocks" in cleared.output
    assert not kv_files.block_files(tmp_path)
    with kv_files.Usage(tmp_path) as usage:
        assert usage.read() == 0


def test_a_match_past_its_deadline_reads_one_block_from_disk_and_says_more_are_there(tmp_path):
    computed(cache(tmp_path), TOKENS)
    kv = cache(tmp_path)
    steps = []
    while True:  # as the scheduler does while others run: what was read stays cached for the next match
        table = BlockTable()
        got = kv.match_prefix(table, TOKENS, disk_deadline=0.0)
        steps.append((got, table.from_disk, table.disk_pending))
        kv.release(table)
        if not table.disk_pending:
            break
    assert steps == [(4, 1, True), (8, 1, True), (12, 1, False)]


def disk_engine(root) -> Engine:
    """The int4 tiny target on an engine (driven by pump()) whose float16 cache of 8-token blocks has a disk tier;
    while others run, its admissions read one block from disk a step (decode_gap_s 0)."""
    model, _ = tiny_target(max_seq_len=8)
    model.setup_rope(512)
    kv = KVCache.for_model(model.config, 64 * 8, torch.float16, block_size=8)
    kv.disk = DiskTier(MODEL, kv.k, kv.v, 8, 10**9, root)
    runner = NativeRunner.build(model, kv)
    if runner is None:
        pytest.skip("native kernels unavailable")
    return Engine(model, kv, runner, 512, SchedulerConfig(max_batched_tokens=64, decode_gap_s=0.0), background=False)


def test_a_prefix_read_from_disk_while_others_decode_takes_a_block_a_step_and_answers_alike(tmp_path):
    params = SamplingParams(max_tokens=24, temperature=0)
    long_prompt, short_prompt = [3 + i % 37 for i in range(97)], [5, 6, 7]
    first = disk_engine(tmp_path)
    alone = first.add_request(long_prompt, params)
    while first.pump():
        pass
    assert first.kv.disk.flush()
    restarted = disk_engine(tmp_path)
    decoding = restarted.add_request(short_prompt, params)
    restarted.pump()
    reading = restarted.add_request(long_prompt, params)
    steps = 0
    while not reading.table.blocks:  # its 12 blocks come one a step; the other sequence decodes meanwhile
        assert restarted.pump()
        steps += 1
    assert steps == 12 and decoding.num_output >= 12
    while restarted.pump():
        pass
    assert reading.timings.cached_tokens == reading.timings.disk_cached_tokens == 96
    assert reading.tokens == alone.tokens
