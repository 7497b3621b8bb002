import random
import sys

import pytest

from fastdecode.engine.detokenize import IncrementalDetokenizer
from fastdecode.loading import load_tokenizer

TEXTS = [
    "def f(x):\n    return x  # ok\n",
    "naïve café — 東京タワー 🚀🚀 ok",
    "emoji family 👨‍👩‍👧 and flags 🇫🇷",
    "tabs\t\tand   spaces   \n\n\nend",
]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def tokenizer(request):
    return load_tokenizer(request.getfixturevalue(f"{request.param}_path"))


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_join_to_full_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, prompt, stop=[])
    deltas = [d.add(t) for t in ids] + [d.flush()]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in x for x in deltas)  # never half a UTF-8 character


def test_stop_string_truncates_and_never_leaks(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    out = ""
    for t in ids:
        out += d.add(t)
        if d.stopped:
            break
    assert d.stopped and out == "alpha beta " and d.text == "alpha beta "


def test_held_back_prefix_is_released_when_no_stop_follows(tokenizer):
    ids = tokenizer.encode("value ST", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [], stop=["STOP"])
    out = "".join(d.add(t) for t in ids)
    assert not out.endswith("ST")  # could still become STOP
    assert out + d.flush() == "value ST"


class CharTokenizer:
    """Token id i is the character chr(i): stop matching without a real vocabulary."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def reference_stop(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string to end in it (the longest of those ending there), by brute force."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stop if text[:end].endswith(s)]
        if ending:
            return text[:end - max(map(len, ending))], True
    return text, False


@pytest.mark.parametrize("seed", range(200))
def test_stop_matching_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    stop = ["".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
    text = "".join(rng.choices("abc", k=rng.randint(0, 30)))
    d = IncrementalDetokenizer(CharTokenizer(), [], stop)
    out = ""
    for ch in text:
        out += d.add(ord(ch))
        # Held back: exactly the longest tail that could still grow into a stop string.
        held = max((k for s in stop for k in range(1, len(s)) if d.text.endswith(s[:k])), default=0)
        assert d.stopped or len(out) == len(d.text) - held
        if d.stopped:
            break
    expected, stopped = reference_stop(text, stop)
    assert (d.stopped, out if stopped else out + d.flush()) == (stopped, expected)


def test_stop_matching_work_per_token_does_not_grow_with_the_stop_strings_length():
    """16 stop strings whose starts the output keeps matching; work counted in calls (Python and builtin, as the
    profiler sees them), the same for strings of 100 or 4,000 characters: no prefix is compared per token."""
    def calls(length: int) -> int:
        d = IncrementalDetokenizer(CharTokenizer(), [], ["a" * (length - 1) + chr(ord("b") + i) for i in range(16)])
        count = 0

        def profile(frame, event, arg):
            nonlocal count
            count += 1
        sys.setprofile(profile)
        try:
            out = "".join(d.add(ord("a")) for _ in range(300))
        finally:
            sys.setprofile(None)
        assert out == "" and d.flush() == "a" * 300
        return count
    assert calls(4000) == calls(400)


def test_kept_special_tokens_stay_in_the_text_and_others_are_skipped():
    from fastdecode.loading.tokenizer import Tokenizer
    from tests.helpers.chat_models import byte_tokenizer

    tokenizer = Tokenizer(byte_tokenizer(), None, [])
    ids = tokenizer.encode('<|im_start|>a[TOOL_CALLS]f[ARGS]{"x": 1}', add_special_tokens=False)
    keep = [tokenizer.backend.token_to_id(t) for t in ("[TOOL_CALLS]", "[ARGS]")]
    d = IncrementalDetokenizer(tokenizer, [], stop=[], keep=keep)
    assert "".join(d.add(t) for t in ids) + d.flush() == 'a[TOOL_CALLS]f[ARGS]{"x": 1}'
    plain = IncrementalDetokenizer(tokenizer, [], stop=[])
    assert "".join(plain.add(t) for t in ids) + plain.flush() == 'af{"x": 1}'
