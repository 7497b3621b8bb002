"""GGUF metadata on hostile values: every config and tokenizer key of real and tiny model files, replaced by values of
its own type that no model has (zero, negative, huge, NaN, empty, truncated or nested arrays) or by another type, or
left out. Each file either loads (the model with its GGUF weights, the tokenizer, which then encodes and decodes) or
fails with the one-line model-file error (or the unsupported-model one), never a traceback, a long loop or a huge
allocation. The container's own fields (counts, lengths, offsets) are mutated by test_gguf_file.py."""
import json
import math
import os
import shutil
import struct
import time

import gguf
import pytest

from fastdecode.errors import FastdecodeError
from fastdecode.loading import load_model, load_tokenizer
from tests.helpers.checkpoints import checkpoint

T = gguf.GGUFValueType
PACK = {T.UINT8: "<B", T.INT8: "<b", T.UINT16: "<H", T.INT16: "<h", T.UINT32: "<I", T.INT32: "<i", T.FLOAT32: "<f",
        T.BOOL: "<?", T.UINT64: "<Q", T.INT64: "<q", T.FLOAT64: "<d"}
INTEGERS = {T.UINT8, T.INT8, T.UINT16, T.INT16, T.UINT32, T.INT32, T.UINT64, T.INT64}


def value(vtype: T, v) -> bytes:
    """A metadata value as GGUF stores it: its type, then its bytes; v a list for arrays, as (element type, items)."""
    if vtype == T.STRING:
        return struct.pack("<I", T.STRING) + text(v)
    if vtype == T.ARRAY:
        etype, items = v
        return struct.pack("<IIQ", T.ARRAY, etype, len(items)) + b"".join(value(etype, i)[4:] for i in items)
    return struct.pack("<I", vtype) + struct.pack(PACK[vtype], v)


def text(s: str) -> bytes:
    return struct.pack("<Q", len(s.encode())) + s.encode()


def hostile(field) -> list[tuple[str, bytes | None]]:
    """(label, the field's new value bytes, or None: the key left out) for one metadata field."""
    vtype = field.types[0]
    out: list[tuple[str, bytes | None]] = [("left out", None), ("a string", value(T.STRING, "x")),
                                           ("uint32 7", value(T.UINT32, 7))]
    if vtype in INTEGERS:
        out += [(f"int {v}", value(t, v)) for t, v in [(T.UINT32, 0), (T.INT32, -1), (T.INT32, 2**31 - 1),
                                                       (T.UINT32, 2**32 - 1), (T.UINT64, 2**63 - 1)]]
        out.append(("float 2.5", value(T.FLOAT32, 2.5)))
    elif vtype in (T.FLOAT32, T.FLOAT64):
        out += [(f"float {v}", value(T.FLOAT32, v)) for v in (math.nan, math.inf, -math.inf, 0.0, -1.0, 3e38)]
    elif vtype == T.BOOL:
        out += [("bool flipped", value(T.BOOL, not field.parts[-1][0])), ("uint8 2", value(T.UINT8, 2))]
    elif vtype == T.STRING:
        out += [("empty", value(T.STRING, "")), ("NULs", value(T.STRING, "\0\0\0")),
                ("another word", value(T.STRING, "llama")), ("64 KiB", value(T.STRING, "{" * 65536))]
    elif vtype == T.ARRAY:
        etype = field.types[1]
        n = len(field.data)
        out += [("empty array", struct.pack("<IIQ", T.ARRAY, etype, 0)),
                ("one element", struct.pack("<IIQ", T.ARRAY, etype, 1) + element(field, 0)),
                ("an element short", struct.pack("<IIQ", T.ARRAY, etype, max(n - 1, 0))
                 + b"".join(element(field, i) for i in range(n - 1))),
                ("of uint32", value(T.ARRAY, (T.UINT32, [7] * n))),
                ("of strings", value(T.ARRAY, (T.STRING, ["x"] * n))),
                ("of arrays", struct.pack("<IIQ", T.ARRAY, T.ARRAY, n)
                 + n * (struct.pack("<IQ", T.INT32, 1) + struct.pack("<i", 5)))]
        if etype in INTEGERS:
            out.append(("elements -1", value(T.ARRAY, (T.INT32, [-1] * n))))
        if etype in (T.FLOAT32, T.FLOAT64):
            out.append(("elements NaN", value(T.ARRAY, (T.FLOAT32, [math.nan] * n))))
    return out


def element(field, i: int) -> bytes:
    """Element i of an array field, as stored (a string with its length)."""
    if field.types[1] == T.STRING:
        return text(bytes(field.parts[field.data[i]]).decode(errors="replace"))
    return field.parts[field.data[i]].tobytes()


