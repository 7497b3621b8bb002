"""Times weight-only quantized matmul kernels at SmolLM2-135M shapes; prints a table, writes bench/results/kernels.json.
(Not named kernels.py: the bench scripts' folder comes first on sys.path, and transformers imports Hugging Face's
`kernels` package, which a bench/kernels.py shadowed: bench/decode.py's transformers rows were skipped.)

    python bench/matmuls.py                 # M = 1, 8, 600 and the per-token totals
    python bench/matmuls.py --ms 1 --reps 5 # quicker
    python bench/matmuls.py --threads 1     # on a busy shared machine: with more runnable threads than cores, a
                                            # 2-thread op can wait out another process's time slice (~8 ms)
    python bench/matmuls.py --only native_int4_g32,native_int8 --baseline ba4a3e5 --ms 1,2,4,9,16
                                            # our kernels beside those of a git revision, taking turns

Each shape uses as many distinct weight copies as the model has layers (30), called in turn, so the working set is
the model's and the weights are not served from cache more than in a real decode. Candidates are interleaved in
every round and the table shows the median over rounds. GB/s counts the bytes of the weights and their scales.

Kernels: fp32 / bf16 F.linear; int8pack_mm (aten, per-channel int8, float activations); int8_dyn_fbgemm (quantized
linear_dynamic: per-channel int8, activations quantized per tensor); int8_int_mm (torch._int_mm plus aten ops that
quantize each activation row); int4pack_gG (aten _weight_int4pack_mm_for_cpu, groups of G); native_int8 (ours:
weight-only int8 with fp16 scales and offsets per 32-block, float activations), native_q8_0 (ours: a GGUF Q8_0
tensor's pair tiles) and native_int4_g32 (ours: like Q4_1), both with activations quantized to int8 per 32-block.
aten's _dyn_quant_matmul_4bit is left out: without KleidiAI (x86) it runs a scalar reference kernel, ~15 ms for one
3072x576 matmul.
"""
import argparse
import json
import statistics
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from common import native_kernels_at
from fastdecode.quant import int4, int8

# name: (out_features, in_features, copies per token)
SHAPES = {"qkv": (960, 576, 30), "o": (576, 576, 30), "gate_up": (3072, 576, 30), "down": (576, 1536, 30),
          "lm_head": (49152, 576, 1)}


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


# Each maker takes a float weight (N, K) and returns (fn(x) -> y, bytes read per call), or None if it cannot
# take that shape.
def fp32(w):
    return (lambda x: F.linear(x, w)), nbytes(w)


def bf16(w):
    wb = w.bfloat16()
    return (lambda x: F.linear(x.bfloat16(), wb)), nbytes(wb)


def int8pack(w):
    q, s = int8.quantize_per_channel(w)
    return (lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)), nbytes(q, s)


def int4pack(group_size):
    def make(w):
        if w.shape[1] % group_size:
            return None
        packed, sz = int4.pack_for_aten(*int4.quantize_groupwise(w, group_size))
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, sz)), nbytes(packed, sz)
    return make


