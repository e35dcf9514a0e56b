"""Tolerances: a default per dtype, per-site overrides from a file, and the reason for each.

Defaults are ``torch.testing.assert_close``'s table: a pair passes where
``|port - ref| <= atol + rtol * |ref|`` element by element. A tolerance file (TOML or YAML)
overrides them for sites, roles and arguments matched by globs; the last matching rule wins,
so general rules go first and exceptions after::

    # tolerances.toml
    [[rule]]
    site = "decoder.*"          # glob over the reference's site names (module#call)
    role = "grad_*"             # optional: glob over roles
    rtol = 1e-4
    atol = 1e-5
    why = "decoder gradients accumulate over 12 layers"   # optional, shown with verdicts

    [[rule]]
    site = "*.norm*"
    dtype = "bfloat16"          # optional: only tensors of this dtype
    rtol = 2e-2
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import pandas as pd

from layerdiff.config_file import ConfigFile
from layerdiff.errors import ToleranceError

# (rtol, atol) per dtype, as torch.testing.assert_close has them.
DEFAULTS: dict[str, tuple[float, float]] = {
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float32": (1.3e-6, 1e-5),
    "float64": (1e-7, 1e-7),
    "complex64": (1.3e-6, 1e-5),
    "complex128": (1e-7, 1e-7),
}
EXACT = (0.0, 0.0)  # integers, booleans and anything not floating point


class ToleranceKind(StrEnum):
    """Where a :class:`Tolerance` came from: what a baseline may replace and what it may not."""

    DEFAULT = "default"     # the dtype's default
    FLAGS = "flags"         # --rtol / --atol (what the user said wins over a baseline)
    RULE = "rule"           # a tolerance file's rule (so does this)
    BASELINE = "baseline"   # the error the baseline shows that precision makes


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    source: str  # where the numbers came from, for the verdict's explanation
    kind: ToleranceKind = ToleranceKind.DEFAULT

    def describe(self) -> str:
        return f"rtol={self.rtol:g} atol={self.atol:g} ({self.source})"


def default_tolerance(dtype: str) -> Tolerance:
    rtol, atol = DEFAULTS.get(dtype, EXACT)
    kind = "exact" if dtype not in DEFAULTS else "torch.testing default"
    return Tolerance(rtol, atol, f"{dtype} {kind}")


def looser_dtype(a: str, b: str) -> str:
    """Of two dtypes, the one with the looser default tolerance (compare at the port's
    precision when it is lower)."""
    return max((a, b), key=lambda d: DEFAULTS.get(d, EXACT)[0])


@dataclass(frozen=True)
class _Rule:
    site: str
    role: str
    arg: str
    dtype: str
    rtol: float | None
    atol: float | None
    label: str  # "tolerances.toml rule 2 (line 7)" and the rule's why

    def matches(self, site: str, role: str, arg: str, dtype: str) -> bool:
        module = site.rpartition("#")[0] or site  # a glob may name the module or the site
        return ((fnmatch.fnmatchcase(site, self.site) or fnmatch.fnmatchcase(module, self.site))
                and fnmatch.fnmatchcase(role, self.role)
                and fnmatch.fnmatchcase(arg, self.arg)
                and (self.dtype == "*" or self.dtype == dtype))


class Tolerances:
    """Default tolerances plus the rules of an optional file.

    ``rtol`` / ``atol`` (the ``--rtol`` / ``--atol`` flags) replace the per-dtype default of
    every record; a file's rules still override them where they match."""

    def __init__(self, rules: list[_Rule] | None = None, path: Path | None = None, *,
                 rtol: float | None = None, atol: float | None = None) -> None:
        self.rules = rules or []
        self.path = path
        for name, value in (("rtol", rtol), ("atol", atol)):
            if value is not None and not (isinstance(value, (int, float)) and value >= 0
                                          and value != float("inf")):
                raise ToleranceError(f"--{name} must be a finite number >= 0, got {value!r}")
        self.rtol, self.atol = rtol, atol

    @classmethod
    def build(cls, source: str | Path | Tolerances | None = None, *, rtol: float | None = None,
              atol: float | None = None) -> Tolerances:
        """Tolerances from a file (or none, or ready ones) with the flags' defaults on top."""
        if isinstance(source, Tolerances):
            tolerances = source
        else:
            tolerances = cls.load(source) if source is not None else cls()
        if rtol is not None or atol is not None:
            tolerances = cls(tolerances.rules, tolerances.path,
                             rtol=tolerances.rtol if rtol is None else rtol,
                             atol=tolerances.atol if atol is None else atol)
        return tolerances

    @classmethod
    def load(cls, path: str | Path) -> Tolerances:
        config = ConfigFile.load(path, ToleranceError)
        config.check_keys(config.data, {"version", "rule"}, "the top level")
        version = config.data.get("version", 1)
        if version != 1:
            config.fail(f"tolerance file version {version!r} is not supported (this layerdiff "
                        "reads 1)", config.line_of("version"))
        rules = []
        for number, (rule, line) in enumerate(config.tables("rule"), start=1):
            where = f"rule {number} (line {line})"
            config.check_keys(rule, {"site", "role", "arg", "dtype", "rtol", "atol", "why"},
                              where, line)
            if "rtol" not in rule and "atol" not in rule:
                config.fail(f"{where} sets neither rtol nor atol", line)
            values = {}
            for key in ("rtol", "atol"):
                value = rule.get(key)
                if config.path.suffix.lower() in (".yaml", ".yml"):
                    value = _yaml_number(value)
                if value is not None and not (isinstance(value, (int, float))
                                              and not isinstance(value, bool) and value >= 0):
                    config.fail(f"{where}: {key} must be a number >= 0, got {value!r}", line)
                values[key] = None if value is None else float(value)
            for key in ("site", "role", "arg", "dtype", "why"):
                if key in rule and not isinstance(rule[key], str):
                    config.fail(f"{where}: {key} must be a string, got {rule[key]!r}", line)
            label = f"{config.path.name} {where}"
            if rule.get("why"):
                label += f": {rule['why']}"
            rules.append(_Rule(rule.get("site", "*"), rule.get("role", "*"), rule.get("arg", "*"),
                               rule.get("dtype", "*"), values["rtol"], values["atol"], label))
        return cls(rules, config.path)

    def lookup(self, site: str, role: str, arg: str, dtype: str) -> Tolerance:
        """The tolerance for one tensor: the dtype default (or the flags), then every matching
        rule in order."""
        tolerance = default_tolerance(dtype)
        if (self.rtol is not None or self.atol is not None) and dtype in DEFAULTS:
            given = " ".join(f"--{k} {v:g}" for k, v in (("rtol", self.rtol),
                                                          ("atol", self.atol)) if v is not None)
            tolerance = Tolerance(tolerance.rtol if self.rtol is None else self.rtol,
                                  tolerance.atol if self.atol is None else self.atol,
                                  given, ToleranceKind.FLAGS)
        for rule in self.rules:
            if rule.matches(site, role, arg, dtype):
                tolerance = Tolerance(tolerance.rtol if rule.rtol is None else rule.rtol,
                                      tolerance.atol if rule.atol is None else rule.atol,
                                      rule.label, ToleranceKind.RULE)
        return tolerance

    def unmatched(self, records: pd.DataFrame) -> list[str]:
        """A warning for each rule that matches none of ``records`` (a diff's rows, looked up
        as the diff does): a typo in a glob would otherwise loosen or tighten nothing, silently."""
        keys = {(site, role, arg, looser_dtype(dtype, port_dtype) if port_dtype else dtype)
                for site, role, arg, dtype, port_dtype in records[
                    ["site", "role", "arg", "dtype", "port_dtype"]].itertuples(index=False)}
        return [f"{rule.label.split(':')[0]} matched no compared record (site {rule.site!r}, "
                f"role {rule.role!r}, arg {rule.arg!r}, dtype {rule.dtype!r}): check its globs"
                for rule in self.rules if not any(rule.matches(*key) for key in keys)]

    def as_json(self) -> dict[str, Any]:
        return {"file": str(self.path) if self.path else None, "defaults": DEFAULTS,
                "rtol": self.rtol, "atol": self.atol}


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads '1e-3' as a string; take it as the number it plainly is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
