"""Numerical parity in CI: golden traces, checks against them, JUnit XML, calibration."""

from layerdiff.ci.calibrate import Calibration, calibrate
from layerdiff.ci.check import CheckResult, check, golden
from layerdiff.ci.junit import write_junit

__all__ = ["Calibration", "CheckResult", "calibrate", "check", "golden", "write_junit"]
