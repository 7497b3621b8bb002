"""Weight images (loading/weight_image.py): the first load of a GGUF packs its weights into a file that every later
load maps. The mapped model must be the packed one, module for module and byte for byte, on every layout the loader
builds; a corrupt, stale or unwritable image must never change what loads."""
import json
import logging
import os
import shutil
import threading
import time

import pytest
import torch
from gguf import GGMLQuantizationType as QType
from torch import nn

from fastdecode import LLM, SamplingParams, memory, private_files
from fastdecode.loading import image_checksums, weight_image
from fastdecode.loading.gguf_file import GGUFFile
from fastdecode.loading.gguf_native import load_gguf_native
from tests.helpers.checkpoints import (build_model, checkpoint, kquant_gguf, quantized_checkpoint, scratch_dir,
                                       write_gguf)
from tests.helpers.gpt_oss import gguf_checkpoint
from tests.helpers.tiny import logits

TOKENS = torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(0))
MIXED = {"attn_q": QType.Q4_0, "attn_k": QType.Q4_0, "attn_v": QType.Q4_0, "attn_output": QType.Q4_1,
         "ffn_down": QType.Q8_0, "ffn_gate": QType.Q4_1, "ffn_up": QType.Q5_0, "output": QType.Q8_0,
         "token_embd": QType.F16}  # q/k/v Q4_0 joined, gate/up of two types (requantized), a float embedding


def mixed_gguf():
    path = scratch_dir() / "image-llama-mixed.gguf"
    if not path.exists():
        write_gguf(build_model("llama"), path, "llama",
                   tensor_type=lambda name, ndim: QType.F32 if ndim == 1 else MIXED[name.split(".")[-2]])
    return path


FILES = {
    "mixed": mixed_gguf,
    "f32_llama3_rope": lambda: checkpoint("llama3_rope").gguf_path,  # float matrices, rope_freqs
    "gemma3": lambda: checkpoint("gemma3").gguf_path,  # norms stored as w - 1
    "q4_k_m": lambda: kquant_gguf("llama_k", {"attn_v": QType.Q6_K, "ffn_down": QType.Q6_K}),  # a two-part q/k/v
    "tied_q6_k": lambda: kquant_gguf("qwen2_k", {"token_embd": QType.Q6_K}),  # embedding rows read from lm_head
    "moe_q8_0": lambda: quantized_checkpoint("qwen3_moe").gguf_path,  # experts: views of one stack per layer
    "gpt_oss_mxfp4": lambda: gguf_checkpoint("MXFP4")[1],  # MXFP4 stacks with biases, attention sinks
}


@pytest.fixture
def images(tmp_path, monkeypatch):
    """Images on (the suite turns them off, conftest.py), kept in this test's folder."""
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE_GB", "50")
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE_DIR", str(tmp_path / "weights"))
    return tmp_path / "weights"


def committed():
    for t in threading.enumerate():
        if t.name == "weight-image":
            t.join()


def load(path, caplog) -> tuple[nn.Module, bool]:
    """-> the model, and whether it was mapped from an image."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fastdecode.loading"):
        model = load_gguf_native(path)
    committed()
    return model, any("mapped from the image" in r.message for r in caplog.records)


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Bit for bit, NaN included (an MXFP4 scale table has one)."""
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x.contiguous().view(torch.uint8),
                                                                     y.contiguous().view(torch.uint8))


def assert_same_model(a: nn.Module, b: nn.Module):
    assert [(n, type(m)) for n, m in a.named_modules()] == [(n, type(m)) for n, m in b.named_modules()]
    for (name, x), (_, y) in zip([*a.named_buffers(), *a.named_parameters()], [*b.named_buffers(),
                                                                               *b.named_parameters()]):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name
    for m, n in zip(a.modules(), b.modules()):
        plain = {k: v for k, v in m.__dict__.items() if k not in weight_image.MODULE_STATE}
        assert plain.keys() == {k for k in n.__dict__ if k not in weight_image.MODULE_STATE}
        for k, v in plain.items():
            assert same(v, n.__dict__[k]) if isinstance(v, torch.Tensor) else v == n.__dict__[k], k
    assert (a.rope_freq_factors is None) == (b.rope_freq_factors is None)
    assert torch.equal(logits(a, TOKENS), logits(b, TOKENS))


