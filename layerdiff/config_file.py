"""Reading the small TOML or YAML files users write (mappings, tolerances), with line numbers.

Both formats load as plain data only (``tomllib``, ``yaml.safe_load``): reading a file never
runs code. Errors name the file and the line, and say what to do.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from layerdiff.errors import LayerdiffError


@dataclass
class ConfigFile:
    path: Path
    text: str
    data: dict[str, Any]
    error: type[LayerdiffError]

    @classmethod
    def load(cls, path: str | Path, error: type[LayerdiffError]) -> ConfigFile:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise error(f"{path} does not exist; check the path") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise error(f"{path} cannot be read ({exc})") from exc
        return cls.parse(path, text, error)

    @classmethod
    def parse(cls, path: Path, text: str, error: type[LayerdiffError]) -> ConfigFile:
        """A file's text, already read (``path`` names it and says TOML or YAML)."""
        if path.suffix.lower() in (".yaml", ".yml"):
            data = _parse_yaml(path, text, error)
        else:
            data = _parse_toml(path, text, error)
        if not isinstance(data, dict):
            raise error(f"{path} line 1: the file must hold a table of settings, "
                        f"not a {type(data).__name__}")
        return cls(path, text, data, error)

    def fail(self, message: str, line: int | None = None) -> NoReturn:
        where = f"{self.path} line {line}" if line else str(self.path)
        raise self.error(f"{where}: {message}")

    def tables(self, key: str) -> list[tuple[dict[str, Any], int | None]]:
        """The entries of a top-level list of tables (``[[key]]`` in TOML, ``key:`` then
        ``- ...`` items in YAML), each with the line it starts on."""
        entries = self.data.get(key, [])
        if not isinstance(entries, list):
            self.fail(f"'{key}' must be a list of tables ([[{key}]] in TOML)",
                      self.line_of(key))
        lines = self._entry_lines(key)
        result = []
        for i, entry in enumerate(entries):
            line = lines[i] if i < len(lines) else None
            if not isinstance(entry, dict):
                self.fail(f"entry {i + 1} of '{key}' must be a table, got {entry!r}", line)
            result.append((entry, line))
        return result

    def check_keys(self, table: dict[str, Any], allowed: set[str], where: str,
                   line: int | None = None) -> None:
        for key in table:
            if key not in allowed:
                close = difflib.get_close_matches(key, sorted(allowed), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else (
                    f"; known keys: {', '.join(sorted(allowed))}")
                self.fail(f"unknown key '{key}' in {where}{hint}",
                          line if line else self.line_of(key))

    def line_of(self, key: str) -> int | None:
        """The first line that sets ``key`` (or opens a table of that name), if any."""
        pattern = re.compile(rf"^\s*\[*\s*{re.escape(key)}\s*[\]=:]")
        for number, text in enumerate(self.text.splitlines(), start=1):
            if pattern.match(text):
                return number
        return None

    def _entry_lines(self, key: str) -> list[int]:
        if self.path.suffix.lower() in (".yaml", ".yml"):
            return _yaml_entry_lines(self.text, key)
        header = re.compile(rf"^\s*\[\[\s*{re.escape(key)}\s*\]\]")
        return [n for n, text in enumerate(self.text.splitlines(), start=1) if header.match(text)]


def _parse_toml(path: Path, text: str, error: type[LayerdiffError]) -> Any:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        match = re.search(r"at line (\d+)", str(exc))
        where = f"{path} line {match.group(1)}" if match else str(path)
        reason = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(exc))
        raise error(f"{where}: not valid TOML ({reason}); fix the syntax there") from None


def _parse_yaml(path: Path, text: str, error: type[LayerdiffError]) -> Any:
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is a dependency
        raise error(f"{path}: reading YAML needs PyYAML (pip install pyyaml), "
                    "or write the file as TOML") from None
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path} line {mark.line + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise error(f"{where}: not valid YAML ({problem}); fix the syntax there") from None


def _yaml_entry_lines(text: str, key: str) -> list[int]:
    import yaml

    root = yaml.compose(text)
    if not isinstance(root, yaml.MappingNode):
        return []
    for key_node, value_node in root.value:
        if key_node.value == key and isinstance(value_node, yaml.SequenceNode):
            return [item.start_mark.line + 1 for item in value_node.value]
    return []
