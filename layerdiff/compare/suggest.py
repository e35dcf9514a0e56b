"""The next commands a diff suggests: where an origin is in a module's own code (its output or
input gradient is out while everything inside it that was compared is within) and its ops were
not captured, the two captures (reference, port) and the diff that would name the op."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from layerdiff.compare import result as R
from layerdiff.trace import Trace, schema

TORCH_PRODUCER = "layerdiff.capture (torch)"


def diff_options(mapping: Any = None, tolerances: Any = None) -> list[str]:
    """The options a printed ``layerdiff diff`` needs to compare as the diff that printed it
    did: the mapping file the user gave (``--map``: a mapping that names code or regular
    expressions is refused when read back from a trace, and is run only when passed), the
    tolerance file and the ``--rtol``/``--atol`` flags. ``mapping`` is a Mapping or a path,
    ``tolerances`` a Tolerances or a path (None: not given)."""
    options: list[str] = []
    if mapping is not None:
        path = getattr(mapping, "path", mapping)
        if path is not None and not getattr(mapping, "origin", ""):  # not read from a trace
            options += ["--map", str(path)]
    if tolerances is not None:
        path = getattr(tolerances, "path", tolerances)
        if path is not None:
            options += ["--tolerances", str(path)]
        for name in ("rtol", "atol"):
            value = getattr(tolerances, name, None)
            if value is not None:
                options += [f"--{name}", repr(float(value))]
    return options


def ops_commands(ref: Trace, port: Trace, origins: list[R.Origin],
                 first_step: int | None, diff_args: list[str] | None = None) -> list[str]:
    """Shell commands that capture both sides again with ``--ops`` on the modules whose own code
    holds an origin, then diff them; empty when there is no such origin, when those ops were
    captured already, or when a side was not captured by layerdiff's torch hooks from a case
    spec (a port that records itself names its own op sites; a Case built in a notebook has no
    spec to capture it again by). ``diff_args`` are the printed diff's options
    (:func:`diff_options`)."""
    # an origin is innermost: with its output or input gradient out, the fault is in the
    # module's own code (a weight gradient is not an op's: ops do not record parameters)
    wanted = [o for o in origins if o.role in schema.RESULT_ROLES
              and not schema.is_op_site(o.site) and o.site != schema.LOSS_SITE
              and not _one_op(ref, o.site)]
    if not wanted or first_step is None:
        return []
    if not _recapturable(ref, port):
        return []
    ref_modules, port_modules = [], []
    for origin in wanted:
        ref_module = schema.split_site(origin.site)[0]
        port_module = schema.split_site(origin.port_site or origin.site)[0]
        if ref_module in _captured_ops(ref) and port_module in _captured_ops(port):
            continue
        if ref_module not in ref_modules:
            ref_modules.append(ref_module)
            port_modules.append(port_module)
    return _recapture(ref, port, ref_modules, port_modules, first_step, "--ops", "ops",
                      diff_args)


def full_commands(ref: Trace, port: Trace, origins: list[R.Origin],
                  first_step: int | None, diff_args: list[str] | None = None) -> list[str]:
    """Where a side is a summary trace: the captures that keep tensor data around the origins'
    modules (``--full-around``) and statistics elsewhere, then their diff, which can show the
    element-wise error and a likely cause; the second phase for a model too big to capture in
    full. Empty when both sides hold tensor data or neither can be captured again."""
    if not (ref.summary or port.summary) or first_step is None or not origins:
        return []
    if not _recapturable(ref, port):
        return []
    ref_modules, port_modules = [], []
    for origin in origins[:4]:
        ref_site = schema.split_op_site(origin.site)
        port_site = schema.split_op_site(origin.port_site or origin.site)
        ref_module = schema.split_site(ref_site[0] if ref_site else origin.site)[0]
        port_module = schema.split_site(
            port_site[0] if port_site else (origin.port_site or origin.site))[0]
        if ref_module != schema.LOSS_SITE.partition("#")[0] and ref_module not in ref_modules:
            ref_modules.append(ref_module)
            port_modules.append(port_module)
    return _recapture(ref, port, ref_modules, port_modules, first_step, "--full-around",
                      "full", diff_args)


def _recapturable(ref: Trace, port: Trace) -> bool:
    """Both traces were captured by the torch hooks from a case spec, so can be again."""
    return all(trace.meta.get("producer") == TORCH_PRODUCER
               and ":" in str(trace.meta.get("case") or "") for trace in (ref, port))


def _recapture(ref: Trace, port: Trace, ref_modules: list[str], port_modules: list[str],
               first_step: int, option: str, tag: str,
               diff_args: list[str] | None = None) -> list[str]:
    """Capture both sides again with ``option MODULE`` for each module, then diff them with
    ``diff_args`` (the mapping and tolerances the diff that printed them was given)."""
    if not ref_modules:
        return []
    ref_out = _renamed(ref.path, tag)
    port_out = _renamed(port.path, tag)
    steps = first_step + 1  # the captures need to reach the failing step, no further
    ref_cmd = _capture(ref.meta, ref_out, option, ref_modules, steps)
    port_cmd = _capture(port.meta, port_out, option, port_modules, steps)
    weights = port.meta.get("weights") or {}
    if weights.get("from"):
        # the trace the port's weights came from, where it is still there: the reference's
        # new capture keeps no weight data outside --full-around (nor in a --summary one)
        source = Path(str(weights["from"]))
        port_cmd += ["--weights-from", str(source if source.is_file() else ref_out)]
        mapping = weights.get("mapping") or {}
        if mapping.get("path"):
            port_cmd += ["--map", str(mapping["path"])]
    return [shlex.join(ref_cmd), shlex.join(port_cmd),
            shlex.join(["layerdiff", "diff", str(ref_out), str(port_out), *(diff_args or [])])]


def _one_op(ref: Trace, site: str) -> bool:
    """A leaf of one of torch's own module types (Linear, LayerNorm, GELU): its own code is
    one functional call, which op capture would only name again."""
    sites = ref.sites
    rows = sites[sites["site"] == site]
    if rows.empty or (sites["parent"] == site).any():
        return False
    return str(rows["type"].iloc[0]) in set(ref.meta.get("builtin_types") or [])


def _captured_ops(trace: Trace) -> set[str]:
    ops = trace.meta.get("ops") or {}
    return set(ops.get("modules") or [])


def _renamed(path: Path, tag: str) -> Path:
    return path.with_name(f"{path.stem}.{tag}{path.suffix}")


def _capture(meta: dict[str, Any], output: Path, option: str, modules: list[str],
             steps: int) -> list[str]:
    """``layerdiff capture`` with the options the trace was captured with, plus ``option``
    for each module (``--full-around`` keeps data, so it drops ``--summary``)."""
    command = ["layerdiff", "capture", str(meta["case"]), "-o", str(output)]
    for module in modules:
        command += [option, module]
    if steps != meta.get("steps"):
        command += ["--steps", str(steps)]
    if meta.get("loss_scale", 1.0) != 1.0:
        command += ["--loss-scale", repr(float(meta["loss_scale"]))]
    for name in ("include", "exclude"):
        for glob in meta.get(name) or []:
            command += [f"--{name}", glob]
    for name in ("dtype", "autocast"):
        if meta.get(name):
            command += [f"--{name}", str(meta[name])]
    ops = meta.get("ops") or {}
    for glob in ops.get("globs") or []:  # the ops captured before stay captured
        if not (option == "--ops" and glob in modules):
            command += ["--ops", glob]
    if ops.get("all") and (ops.get("globs") or option == "--ops"):
        command.append("--ops-all")
    if meta.get("summary") and option != "--full-around":
        command.append("--summary")
    return command


def wrap_command(command: str, width: int) -> list[str]:
    """A shell command over several lines of at most ``width`` columns, continued with
    backslashes, so that it can still be pasted into a shell whole."""
    lines, line = [], ""
    for word in shlex.split(command):
        word = shlex.quote(word)
        if line and len(line) + 1 + len(word) + 2 > width:
            lines.append(line + " \\")
            line = "    " + word
        else:
            line = f"{line} {word}" if line else word
    return [*lines, line]