def with_field(data: bytes, reader: gguf.GGUFReader, field, new: bytes | None) -> bytes:
    """The file `data` with one metadata field's value replaced by `new` (type and bytes), or the field left out. The
    tensor table and data are kept; the padding before the data is redone for the file's alignment."""
    start = field.offset
    end = start + sum(p.nbytes for p in field.parts)
    key_end = start + field.parts[0].nbytes + field.parts[1].nbytes  # the key's length and bytes
    kv_count = len([f for f in reader.fields.values() if not f.name.startswith("GGUF.")])
    header = bytearray(data[:24])
    if new is None:
        header[16:24] = struct.pack("<Q", kv_count - 1)
        middle = data[24:start] + data[end:table_end(reader)]
    else:
        middle = data[24:key_end] + new + data[end:table_end(reader)]
    alignment = reader.alignment
    out = bytes(header) + middle
    return out + b"\0" * (-len(out) % alignment) + data[reader.data_offset:]


def table_end(reader: gguf.GGUFReader) -> int:
    last = reader.tensors[-1].field
    return last.offset + sum(p.nbytes for p in last.parts)


def load_gguf(path, whole: bool):
    """The tokenizer, which then encodes and decodes; with `whole`, the model too (its GGUF formats, the default)."""
    tokenizer = load_tokenizer(path)
    tokenizer.decode(tokenizer.encode("hello world"))
    if whole:
        load_model(path, quant="gguf")


def loads_or_refuses(load, what: str, failures: list[str]) -> bool:
    """Runs load() -> whether it loaded. A one-line FastdecodeError is a clean refusal; any other exception, a message
    of several lines or more than 10 s goes into `failures`, named by `what`."""
    start, loaded = time.perf_counter(), False
    try:
        load()
        loaded = True
    except FastdecodeError as e:
        if "\n" in str(e):
            failures.append(f"{what}: a message of several lines: {e}")
    except Exception as e:  # noqa: BLE001 - the point: no other exception may come out
        first_line = str(e).partition("\n")[0]
        failures.append(f"{what}: {type(e).__name__}: {first_line}")
    if time.perf_counter() - start > 10:
        failures.append(f"{what}: {time.perf_counter() - start:.0f} s")
    return loaded


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen3", "tiny-gemma3", "tiny-qwen3_moe", "smollm2"])
def model_file(request):
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_path")
    return checkpoint(request.param.removeprefix("tiny-")).gguf_path


def test_every_hostile_metadata_value_loads_or_fails_with_a_model_file_error(model_file, tmp_path):
    """Tiny models: every key, loaded whole. A real model (SmolLM2's 49k-entry vocabulary and merges): its tokenizer
    keys, the tokenizer alone, from the file's header and a hole where its tensor data was."""
    reader = gguf.GGUFReader(model_file)
    whole = model_file.stat().st_size < 2**22
    with open(model_file, "rb") as f:
        data = f.read() if whole else f.read(reader.data_offset)
    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")
              and (whole or f.name.startswith("tokenizer."))]
    path = tmp_path / "mutated.gguf"
    tried, loaded, failures = 0, 0, []
    for field in fields:
        # The rewriting itself changes nothing when given the value as it was (so refusals below are the values').
        as_was = data[field.offset + field.parts[0].nbytes + field.parts[1].nbytes:
                      field.offset + sum(p.nbytes for p in field.parts)]
        assert with_field(data, reader, field, as_was) == data
        for label, new in hostile(field):
            path.write_bytes(with_field(data, reader, field, new))
            if not whole:  # the tensor data as a hole of zeros: the tokenizer reads none of it
                os.truncate(path, path.stat().st_size + model_file.stat().st_size - reader.data_offset)
            loaded += loads_or_refuses(lambda: load_gguf(path, whole), f"{field.name} {label}", failures)
            tried += 1
    assert not failures, "\n".join(failures)
    assert tried > 50 and 0 < loaded < tried  # values a model tolerates (a name, an empty merge list) load


# ---- config.json ---------------------------------------------------------------------------------------------------
HOSTILE_JSON = [None, 0, -1, 2**31 - 1, 2**64, 2.5, float("nan"), "x", True, [], [1, 2], {}, {"rope_type": 7}]


@pytest.mark.parametrize("name", ["llama", "gemma3_hf", "qwen3_moe_hf"])
def test_every_hostile_config_json_value_loads_or_fails_with_a_model_file_error(name, tmp_path):
    """The same for a Hugging Face directory's config.json: each key given each value of HOSTILE_JSON, or left out."""
    source = checkpoint(name).hf_dir
    config = json.loads((source / "config.json").read_text())
    folder = tmp_path / name
    shutil.copytree(source, folder)
    tried, loaded, failures = 0, 0, []
    for key in config:
        for label, v in [("left out", None), *((repr(v), v) for v in HOSTILE_JSON)]:
            changed = {k: w for k, w in config.items() if k != key or label != "left out"}
            if label != "left out":
                changed[key] = v
            (folder / "config.json").write_text(json.dumps(changed))
            loaded += loads_or_refuses(lambda: load_model(folder), f"{key} {label}", failures)
            tried += 1
    assert not failures, "\n".join(failures)
    assert 0 < loaded < tried
