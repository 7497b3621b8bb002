"""Bandwidth probe: how fast this machine reads memory with torch, at a large working set (DRAM) and at a given one.

A small model's weights (70-130 MB here) stay partly in the large L3, so its roofline is set by the bandwidth at
its own working-set size, not by DRAM. Reads are `x.sum()` over float32 tensors after one warm-up read; the figure
is the median of `repeats` timed reads. Machines are shared and noisy: compare figures measured side by side.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from fastdecode.loading.catalog import fastdecode_home


LARGE_BYTES = 1 << 30  # far beyond any L3: DRAM bandwidth
WORKING_SET_BYTES = 96 * 10**6  # SmolLM2-135M in Q4_1 reads ~97 MB per token
MIN_SAMPLE_BYTES = 32 * 10**6
CACHE_VERSION = 2  # 2: matmul_tflops has int8
MAX_AGE_S = 24 * 3600  # machines drift; a day-old probe is measured again
BUSY_MAX_AGE_S = 600  # a figure measured on a busy machine reads low: kept only until the next quiet moment


def _read_gb_s(size_bytes: int, repeats: int) -> dict:
    import torch

    x = torch.ones(max(size_bytes // 4, 1024), dtype=torch.float32)  # ones, not empty: fault the pages in now
    x.sum()  # warm-up: what fits in cache is now there, as it is for weights read every token
    reads = max(1, MIN_SAMPLE_BYTES // (x.numel() * 4))  # small sets: several reads per sample hide dispatch
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(reads):
            x.sum()
        samples.append(reads * x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return {"bytes": x.numel() * 4, "gb_s": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure_bandwidth(threads: int | None = None, size_bytes: int = WORKING_SET_BYTES, repeats: int = 9,
                      large_bytes: int = LARGE_BYTES) -> dict:
    """Read bandwidth in GB/s (1e9 bytes/s) at `large_bytes` (DRAM) and at the `size_bytes` working set."""
    from fastdecode.kernels.openmp import torch_threads  # torch only when measuring

    with torch_threads(threads) as n:
        large = _read_gb_s(large_bytes, repeats)
        working = _read_gb_s(size_bytes, repeats)
    return {"threads": n, "repeats": repeats, "bandwidth_gb_s": large["gb_s"], "working_set_gb_s": working["gb_s"],
            "large": large, "working_set": working, "busy": busy()}


def busy() -> str:
    """'load 3.4 on 2 CPUs' when other processes compete for the CPUs (the probe then reads low), else ''."""
    try:
        load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    except (OSError, AttributeError):
        return ""
    return f"load {load:.1f} on {cpus} CPUs" if load > cpus else ""


def measure_matmul(threads: int | None = None, n: int = 1024, repeats: int = 3) -> dict:
    """Peak matmul speed in TFLOPS (int8: tera-operations), float32, bfloat16 and int8 (F.linear of n x n by n x n;
    torch._int_mm, int8 in and int32 out, where this torch has it on the CPU; the best of `repeats`): the compute side
    of this machine, from the library GEMMs (oneDNN: AMX tiles where the CPU has them, else AVX-512 or AVX2). The
    quantized matmuls (int4, Q4_K, ...) multiply int8 activations by integer weights, so int8 is their ceiling. The
    best, not the median: a ceiling should not inherit a busy moment."""
    import torch

    from fastdecode.kernels.openmp import torch_threads

    def best_of(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return 2 * n**3 / best / 1e12

    result = {}
    with torch_threads(threads):
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            x, w = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            result[name] = best_of(lambda: torch.nn.functional.linear(x, w))
        a, b = (torch.randint(-128, 128, (n, n), dtype=torch.int8) for _ in range(2))
        try:
            result["int8"] = best_of(lambda: torch._int_mm(a, b))
        except (RuntimeError, AttributeError):  # a torch without the CPU kernel: no int8 figure
            pass
    result["kernels"] = measure_instruction_peaks(threads)
    return result


# The paths fastdecode's integer matmuls take, the fastest first: AMX tiles where permitted, else AVX-512 VNNI, else
# AVX2 (kernels/amx.cpp); instruction_peaks reports only the ones this build and CPU run.
INTEGER_PATHS = ("int8 amx", "int8 vnni", "int8 avx2")


def measure_instruction_peaks(threads: int | None = None, seconds: float = 0.2) -> dict:
    """T operations/s of each kernel path's inner instruction in registers (kernels/peak.cpp: 'fp32 fma',
    'int8 avx2' or 'int8 vnni', 'bf16 avx512', 'int8 amx'), over `threads` threads; {} without the native kernels."""
    from fastdecode.kernels import native_ops
    from fastdecode.kernels.openmp import torch_threads

    ops = native_ops()
    if ops is None:
        return {}
    with torch_threads(threads):
        return {k: v / 1e3 for k, v in ops.instruction_peaks(seconds).items()}


def float_peak(matmul_tflops: dict) -> tuple[float, str]:
    """The best float matmul measured (library GEMMs), TFLOPS, and which it is ('fp32' or 'bf16'); (0, '') if none."""
    floats = {k: matmul_tflops[k] for k in ("fp32", "bf16") if matmul_tflops.get(k)}
    best = max(floats, key=floats.get, default="")
    return floats.get(best, 0.0), best


def int8_peak(matmul_tflops: dict) -> tuple[float, str]:
    """The integer formats' compute ceiling, T operations/s, and where it comes from: the faster of the library's
    int8 GEMM (torch._int_mm) and the instruction peak of the path the integer kernels take on this machine. Not the
    library alone: without AVX-512 torch's int8 GEMM is a scalar loop (2 GOP/s on an AVX2 EPYC whose vpmaddubsw
    path makes 100 times that). (0, '') where neither was measured."""
    kernels = matmul_tflops.get("kernels") or {}
    path = next((p for p in INTEGER_PATHS if p in kernels), None)
    candidates = {"int8 GEMM (torch)": matmul_tflops.get("int8", 0.0)}
    if path:
        candidates[f"{path} instructions"] = kernels[path]
    source = max(candidates, key=candidates.get)
    return (candidates[source], source) if candidates[source] > 0 else (0.0, "")


def describe_peaks(matmul_tflops: dict) -> list[str]:
    """measure_matmul's result as lines for people: the library GEMMs, the kernel paths' instruction peaks, the
    integer formats' ceiling."""
    lines = ["library matmul (torch): " + ", ".join(
        f"{k} {matmul_tflops[k] * 1e3:,.0f} {'GOP/s' if k == 'int8' else 'GFLOPS'}" for k in ("fp32", "bf16", "int8")
        if k in matmul_tflops)]
    if matmul_tflops.get("kernels"):
        lines.append("kernel paths' instruction peaks (in registers): " + ", ".join(
            f"{k} {v * 1e3:,.0f} G{'OP' if k.startswith('int8') else 'FLOP'}/s"
            for k, v in matmul_tflops["kernels"].items()))
    peak, source = int8_peak(matmul_tflops)
    if peak:
        lines.append(f"integer formats' ceiling: {peak * 1e3:,.0f} GOP/s ({source})")
    return lines


