#!/usr/bin/env python
"""The same diff by two source trees: ``layerdiff diff REF PORT --json`` with this tree and with
another (``--before DIR``, e.g. ``git archive COMMIT | tar -x -C DIR``), each in a fresh
process, and their JSON compared whole. For changes that must not move a single row, origin
or hint (speed work on the diff). Exit 0 when every pair agrees, 1 otherwise.

    python scripts/diff_same_json.py --before /tmp/before ref.h5 port.h5 [ref2.h5 port2.h5 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def diff_json(tree: Path, ref: str, port: str, out: Path, env: dict[str, str]) -> dict:
    code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); from layerdiff.cli import run; "
            "sys.argv[0] = 'layerdiff'; run()")
    done = subprocess.run([sys.executable, "-c", code, str(tree), "diff", ref, port, "--json",
                           str(out)], capture_output=True, text=True, check=False,
                          env={**os.environ, **env})
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{tree}: layerdiff diff {ref} {port} failed:\n{done.stderr}")
    return json.loads(out.read_text())


def differences(a, b, path: str = "") -> list[str]:
    """Where two JSON values differ, by path (floats compared exactly)."""
    if type(a) is not type(b):
        return [f"{path}: {a!r} vs {b!r}"]
    if isinstance(a, dict):
        found = [f"{path}.{k}: only on one side" for k in a.keys() ^ b.keys()]
        for key in a.keys() & b.keys():
            found += differences(a[key], b[key], f"{path}.{key}")
        return found
    if isinstance(a, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} vs {len(b)} items"]
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True))
                for d in differences(x, y, f"{path}[{i}]")]
    same = a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b))
    return [] if same else [f"{path}: {a!r} vs {b!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--env", action="append", default=[],
                        help="NAME=VALUE for both sides (repeatable)")
    parser.add_argument("traces", nargs="+", help="reference and port traces, in pairs")
    args = parser.parse_args()
    if len(args.traces) % 2:
        sys.exit("diff_same_json: traces come in pairs (reference, port)")
    env = dict(item.split("=", 1) for item in args.env)
    failed = 0
    with tempfile.TemporaryDirectory() as scratch:
        for ref, port in zip(args.traces[::2], args.traces[1::2], strict=True):
            after = diff_json(HERE, ref, port, Path(scratch) / "after.json", env)
            before = diff_json(args.before, ref, port, Path(scratch) / "before.json", env)
            found = differences(before, after)
            rows = len(after.get("rows", []))
            origins = [(o.get("site"), o.get("role"), (o.get("hint") or {}).get("kind"))
                       for o in after.get("origins", [])]
            print(f"{'SAME' if not found else 'DIFFERENT'}: {Path(ref).name} vs "
                  f"{Path(port).name}: {rows} rows, origins {origins}")
            for line in found[:10]:
                print(f"    {line}")
            failed += bool(found)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