def dynamic_int8_fbgemm(w):
    # int8 weights, activations quantized per tensor on the fly (fbgemm through the x86 quantized engine).
    q, s = int8.quantize_per_channel(w)
    with warnings.catch_warnings():  # quantized tensors are deprecated; the kernel is what we measure
        warnings.simplefilter("ignore")
        qw = torch._make_per_channel_quantized_tensor(q, s.double(), torch.zeros_like(s, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    return (lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)), nbytes(q, s)


def int_mm(w):
    # torch._int_mm with per-row dynamic activation quantization written in aten ops.
    q, s = int8.quantize_per_channel(w)
    qt = q.t()

    def fn(x):
        xs = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
        return torch._int_mm((x / xs).round().to(torch.int8), qt) * xs * s
    return fn, nbytes(q, s)


def module(cls, **kw):
    def make(w):
        m = cls.from_weight(w, None, **kw)
        return m, m.weight_bytes()
    return make


def q8_0_module(w):
    """w as a GGUF's Q8_0 tensor loads (int8 values, fp16 scale per 32, no offsets): pair tiles, int8 activations."""
    g = w.reshape(w.shape[0], -1, 32)
    d = (g.abs().amax(-1) / 127).half()
    q = (g / d.float().clamp(min=1e-12)[..., None]).round().clamp(-127, 127).to(torch.int8)
    return int8.Int8Linear.from_tensors({"qweight": q, "scales": d}, None, "native")


def q8_0(w):
    m = q8_0_module(w)
    return m, m.weight_bytes()


def baseline_q8_0(ops):
    def make(w):
        m = q8_0_module(w)
        return (lambda x: getattr(ops, m.native_op)(x, m.qweight, m.bias)), m.weight_bytes()
    return make


def baseline_op(cls, ops, **kw):
    """The module's packed weights through another build's op (see --baseline)."""
    def make(w):
        m = cls.from_weight(w, None, **kw)
        return (lambda x: getattr(ops, m.native_op)(x, m.qweight, m.bias)), m.weight_bytes()
    return make


def candidates(baseline: str = ""):
    c = {"fp32": fp32, "bf16": bf16, "int8pack_mm": int8pack, "int8_dyn_fbgemm": dynamic_int8_fbgemm,
         "int8_int_mm": int_mm}
    for g in (32, 64, 128):
        c[f"int4pack_g{g}"] = int4pack(g)
    if int8.native_fits(4, 32):  # our AVX2 kernels, through the modules quantize_model installs
        c["native_int8"] = module(int8.Int8Linear, backend="native")
        c["native_q8_0"] = q8_0
        c["native_int4_g32"] = module(int4.Int4Linear, backend="native", group_size=32)
        if baseline:
            ops = native_kernels_at(baseline)
            c[f"native_int8@{baseline}"] = baseline_op(int8.Int8Linear, ops, backend="native")
            c[f"native_int4_g32@{baseline}"] = baseline_op(int4.Int4Linear, ops, backend="native", group_size=32)
            c[f"native_q8_0@{baseline}"] = baseline_q8_0(ops)
    return c


def time_pass(fns, x):
    """Seconds per call, calling each fn once in turn (the distinct weight copies of one shape)."""
    t0 = time.perf_counter()
    for f in fns:
        f(x)
    return (time.perf_counter() - t0) / len(fns)


def interleaved(fns_by_kernel, x, reps, min_sample_s=3e-3):
    """Median and min seconds per call for each kernel, the kernels taking turns in every round."""
    inner = {}
    for c, fns in fns_by_kernel.items():  # warm up, and pick how many passes make a sample of >= min_sample_s
        time_pass(fns[:1], x)
        inner[c] = max(1, int(min_sample_s / max(time_pass(fns, x) * len(fns), 1e-7)))
    samples = {c: [] for c in fns_by_kernel}
    for _ in range(reps):
        for c, fns in fns_by_kernel.items():
            samples[c].append(sum(time_pass(fns, x) for _ in range(inner[c])) / inner[c])
    return {c: (statistics.median(v), min(v)) for c, v in samples.items()}


def build(makers, weights, x, too_slow_s):
    """Kernel name -> list of (fn, bytes) over the weights; kernels that cannot take the shape, or whose first call
    takes longer than too_slow_s, are left out (and named in the second result)."""
    built, slow = {}, []
    for c, make in makers.items():
        first = make(weights[0])
        if first is None:
            continue
        t0 = time.perf_counter()
        first[0](x)
        if time.perf_counter() - t0 > too_slow_s:
            slow.append(c)
            continue
        built[c] = [first] + [make(w) for w in weights[1:]]
    return built, slow


def bench_shapes(makers, ms, reps, too_slow_s):
    rows = []
    for name, (n, k, copies) in SHAPES.items():
        for m in ms:
            if name == "lm_head" and m > 16:
                continue  # prefill computes logits for the last position only
            torch.manual_seed(0)
            weights = [torch.randn(n, k) * 0.02 for _ in range(copies if m <= 16 else 2)]
            x = torch.randn(m, k)
            built, slow = build(makers, weights, x, too_slow_s)
            times = interleaved({c: [f for f, _ in b] for c, b in built.items()}, x, reps)
            for c, (med, best) in times.items():
                wbytes = built[c][0][1]
                rows.append({"shape": name, "N": n, "K": k, "M": m, "kernel": c, "us": round(med * 1e6, 1),
                             "min_us": round(best * 1e6, 1), "GB/s": round(wbytes / med / 1e9, 1),
                             "weight_bytes": wbytes})
                print(f"  {name:<8} {n:>5}x{k:<5} M={m:<4} {c:<16} {med * 1e6:10.1f} us  (min {best * 1e6:9.1f})"
                      f" {wbytes / med / 1e9:6.1f} GB/s")
            rows += [{"shape": name, "M": m, "kernel": c, "skipped": f"first call > {too_slow_s} s"} for c in slow]
            del built
    return rows


def bench_token(makers, ms, reps, too_slow_s):
    """All matmuls of one SmolLM2-135M forward (30 x qkv, o, gate_up, down, then lm_head) in model order, with the
    kernels taking turns in every round."""
    torch.manual_seed(0)
    order = [(n, k) for _ in range(30) for (n, k, _) in list(SHAPES.values())[:4]] + [SHAPES["lm_head"][:2]]
    weights = [torch.randn(n, k) * 0.02 for n, k in order]
    rows = []
    for m in ms:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        built, slow = {}, []
        for c, make in makers.items():
            b, s = build({c: make}, [weights[-1]], xs[576], too_slow_s)  # the lm_head call as the probe
            if s:
                slow.append(c)
            elif b:
                built[c] = [make(w) for w in weights]

        def forward(fns):
            return lambda _: [f(xs[k]) for f, (n, k) in zip(fns, order)]
        times = interleaved({c: [forward([f for f, _ in b])] for c, b in built.items()}, None, reps, 0)
        for c, (med, best) in times.items():
            wbytes = sum(b for _, b in built[c])
            rows.append({"kernel": c, "M": m, "ms_per_token": round(med * 1e3, 2), "min_ms": round(best * 1e3, 2),
                         "GB/s": round(wbytes / med / 1e9, 1), "weight_MB": round(wbytes / 1e6, 1)})
            print(f"  token  M={m:<4} {c:<16} {med * 1e3:8.2f} ms (min {best * 1e3:7.2f})  "
                  f"{wbytes / med / 1e9:6.1f} GB/s  {wbytes / 1e6:6.1f} MB")
        rows += [{"kernel": c, "M": m, "skipped": "too slow"} for c in slow]
        del built
    return rows


def bandwidth(reps):
    """x.sum() over float32 tensors as large as the formats' working sets: cache vs DRAM."""
    rows = []
    for mb in (16, 64, 128, 512):
        x = torch.ones(mb * 2**20 // 4)
        med, _ = interleaved({"sum": [lambda _: x.sum()]}, None, reps)["sum"]
        rows.append({"MB": mb, "GB/s": round(mb * 2**20 / med / 1e9, 1)})
        print(f"  x.sum() over {mb:4d} MB: {rows[-1]['GB/s']} GB/s")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", default="1,8,600", help="activation rows (tokens) per matmul")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated kernel names")
    p.add_argument("--too-slow", type=float, default=0.5, help="skip a kernel whose first call takes longer (s)")
    p.add_argument("--baseline", default="", help="also time the native kernels of this git revision")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "kernels.json"))
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    ms = [int(m) for m in a.ms.split(",")]
    makers = candidates(a.baseline)
    if a.only:
        only = a.only.split(",")
        makers = {c: m for c, m in makers.items() if c.split("@")[0] in only}  # a --baseline twin goes along
    print(f"torch {torch.__version__}, {a.threads} threads, cpu {torch.backends.cpu.get_cpu_capability()}")
    result = {"torch": torch.__version__, "threads": a.threads, "reps": a.reps,
              "cpu_capability": torch.backends.cpu.get_cpu_capability(), "bandwidth": bandwidth(a.reps)}
    with torch.no_grad():
        result["shapes"] = bench_shapes(makers, ms, a.reps, a.too_slow)
        result["token"] = bench_token(makers, [m for m in ms if m <= 16], a.reps, a.too_slow)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
