"""The stdlib corpus: fixed windows from files spread over the sorted list, the same on every call."""
import pytest

from fastdecode.eval.corpus import corpus_windows, stdlib_files


def encode(text: str) -> list[int]:
    return list(text.encode())  # bytes as tokens: enough to pin the window arithmetic


def test_stdlib_files_are_sorted_python_sources():
    files = stdlib_files()
    assert len(files) > 50 and files == sorted(files) and all(f.suffix == ".py" for f in files)


def test_windows_come_from_the_middle_of_evenly_spaced_files(tmp_path):
    files = []
    for i in range(8):
        files.append(tmp_path / f"m{i}.py")
        files[-1].write_text("#" * 10 + f"middle of file {i}".ljust(20, ".") + "#" * 10)  # 20 in the middle of 40
    windows, names = corpus_windows(encode, 4, 20, files)
    assert names == ["m0.py", "m2.py", "m4.py", "m6.py"]  # 8 files, 4 windows: every second one
    assert windows.shape == (4, 20) and windows[1].tolist() == encode("middle of file 2....")


def test_a_file_shorter_than_a_window_gives_way_to_the_next(tmp_path):
    for name, size in [("a.py", 5), ("b.py", 30), ("c.py", 30), ("d.py", 30)]:
        (tmp_path / name).write_text("y" * size)
    _, names = corpus_windows(encode, 2, 20, sorted(tmp_path.glob("*.py")))
    assert names == ["b.py", "c.py"]


def test_too_small_a_corpus_is_an_error(tmp_path):
    (tmp_path / "a.py").write_text("z" * 30)
    with pytest.raises(ValueError, match="only 1"):
        corpus_windows(encode, 2, 20, [tmp_path / "a.py"])


def test_real_corpus_is_deterministic():
    a, names_a = corpus_windows(encode, 4, 256)
    b, names_b = corpus_windows(encode, 4, 256)
    assert names_a == names_b and a.equal(b) and len(set(names_a)) == 4
