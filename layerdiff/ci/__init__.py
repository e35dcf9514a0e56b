"""Numerical parity in CI: golden traces, checks against them, calibration (their JUnit XML
is layerdiff.report.junit's)."""

from layerdiff.ci.calibrate import Calibration, calibrate
from layerdiff.ci.check import CheckOutcome, CheckResult, check, golden

__all__ = ["Calibration", "CheckOutcome", "CheckResult", "calibrate", "check", "golden"]
