"""The bandwidth probe, on tiny working sets, and its cache."""
import pytest

from fastdecode.roofline import probe


def test_measure_bandwidth_reports_both_working_sets():
    result = probe.measure_bandwidth(threads=1, size_bytes=1 << 20, repeats=3, large_bytes=4 << 20)
    assert result["threads"] == 1 and result["repeats"] == 3
    assert result["large"]["bytes"] == 4 << 20 and result["working_set"]["bytes"] == 1 << 20
    for part in (result["large"], result["working_set"]):
        assert 0 < part["min"] <= part["gb_s"] <= part["max"]
    assert result["bandwidth_gb_s"] == result["large"]["gb_s"]


def test_measure_matmul_reports_tflops_per_precision():
    result = probe.measure_matmul(threads=1, n=64, repeats=2)
    kernels = result.pop("kernels")
    # int8 (torch._int_mm) where this torch has the CPU kernel
    assert {"fp32", "bf16"} <= set(result) <= {"fp32", "bf16", "int8"} and all(v > 0 for v in result.values())
    assert kernels == {} or "fp32 fma" in kernels  # {} without the native kernels


def test_instruction_peaks_measure_the_kernel_paths_this_build_runs():
    from fastdecode.kernels import kernel_isa, native_ops

    if native_ops() is None:
        pytest.skip("no native kernels")
    one = probe.measure_instruction_peaks(threads=1, seconds=0.05)
    paths = {"avx2": {"fp32 fma", "int8 avx2"}, "avx512": {"fp32 fma", "int8 vnni"}}[kernel_isa()]
    assert paths <= set(one) <= paths | {"bf16 avx512", "int8 amx"}
    assert all(v > 0 for v in one.values())
    # 8 float lanes x 2 FLOPs at >= 1 GHz at least (an FMA a cycle), and not beyond 16 lanes x 2 FMA units at 6 GHz
    assert 0.016 <= one["fp32 fma"] <= 0.4
    assert one[next(p for p in probe.INTEGER_PATHS if p in one)] > one["fp32 fma"]  # int8 products outrun fp32's


def test_the_int8_ceiling_is_the_faster_of_the_library_gemm_and_the_kernels_path():
    avx2 = {"fp32": 0.06, "int8": 0.002, "kernels": {"fp32 fma": 0.06, "int8 avx2": 0.12}}
    assert probe.int8_peak(avx2) == (0.12, "int8 avx2 instructions")
    amx = {"int8": 3.0, "kernels": {"int8 vnni": 1.0, "int8 amx": 8.0}}  # the tiles, where the kernels take them
    assert probe.int8_peak(amx) == (8.0, "int8 amx instructions")
    assert probe.int8_peak({"int8": 0.5, "kernels": {"int8 vnni": 0.4}}) == (0.5, "int8 GEMM (torch)")
    assert probe.int8_peak({"int8": 0.5}) == (0.5, "int8 GEMM (torch)")  # a probe.json from before the kernel paths
    assert probe.int8_peak({"fp32": 0.1}) == (0.0, "")


def test_probe_is_cached_per_working_set(monkeypatch, tmp_path):
    calls = []

    def fake_bandwidth(threads, size_bytes):
        calls.append(size_bytes)
        return {"threads": threads, "bandwidth_gb_s": 25.0, "working_set_gb_s": 50.0,
                "working_set": {"bytes": size_bytes, "gb_s": 50.0}}

    monkeypatch.setattr(probe, "measure_bandwidth", fake_bandwidth)
    monkeypatch.setattr(probe, "measure_matmul", lambda threads: {"fp32": 0.2})
    first = probe.cached_probe(100_000_000, threads=2, home=tmp_path)
    again = probe.cached_probe(110_000_000, threads=2, home=tmp_path)  # within 25%: the cached figure
    other = probe.cached_probe(300_000_000, threads=2, home=tmp_path)  # a new working set: measured
    assert (first["cached"], again["cached"], other["cached"]) == (False, True, False)
    assert calls == [100_000_000, 300_000_000] and (tmp_path / "probe.json").is_file()
    assert probe.cached_probe(100_000_000, threads=2, home=tmp_path, refresh=True)["cached"] is False


def test_a_day_old_probe_is_measured_again(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(probe, "measure_bandwidth", lambda threads, size: calls.append(size) or {
        "threads": threads, "bandwidth_gb_s": 25.0, "working_set_gb_s": 50.0, "working_set": {"bytes": size}})
    monkeypatch.setattr(probe, "measure_matmul", lambda threads: {"fp32": 0.2})
    probe.cached_probe(10**8, threads=2, home=tmp_path)
    monkeypatch.setattr(probe.time, "time", lambda: 1e12)  # far in the future
    assert probe.cached_probe(10**8, threads=2, home=tmp_path)["cached"] is False and len(calls) == 2


def test_a_probe_measured_on_a_busy_machine_is_kept_only_minutes(monkeypatch, tmp_path):
    calls, now = [], [1e9]
    monkeypatch.setattr(probe, "measure_bandwidth", lambda threads, size: calls.append(size) or {
        "threads": threads, "bandwidth_gb_s": 10.0, "working_set_gb_s": 20.0, "working_set": {"bytes": size},
        "busy": "load 3.8 on 2 CPUs"})
    monkeypatch.setattr(probe, "measure_matmul", lambda threads: {"fp32": 0.2})
    monkeypatch.setattr(probe.time, "time", lambda: now[0])
    probe.cached_probe(10**8, threads=2, home=tmp_path)
    now[0] += 60
    assert probe.cached_probe(10**8, threads=2, home=tmp_path)["cached"] is True
    now[0] += probe.BUSY_MAX_AGE_S
    assert probe.cached_probe(10**8, threads=2, home=tmp_path)["cached"] is False and len(calls) == 2
