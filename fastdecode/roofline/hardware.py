"""Hardware catalog: the published figures of each chip (hardware.toml, a source per figure) and `this-machine`,
built from the bandwidth probe."""
from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from fastdecode.errors import FastdecodeError

CATALOG_FILE = Path(__file__).with_name("hardware.toml")
THIS_MACHINE = "this-machine"
# Which compute figure a weight format runs at, best first: an upper bound, so quantized weights may use the
# low-precision units where the chip has them, else fall back to bf16 after dequantization.
COMPUTE_PRECISIONS = {
    "fp32": ("fp32",), "bf16": ("bf16", "fp16"), "fp16": ("fp16", "bf16"), "fp8": ("fp8", "bf16", "fp16"),
    "int8": ("int8", "bf16", "fp16"), "int4": ("int4", "int8", "bf16", "fp16"),
    "fp4": ("fp4", "fp8", "bf16", "fp16"),
}

INTEGER_COMPUTE = ("int8", "int4", "fp4")  # this machine's quantized kernels: int8 activations


class UnknownHardwareError(FastdecodeError):
    """A --hw name that is not in the catalog."""


@dataclass(frozen=True)
class Hardware:
    name: str
    label: str
    kind: str  # gpu | sram | hardwired | unified | dram | probe
    memory_gb: float  # capacity of the memory that holds the weights, per chip
    bandwidth_gb_s: float  # read bandwidth of that memory; 0 = not published (hardwired weights)
    tflops: dict[str, float] = field(default_factory=dict)  # dense, per precision
    interconnect_gb_s: float | None = None  # per chip, per direction
    latency_us: float | None = None  # one step of a small all-reduce, or one pipeline hop
    scale_up: int | None = None  # chips in one fast (tensor-parallel) domain; None = no limit
    multi_chip: str = "tp"
    price_per_hour: float | None = None
    layer_latency_us: float = 0.0  # hardwired: time for one token to pass one layer
    model: str | None = None  # hardwired: the one model wired in
    dtype: str | None = None  # hardwired: the weight format wired in
    aliases: tuple[str, ...] = ()
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def weights_in_logic(self) -> bool:
        return self.kind == "hardwired"

    def compute_tflops(self, weight_dtype: str) -> tuple[float | None, str | None]:
        """(TFLOPS, precision) the matmuls of `weight_dtype` weights can run at; (None, None) if unpublished."""
        for precision in COMPUTE_PRECISIONS.get(weight_dtype, ("int8", "bf16", "fp16")):
            if precision in self.tflops:
                return self.tflops[precision], precision
        return None, None


def load_catalog(path: Path = CATALOG_FILE) -> dict[str, Hardware]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    catalog = {}
    for name, fields in data.items():
        fields = dict(fields)
        fields["aliases"] = tuple(fields.get("aliases", ()))
        catalog[name] = Hardware(name=name, **fields)
    return catalog


def hardware_names(catalog: dict[str, Hardware] | None = None) -> list[str]:
    return [*(catalog or load_catalog()), THIS_MACHINE]


def get_hardware(name: str, catalog: dict[str, Hardware] | None = None) -> Hardware:
    """A catalog entry by name or alias (`this-machine` is built by `this_machine`, which needs a probe)."""
    catalog = catalog or load_catalog()
    key = name.strip().lower()
    if key in catalog:
        return catalog[key]
    for hw in catalog.values():
        if key in hw.aliases:
            return hw
    if key == THIS_MACHINE:
        raise UnknownHardwareError("this-machine needs a probe: use this_machine()")
    raise UnknownHardwareError(f"unknown hardware {name!r}; known: {', '.join(hardware_names(catalog))}")


def physical_memory_gb() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (ValueError, OSError, AttributeError):
        return 0.0


def this_machine(bandwidth_gb_s: float, matmul_tflops: dict[str, float] | None = None, threads: int | None = None,
                 bandwidth_note: str = "") -> Hardware:
    """This computer as a one-chip `Hardware`, from a measured (or given) read bandwidth and matmul speeds. Every
    weight format gets the best float matmul measured (an engine may compute in whichever is fastest, and a ceiling
    must not be lowered by one slow kernel); the integer formats (int8, int4, fp4: integer dot products on int8
    activations) the int8 one where it is faster."""
    from fastdecode.roofline.probe import float_peak, int8_peak

    speeds = matmul_tflops or {}
    floats = float_peak(speeds)[0]
    integers = max(floats, int8_peak(speeds)[0])
    label = "this machine" + (f" ({threads} threads)" if threads else "")
    tflops = {p: integers if p in INTEGER_COMPUTE else floats for p in COMPUTE_PRECISIONS}
    return Hardware(
        name=THIS_MACHINE, label=label, kind="probe", memory_gb=round(physical_memory_gb(), 1),
        bandwidth_gb_s=bandwidth_gb_s, tflops={p: v for p, v in tflops.items() if v},
        multi_chip="pp",
        sources={"bandwidth_gb_s": bandwidth_note or "fastdecode probe",
                 "tflops": "fastdecode probe: best torch matmul (F.linear) in fp32 or bf16; for the integer formats "
                           "the faster of torch._int_mm and the int8 instructions of the kernels' path",
                 "memory_gb": "os.sysconf physical pages"})


def with_bandwidth(hw: Hardware, bandwidth_gb_s: float) -> Hardware:
    """The same chip with its memory bandwidth overridden (--bandwidth)."""
    return replace(hw, bandwidth_gb_s=bandwidth_gb_s,
                   sources={**hw.sources, "bandwidth_gb_s": "given on the command line (--bandwidth)"})