def _machine_id() -> str:
    return f"{platform.node()}|{platform.processor() or platform.machine()}|{os.cpu_count()}"


def cached_probe(size_bytes: int, threads: int | None = None, home: Path | None = None,
                 refresh: bool = False) -> dict:
    """Bandwidth at `size_bytes` and at DRAM, plus matmul TFLOPS, from $FASTDECODE_HOME/probe.json when it holds a
    working set within 25% of `size_bytes` for this machine and thread count, measured within a day (within ten
    minutes when the machine was busy then); else measured and added to it."""
    path = (home or fastdecode_home()) / "probe.json"
    if not threads:
        import torch

        threads = torch.get_num_threads()
    entry = {} if refresh else _load(path).get(f"{_machine_id()}|{threads}") or {}
    entry.setdefault("working_sets", {})
    near = [int(b) for b in entry["working_sets"] if abs(int(b) - size_bytes) <= 0.25 * size_bytes]
    age = time.time() - entry.get("measured_unix", 0)
    fresh = age < (BUSY_MAX_AGE_S if entry.get("busy") else MAX_AGE_S)
    if near and fresh and "bandwidth_gb_s" in entry and "matmul_tflops" in entry:
        best = min(near, key=lambda b: abs(b - size_bytes))
        return {**entry, "working_set_bytes": best, "working_set_gb_s": entry["working_sets"][str(best)],
                "cached": True, "path": str(path)}
    measured = measure_bandwidth(threads, size_bytes)
    matmul = entry.get("matmul_tflops") if fresh else None
    entry = save_probe(measured, matmul or measure_matmul(threads), home, reset=refresh or not fresh)
    return {**entry, "working_set_bytes": measured["working_set"]["bytes"],
            "working_set_gb_s": measured["working_set_gb_s"], "cached": False, "path": str(path)}


def save_probe(measured: dict, matmul_tflops: dict, home: Path | None = None, reset: bool = True) -> dict:
    """Add a `measure_bandwidth` result (and matmul speeds) to $FASTDECODE_HOME/probe.json; returns the entry.
    reset drops the other working sets measured before, as a fresh `fastdecode probe` does."""
    path = (home or fastdecode_home()) / "probe.json"
    cache = _load(path)
    key = f"{_machine_id()}|{measured['threads']}"
    entry = {"working_sets": {}} if reset or key not in cache else cache[key]
    entry["working_sets"][str(measured["working_set"]["bytes"])] = measured["working_set_gb_s"]
    entry.update(bandwidth_gb_s=measured["bandwidth_gb_s"], matmul_tflops=matmul_tflops, busy=measured.get("busy", ""),
                 threads=measured["threads"], measured_unix=time.time(),
                 measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))
    cache[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=2))
    except OSError:
        pass  # a read-only home still gets the measurement, just not the cache
    return entry


def _load(path: Path) -> dict:
    try:
        cache = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"version": CACHE_VERSION}
    return cache if isinstance(cache, dict) and cache.get("version") == CACHE_VERSION else {"version": CACHE_VERSION}


def decode_ceiling(bytes_per_token: int, threads: int | None = None) -> dict:
    """One stream's decode roofline on this machine: the read bandwidth at a working set of `bytes_per_token`
    (cached_probe's) over those bytes."""
    bandwidth = cached_probe(bytes_per_token, threads)["working_set_gb_s"] * 1e9
    return {"decode_tok_s": bandwidth / bytes_per_token, "bandwidth_gb_s": bandwidth / 1e9,
            "bytes_per_token": bytes_per_token}
