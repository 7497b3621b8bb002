"""Hardware catalog: the issue's names, a source for every figure."""
import tomllib

import pytest

from fastdecode.roofline.hardware import (CATALOG_FILE, UnknownHardwareError, get_hardware, hardware_names,
                                          load_catalog, this_machine)

ISSUE_NAMES = ("a100-80gb", "h100-sxm", "h200", "b200", "gb200", "gb300", "mi300x", "mi355x", "wse-3", "groq-lpu",
               "m4-max", "ddr5-desktop", "this-machine")
NOT_FIGURES = {"label", "kind", "aliases", "multi_chip", "sources"}


def test_catalog_has_the_issues_names_and_a_hardwired_chip():
    names = hardware_names()
    assert all(name in names for name in ISSUE_NAMES)
    assert get_hardware("hardwired").weights_in_logic


def test_every_figure_has_a_source():
    with open(CATALOG_FILE, "rb") as f:
        data = tomllib.load(f)
    for name, entry in data.items():
        missing = [k for k in entry if k not in NOT_FIGURES and k not in entry.get("sources", {})]
        assert not missing, f"{name}: no source for {missing}"
        assert all(entry["sources"].values())


def test_figures_are_per_chip_and_plausible():
    hw = load_catalog()
    assert hw["h200"].bandwidth_gb_s == 4800 and hw["h200"].memory_gb == 141
    assert hw["wse-3"].bandwidth_gb_s > 1000 * hw["b200"].bandwidth_gb_s  # SRAM wafer vs HBM
    assert hw["a100-80gb"].compute_tflops("fp8") == (312, "bf16")  # no FP8 units: falls back to bf16


def test_unknown_hardware_is_a_user_error():
    with pytest.raises(UnknownHardwareError, match="known: .*h200"):
        get_hardware("h300")


def test_this_machine_gets_its_best_measured_matmul_for_every_format():
    hw = this_machine(28.0, {"fp32": 0.2, "bf16": 0.05}, threads=2)
    assert hw.bandwidth_gb_s == 28.0 and hw.compute_tflops("int8") == (0.2, "int8")


def test_this_machine_gives_the_int8_peak_to_the_integer_formats_only():
    hw = this_machine(28.0, {"fp32": 0.2, "bf16": 0.4, "int8": 0.9}, threads=2)
    assert hw.compute_tflops("int4") == (0.9, "int4") and hw.compute_tflops("fp4") == (0.9, "fp4")
    assert hw.compute_tflops("bf16") == (0.4, "bf16") and hw.compute_tflops("fp32") == (0.4, "fp32")
    slow_int8 = this_machine(28.0, {"fp32": 0.2, "bf16": 0.4, "int8": 0.1})  # never below the float matmuls
    assert slow_int8.compute_tflops("int8") == (0.4, "int8")
    avx2 = this_machine(28.0, {"fp32": 0.06, "bf16": 0.01, "int8": 0.002, "kernels": {"int8 avx2": 0.12}})
    assert avx2.compute_tflops("int4") == (0.12, "int4") and avx2.compute_tflops("bf16") == (0.06, "bf16")