@pytest.mark.parametrize("min_bytes", [0, memory.MIN_BYTES], ids=["packed_into_the_file", "copied_in"])
@pytest.mark.parametrize("name", FILES)
def test_a_mapped_image_is_the_packed_model_module_for_module(name, min_bytes, images, monkeypatch, caplog):
    """min_bytes 0: every packing writes straight into the image (tiny models' weights are all below the size from
    which they otherwise do)."""
    monkeypatch.setattr(memory, "MIN_BYTES", min_bytes)
    path = FILES[name]()
    packed, mapped = load(path, caplog)
    assert not mapped and len(list(images.glob("*.json"))) == 1
    kept_log = [r.message for r in caplog.records if "gguf:" in r.message and "image" not in r.message]
    restored, mapped = load(path, caplog)
    assert mapped
    assert [r.message for r in caplog.records if "gguf:" in r.message and "image" not in r.message] == kept_log
    assert_same_model(packed, restored)
    if name == "tied_q6_k":  # one module, as the loader ties them
        assert restored.embed_tokens.table is restored.lm_head
    if name == "moe_q8_0":  # the experts still view one stack
        experts = restored.layers[0].mlp.experts
        assert experts[0].down_proj.qweight.untyped_storage().data_ptr() == \
            experts[1].down_proj.qweight.untyped_storage().data_ptr()


def test_the_native_step_decodes_the_same_tokens_from_an_image(smollm2_path, images):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = "def fibonacci(n):"
    outputs = []
    for _ in range(2):  # packs and writes, then maps
        llm = LLM(str(smollm2_path), max_seq_len=128, speculate="none")
        assert llm.decode_path == "native"
        outputs.append(llm.generate([prompt], params)[0].token_ids)
        llm.close()
        committed()
    assert len(list(images.glob("*.json"))) == 1
    assert outputs[0] == outputs[1]


def corrupt_manifest(images, edit):
    path = next(images.glob("*.json"))
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


