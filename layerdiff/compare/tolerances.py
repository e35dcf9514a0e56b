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
from pathlib import Path
from typing import Any

from layerdiff.compare.config_file import ConfigFile
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


@dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    source: str  # where the numbers came from, for the verdict's explanation

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
    """Default tolerances plus the rules of an optional file."""

    def __init__(self, rules: list[_Rule] | None = None, path: Path | None = None) -> None:
        self.rules = rules or []
        self.path = path

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
        """The tolerance for one tensor: the dtype default, then every matching rule in order."""
        tolerance = default_tolerance(dtype)
        for rule in self.rules:
            if rule.matches(site, role, arg, dtype):
                tolerance = Tolerance(tolerance.rtol if rule.rtol is None else rule.rtol,
                                      tolerance.atol if rule.atol is None else rule.atol,
                                      rule.label)
        return tolerance

    def as_json(self) -> dict[str, Any]:
        return {"file": str(self.path) if self.path else None, "defaults": DEFAULTS}


def _yaml_number(value: Any) -> Any:
    """YAML 1.1 (PyYAML) reads '1e-3' as a string; take it as the number it plainly is."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
