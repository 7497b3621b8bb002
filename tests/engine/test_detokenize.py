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