CORRUPTIONS = {
    "a class outside fastdecode": lambda m: m["modules"]["lm_head"].update({"class": "os:system"}),
    "a storage past the end": lambda m: m["storages"][0].update({"offset": m["file_bytes"]}),
    "a negative storage index": lambda m: m["tensors"][0].update({"storage": -1}),
    "a view past its storage": lambda m: m["tensors"][0].update({"shape": [1 << 30]}),
    "an unknown dtype": lambda m: m["tensors"][0].update({"dtype": "object"}),
    "a module of another model": lambda m: m["modules"].pop("model.norm", m["modules"].pop("norm", None)),
    "a reference forward": lambda m: m["modules"].update({"lm_head": {"ref": "embed_tokens"}}),
    "another key": lambda m: m.update({"key": "0" * 32}),
    "a path as data": lambda m: m.update({"data": "../../etc/passwd"}),
    "no formats": lambda m: m.pop("formats"),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_manifest_loads_the_gguf_and_writes_a_new_image(corruption, images, caplog):
    path = FILES["q4_k_m"]()
    packed, _ = load(path, caplog)
    corrupt_manifest(images, CORRUPTIONS[corruption])
    reloaded, mapped = load(path, caplog)
    assert not mapped and any("weight image unusable" in r.message for r in caplog.records)
    assert_same_model(packed, reloaded)
    assert load(path, caplog)[1]  # the image written again maps


@pytest.mark.parametrize("damage", ["truncated", "not json"])
def test_damaged_files_load_the_gguf(damage, images, caplog):
    path = FILES["mixed"]()
    packed, _ = load(path, caplog)
    if damage == "truncated":
        data = next(images.glob("*.bin"))
        data.write_bytes(data.read_bytes()[:-4096])
    else:
        next(images.glob("*.json")).write_text("{")
    reloaded, mapped = load(path, caplog)
    assert not mapped
    assert_same_model(packed, reloaded)


def test_a_rewritten_gguf_is_loaded_again_and_its_old_image_removed(images, caplog, tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(build_model("llama"), path, "llama", tensor_type=lambda n, ndim: QType.F32 if ndim == 1 else QType.Q8_0)
    load(path, caplog)
    old = {p.name for p in images.iterdir()}
    write_gguf(build_model("qwen2"), path, "qwen2", tensor_type=lambda n, ndim: QType.F32 if ndim == 1 else QType.Q8_0)
    model, mapped = load(path, caplog)
    assert not mapped and model.config.family == "qwen2"
    assert not old & {p.name for p in images.iterdir()} and len(list(images.glob("*.json"))) == 1


def test_a_full_disk_or_a_zero_cap_leaves_no_image_and_loads(images, monkeypatch, caplog):
    path = FILES["mixed"]()
    monkeypatch.setattr(memory, "MIN_BYTES", 0)

    def no_space(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(weight_image.os, "posix_fallocate", no_space)
    packed, mapped = load(path, caplog)
    assert not mapped and not list(images.iterdir())
    monkeypatch.undo()
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE_DIR", str(images))
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE_GB", "0")
    again, mapped = load(path, caplog)
    assert not mapped and not list(images.iterdir())
    assert not any("not written" in r.message for r in caplog.records)  # images turned off: nothing to say
    assert_same_model(packed, again)


def test_a_disk_without_its_reserve_leaves_no_image_and_says_so(images, monkeypatch, caplog):
    path = FILES["mixed"]()
    monkeypatch.setattr(memory, "MIN_BYTES", 0)
    real = shutil.disk_usage  # a 100 GB disk with 4.5 GB free: under its 5 GB reserve once an image is on it
    monkeypatch.setattr(weight_image.shutil, "disk_usage", lambda p: real(p)._replace(total=100e9, free=4.5e9))
    model, mapped = load(path, caplog)
    assert not mapped and not list(images.glob("*.bin"))
    assert any("weight image not written" in r.message and "packs it again" in r.message for r in caplog.records)


def test_the_least_recently_used_image_goes_first_under_the_cap(images, monkeypatch, caplog):
    a, b, c = FILES["mixed"](), FILES["q4_k_m"](), FILES["tied_q6_k"]()
    load(a, caplog)
    load(b, caplog)
    time.sleep(0.05)  # past the file clock's tick (a few ms), which orders the images
    load(a, caplog)  # a is now the more recently used
    largest = max(p.stat().st_size for p in images.glob("*.bin"))
    need = sum(t.data.nbytes for t in GGUFFile(c).tensors.values())  # what the writer of c asks room for
    monkeypatch.setenv("FASTDECODE_WEIGHT_CACHE_GB", str((largest + need) / 1e9))  # room for one image beside c's
    load(c, caplog)
    assert load(a, caplog)[1] and not load(b, caplog)[1]


def test_a_failed_load_leaves_no_image(images, caplog, tmp_path):
    path = tmp_path / "short.gguf"
    write_gguf(build_model("llama"), path, "llama", skip=("blk.1.ffn_down.weight",))
    with pytest.raises(Exception, match="lacks"):
        load(path, caplog)
    assert not list(images.glob("*.bin")) and not list(images.glob("*.json"))


def test_a_second_load_before_the_first_image_commits_writes_its_own_file(images, monkeypatch, caplog):
    """Both models keep their own pages (a shared file truncated under a model would kill the process)."""
    monkeypatch.setattr(memory, "MIN_BYTES", 0)
    path = FILES["q4_k_m"]()
    with monkeypatch.context() as m:
        m.setattr(weight_image.ImageWriter, "commit", lambda self, manifest: None)  # the first never commits
        first, _ = load(path, caplog)
    second, mapped = load(path, caplog)
    assert not mapped and len(list(images.glob("*.bin"))) == 2
    assert_same_model(first, second)


# ---- the data checked against its checksums; the folder checked as the kernel cache's ----------------------------
def flip(images, spans=5, span=64 << 10):
    """Inverts `spans` runs of up to `span` bytes spread over the storages' data, as a failing disk or a stray write
    would (a write through the file system: the data file's seal breaks)."""
    manifest = json.loads(next(images.glob("*.json")).read_text())
    storages = sorted(manifest["storages"], key=lambda s: -s["nbytes"])[:spans]
    with open(images / manifest["data"], "r+b") as fh:
        for s in storages:
            fh.seek(s["offset"])
            data = fh.read(min(span, s["nbytes"]))
            fh.seek(s["offset"])
            fh.write(bytes(b ^ 0xFF for b in data))


def fresh(path, monkeypatch) -> nn.Module:
    """The model as a load without images builds it (the first load's own model maps the file it wrote: damage to the
    file reaches it too)."""
    with monkeypatch.context() as m:
        m.setenv("FASTDECODE_WEIGHT_CACHE_GB", "0")
        return load_gguf_native(path)


def image_warnings(caplog) -> list[str]:
    return [r.message for r in caplog.records if r.levelno == logging.WARNING and r.name == weight_image.__name__]


def test_flipped_bytes_in_the_data_are_found_and_the_gguf_packs_again(images, monkeypatch, caplog):
    monkeypatch.setattr(memory, "MIN_BYTES", 0)  # every storage in the file
    path = FILES["mixed"]()
    load(path, caplog)
    flip(images)
    reloaded, mapped = load(path, caplog)
    warnings = image_warnings(caplog)
    assert not mapped and len(warnings) == 1 and "its data changed since it was written" in warnings[0]
    assert_same_model(fresh(path, monkeypatch), reloaded)
    assert load(path, caplog)[1]  # the image packed again maps


def test_flipped_bytes_in_an_image_decode_the_same_tokens_as_a_fresh_load(smollm2_path, images, caplog):
    """The finding: 5 x 64 KB flipped in a `.bin` loaded "mapped from the image" and generated ''."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    for damage in (False, True):
        if damage:
            flip(images)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="fastdecode.loading"):
            llm = LLM(str(smollm2_path), max_seq_len=128, speculate="none")
        outputs.append(llm.generate(["def fibonacci(n):"], params)[0].token_ids)
        llm.close()
        committed()
    assert not any("mapped from the image" in r.message for r in caplog.records)
    assert any("weight image unusable" in r.message for r in caplog.records)
    assert outputs[0] == outputs[1]


def test_damage_that_breaks_no_seal_is_found_by_the_sampled_check(images, monkeypatch, caplog):
    """Damage beneath the file system changes no time: only a load's sampled chunks find it (here all of them)."""
    monkeypatch.setattr(memory, "MIN_BYTES", 0)
    monkeypatch.setattr(image_checksums, "SAMPLED", 1 << 30)
    path = FILES["mixed"]()
    load(path, caplog)
    flip(images, spans=1, span=16)
    data = next(images.glob("*.bin"))
    corrupt_manifest(images, lambda m: m.update({"seal": image_checksums.seal(data.stat())}))
    reloaded, mapped = load(path, caplog)
    assert not mapped and any("its data changed" in r.message for r in caplog.records)
    assert_same_model(fresh(path, monkeypatch), reloaded)


def test_a_file_that_changed_only_its_times_is_checked_in_full_once_and_maps(images, caplog):
    path = FILES["mixed"]()
    load(path, caplog)
    data = next(images.glob("*.bin"))
    os.utime(data)  # a touch, a copy with its times kept: the seal breaks, the bytes are the same
    assert load(path, caplog)[1] and any("checked in full" in r.message for r in caplog.records)
    assert json.loads(next(images.glob("*.json")).read_text())["seal"] == image_checksums.seal(data.stat())
    assert load(path, caplog)[1] and not any("checked in full" in r.message for r in caplog.records)


FOLDERS = {
    "open to all (0777)": lambda images: images.chmod(0o777),
    "group-writable": lambda images: images.chmod(0o770),
    "a home writable by everyone": lambda images: images.parent.chmod(0o777),
    "another user's": lambda images: os.chown(images, os.getuid() + 4321, -1),
}


@pytest.mark.parametrize("folder", FOLDERS)
def test_an_image_folder_others_can_write_is_neither_mapped_nor_written(folder, images, monkeypatch, caplog):
    """Whoever can write in the folder chooses the weights: it is refused as the kernel cache's is."""
    path = FILES["mixed"]()
    packed, _ = load(path, caplog)
    before = {p.name for p in images.iterdir()}
    if folder == "another user's" and os.getuid() != 0:  # only root can give a folder away: seem to be another user
        monkeypatch.setattr(private_files.os, "getuid", lambda: os.getuid() + 4321)
    else:
        FOLDERS[folder](images)
    reloaded, mapped = load(path, caplog)
    warnings = image_warnings(caplog)
    assert not mapped and len(warnings) == 1 and "not writable by others" in warnings[0]
    assert {p.name for p in images.iterdir()} == before  # nothing written or removed there either
    assert_same_model(packed, reloaded)


def test_a_new_image_folder_is_private(images, caplog):
    load(FILES["mixed"](), caplog)
    assert images.stat().st_mode & 0o777 == 0o700
