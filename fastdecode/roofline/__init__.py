"""Roofline and routes: the fastest batch-1 decode a model can reach on a hardware route, and how close a measured
run comes to it."""
from fastdecode.roofline.calc import Result, Scenario, ScenarioError, roofline
from fastdecode.roofline.hardware import Hardware, UnknownHardwareError, get_hardware, load_catalog, this_machine
from fastdecode.roofline.models import ModelSpec, UnknownModelError, get_model
from fastdecode.roofline.probe import measure_bandwidth

__all__ = ["Hardware", "ModelSpec", "Result", "Scenario", "ScenarioError", "UnknownHardwareError",
           "UnknownModelError", "get_hardware", "get_model", "load_catalog", "measure_bandwidth", "roofline",
           "this_machine"]
