"""The GGUF container parser on hostile input: every malformed header fails with the one-line model-file error (or
the unsupported-model one), never a traceback, a long loop or a huge allocation."""
import math
import random
import shutil
import struct
import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES

from fastdecode.errors import FastdecodeError, ModelFileError
from fastdecode.loading import load_model
from fastdecode.loading.gguf_file import GGUFFile, forget_parsed, read_gguf
from tests.helpers.checkpoints import checkpoint

U32, STRING, ARRAY = 4, 8, 9


def string(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def gguf_bytes(metadata: list[tuple[str, int, bytes]], tensors: list[tuple[str, list[int], int, int]],
               data_size: int = 64) -> bytes:
    """A GGUF v3 file: metadata as (key, value type, packed value), tensors as (name, GGUF dims, type, offset)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, vtype, value in metadata:
        out += string(key) + struct.pack("<I", vtype) + value
    for name, dims, ttype, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", ttype, offset)
    return out + b"\0" * (-len(out) % 32) + b"\0" * data_size


def parse(tmp_path, content: bytes):
    path = tmp_path / "model.gguf"
    path.write_bytes(content)
    return GGUFFile(path)


F32 = 0
ONE_TENSOR = [("w", [4, 2], F32, 0)]


def test_a_well_formed_file_parses(tmp_path):
    f = parse(tmp_path, gguf_bytes([("general.alignment", U32, struct.pack("<I", 32))], ONE_TENSOR))
    assert f.tensors["w"].shape == (2, 4) and f.tensors["w"].data.nbytes == 32


def test_read_gguf_parses_a_file_once_and_again_once_it_changes(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(gguf_bytes([("general.alignment", U32, struct.pack("<I", 32))], ONE_TENSOR))
    first = read_gguf(path)
    assert read_gguf(path) is first and read_gguf(tmp_path / "." / "model.gguf") is first
    path.write_bytes(gguf_bytes([("general.alignment", U32, struct.pack("<I", 64))], ONE_TENSOR))  # rewritten
    assert read_gguf(path).metadata["general.alignment"] == 64
    kept = read_gguf(path)
    forget_parsed()
    assert read_gguf(path) is not kept
    with pytest.raises(ModelFileError, match="cannot read GGUF file"):
        read_gguf(tmp_path / "missing.gguf")


@pytest.mark.parametrize("alignment", [0, 3, 2**31 + 1])
def test_alignment_that_is_not_a_power_of_two_is_a_model_file_error(tmp_path, alignment):
    with pytest.raises(ModelFileError, match="alignment"):
        parse(tmp_path, gguf_bytes([("general.alignment", U32, struct.pack("<I", alignment))], ONE_TENSOR))


def test_deeply_nested_metadata_arrays_are_a_model_file_error(tmp_path):
    nested = struct.pack("<IQ", ARRAY, 1) * 100_000 + struct.pack("<IQ", U32, 0)
    with pytest.raises(ModelFileError, match="nested"):
        parse(tmp_path, gguf_bytes([("x", ARRAY, nested)], []))


def test_a_tensor_whose_size_overflows_64_bits_is_a_model_file_error(tmp_path):
    """2^32 x 2^32 float32 elements: np.prod wraps to 0 bytes, which fits any file."""
    with pytest.raises(ModelFileError, match="outside"):
        parse(tmp_path, gguf_bytes([], [("w", [2**32, 2**32], F32, 0)]))


@pytest.mark.parametrize("offset", [2**63, 64, 4], ids=["huge", "past-the-end", "unaligned"])
def test_a_tensor_offset_outside_the_aligned_data_is_a_model_file_error(tmp_path, offset):
    with pytest.raises(ModelFileError, match="outside"):
        parse(tmp_path, gguf_bytes([], [("w", [4, 2], F32, offset)]))


@pytest.mark.parametrize("tensors", [[("w", [1] * 5, F32, 0)], ONE_TENSOR * 2, [("q", [31, 1], 8, 0)]],
                         ids=["five-dims", "twice", "partial-block"])
def test_malformed_tensor_table_is_a_model_file_error(tmp_path, tensors):
    with pytest.raises(ModelFileError):
        parse(tmp_path, gguf_bytes([], tensors))


def test_an_array_longer_than_any_model_needs_fails_before_reading_it(tmp_path):
    with pytest.raises(ModelFileError, match="array elements"):
        parse(tmp_path, gguf_bytes([("x", ARRAY, struct.pack("<IQ", U32, 2**40))], []))


# ---- mutations of real files -------------------------------------------------------------------------------------
EXTREMES = {"<Q": [0, 1, 2**32, 2**63, 2**64 - 1], "<I": [0, 1, 3, 2**31, 2**32 - 1]}


def mutate(header: bytes, fields: list[np.ndarray], rng: random.Random) -> bytearray:
    """One or two changes: a bit flipped anywhere, or a count, size, offset or type (a field holding a small number,
    in the whole header or in the tensor table) set to an extreme 4- or 8-byte value."""
    header = bytearray(header)
    for _ in range(rng.randint(1, 2)):
        if rng.random() < 0.2:
            header[rng.randrange(4, len(header))] ^= 1 << rng.randrange(8)
        else:
            fmt, some = rng.choice(["<Q", "<I"]), rng.choice(fields)
            at = int(some[rng.randrange(len(some))])
            header[at:at + struct.calcsize(fmt)] = struct.pack(fmt, rng.choice(EXTREMES[fmt]))
    return header


def small_number_fields(header: bytes) -> np.ndarray:
    """Offsets at which 8 little-endian bytes read as a number in [1, 2^32): counts, lengths, dims, offsets."""
    words = np.ndarray((len(header) - 7,), dtype="<u8", buffer=header, strides=(1,))
    return np.nonzero((words > 0) & (words < 2**32))[0]


@pytest.fixture(scope="module", params=["handmade", "tiny-llama", "tiny-gemma3", "smollm2"])
def model_file(request, tmp_path_factory):
    if request.param.startswith("tiny-"):
        return checkpoint(request.param.removeprefix("tiny-")).gguf_path
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_path")
    path = tmp_path_factory.mktemp("gguf") / "handmade.gguf"
    path.write_bytes(gguf_bytes([("general.alignment", U32, struct.pack("<I", 32)), ("tokens", ARRAY, struct.pack(
        "<IQ", STRING, 2) + string("a") + string("b"))], [("w", [4, 2], F32, 0), ("q", [32, 2], 8, 32)], 128))
    return path


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # mutated scales dequantize to NaN
def test_every_mutated_header_parses_or_fails_with_a_model_file_error(model_file, tmp_path):
    """Mutations of the header (tensor data kept): each parse ends in well under 10 s with a one-line typed error,
    or with a tensor table whose every tensor holds exactly the bytes its shape and type need. The tiny models are
    loaded whole too (config, dequantization, the built model), with the same outcome: a model or that error."""
    f = GGUFFile(model_file)
    size = f.pos  # where the tensor table ends
    path = tmp_path / "mutated.gguf"
    shutil.copyfile(model_file, path)
    original = path.read_bytes()[:size]
    fields = small_number_fields(original)
    table = fields[fields >= size - 64 * len(f.tensors)]  # about where the tensor table lies
    rng = random.Random(0)
    for _ in range(40 if size > 2**20 else 300):
        with open(path, "r+b") as out:
            out.write(mutate(original, [fields, table], rng))
        start = time.perf_counter()
        try:
            f = GGUFFile(path)
            if size < 2**20:  # a tiny model: cheap to load whole
                load_model(path)
        except FastdecodeError as e:
            assert "\n" not in str(e)
        else:
            for t in f.tensors.values():
                block, type_size = GGML_QUANT_SIZES[t.type]
                assert t.data.nbytes == math.prod(t.shape) // block * type_size, t.name
        assert time.perf_counter() - start < 10
