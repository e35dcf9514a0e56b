"""``replay``: each port layer on the reference's own inputs, to measure its own error.

The replayed calls are written as a trace in the port's names and diffed against the
reference like any port trace, judging every site on its own (``diff(independent=True)``).
Beside each site's local error the result carries the *propagated* error of a plain diff of
the port's own run, and the amplification (output error over input error) of that run, so a
layer that merely passes on an error is exonerated and one that makes its own is not.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd

from layerdiff.case import Case, ExternalCase
from layerdiff.compare import diff
from layerdiff.compare.mapping import Mapping
from layerdiff.compare.matching import port_site_for
from layerdiff.compare.result import Diff
from layerdiff.compare.tolerances import Tolerances
from layerdiff.errors import CaptureError, DiffError
from layerdiff.replay.recorded import RecordedCall, recorded_calls
from layerdiff.trace import Trace, TraceWriter, open_trace, schema


def replay(reference: str | os.PathLike, port: Case | ExternalCase, *,
           mapping: str | os.PathLike | Mapping | None = None,
           sites: Sequence[str] = (), tolerances: str | os.PathLike | Tolerances | None = None,
           output: str | os.PathLike | None = None, propagated: bool = True) -> Diff:
    """Replay every matched site of ``reference`` into ``port`` and diff the result.

    ``port`` is a torch Case (its model gets the reference's weights through ``mapping``) or
    an ExternalCase with per-site ``layers``. ``sites`` are globs over the reference's site or
    module names. ``output`` keeps the replay trace. With ``propagated``, the port also runs
    whole on the case's inputs, for the propagated error beside each local one.
    """
    mapping = mapping if isinstance(mapping, Mapping) else (
        Mapping.load(mapping) if mapping is not None else Mapping())
    with tempfile.TemporaryDirectory(prefix="layerdiff-replay-") as tmp:
        path = Path(output) if output else Path(tmp) / "replay.h5"
        with open_trace(reference) as ref:
            log = write_replay(ref, port, mapping, sites, path)
        result = diff(reference, path, mapping=mapping, tolerances=tolerances,
                      independent=True)
        result.meta["replay"] = {"failed": log.failed, "skipped": log.skipped,
                                 "replayed": len(log.replayed)}
        if propagated:
            _add_propagated(result, reference, port, mapping, tolerances, Path(tmp))
    return result


class ReplayLog:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []     # (reference site, the error)
        self.skipped: list[tuple[str, str]] = []    # (reference site, why)
        self.replayed: list[tuple[str, str]] = []   # (reference site, port site)


def write_replay(ref: Trace, port: Case | ExternalCase, mapping: Mapping,
                 sites: Sequence[str], path: Path) -> ReplayLog:
    """The replay trace: every recorded call of step 0 that has a port partner, replayed."""
    calls = recorded_calls(ref, sites)  # refuses a summary trace before any work
    backend = _backend(ref, port, mapping)
    log = ReplayLog()
    meta = {"case": port.name, "replay_of": str(ref.path), "loss_scale": ref.loss_scale,
            "steps": 1}
    open_calls: list[tuple[RecordedCall, str]] = []
    with TraceWriter(path, meta=meta, producer="layerdiff.replay") as writer:
        for call in calls:
            target = port_site_for(call.site, mapping, backend.modules)
            if target is None:
                log.skipped.append((call.site, "no port layer pairs with it"))
                continue
            while open_calls and not open_calls[-1][0].contains(call):
                writer.exit(open_calls.pop()[1])
            port_site, args_map = target
            module, number = schema.split_site(port_site)
            site = writer.enter(module, backend.type_of(module), call=number)
            open_calls.append((call, site))
            try:
                backend.replay(call, site, args_map, writer)
                log.replayed.append((call.site, port_site))
            except Exception as exc:  # a port layer that raises is named; the rest goes on
                reason = f"{type(exc).__name__}: {exc}"
                (log.skipped if type(exc).__name__ == "NotReplayable" else log.failed).append(
                    (call.site, reason))
        while open_calls:
            writer.exit(open_calls.pop()[1])
        backend.finish(writer, _complete_modules(ref, log))
    if not log.replayed:
        raise DiffError(f"no call of {ref.path} was replayed into {port.name}: "
                        + ("; ".join(f"{s}: {why}" for s, why in (log.failed + log.skipped)[:3])
                           or "no port layer pairs with any reference site")
                        + "; check the case and the mapping (--map)")
    return log


def _complete_modules(ref: Trace, log: ReplayLog) -> set[str]:
    """Port modules all of whose reference calls were replayed: their weight gradients are
    sums over every call, as the reference's are."""
    calls = ref.sites[(ref.sites["step"] == 0)].groupby("module")["site"].apply(set)
    replayed: dict[str, set[str]] = {}
    ports: dict[str, str] = {}
    for ref_site, port_site in log.replayed:
        module = schema.split_site(ref_site)[0]
        replayed.setdefault(module, set()).add(ref_site)
        ports[module] = schema.split_site(port_site)[0]
    complete = set()
    for module, done in replayed.items():
        if done == calls.get(module, set()):
            complete.add(ports[module])
        else:
            log.skipped.append((f"{module} weight_grad", f"{len(done)} of "
                                f"{len(calls.get(module, ()))} calls replayed: the reference's "
                                "weight gradient sums them all, so it is not compared"))
    return complete


def _backend(ref: Trace, port: Case | ExternalCase, mapping: Mapping):
    if isinstance(port, ExternalCase):
        if not port.layers:
            raise CaptureError(f"case {port.name} records itself and gives no per-site layers, "
                               "so its layers cannot be replayed one by one; give the "
                               "ExternalCase a 'layers' dict of forward/backward callables")
        from layerdiff.replay.numpy_replay import CallablePort

        return CallablePort(port.layers, ref)
    from layerdiff.replay.torch_replay import TorchPort
    from layerdiff.weights import load_weights

    load_weights(port.model, ref.path, mapping)
    return TorchPort(port.model, ref)


def _add_propagated(result: Diff, reference, port, mapping: Mapping, tolerances,
                    directory: Path) -> None:
    """Columns from a plain diff of the port's own run: the error each site inherited."""
    from layerdiff.capture import capture
    from layerdiff.weights import load_weights

    if isinstance(port, Case):
        load_weights(port.model, reference, mapping)
    run = capture(port, directory / "port.h5", steps=1)
    plain = diff(reference, run, mapping=mapping, tolerances=tolerances)
    keys = ["step", "site", "role", "arg"]
    merged = result.rows.merge(plain.rows[[*keys, "ratio"]].rename(
        columns={"ratio": "propagated_ratio"}), on=keys, how="left")
    rows = plain.rows[plain.rows["step"] == 0]
    inputs = rows[rows["role"] == "input"].groupby("site")["ratio"].max()
    outputs = rows[rows["role"] == "output"].groupby("site")["ratio"].max()
    with np.errstate(divide="ignore", invalid="ignore"):
        amplification = (outputs / inputs).replace([np.inf, -np.inf], np.nan)
    merged["amplification"] = merged["site"].map(amplification)
    result.rows = merged
    result.meta["propagated"] = {"verdict": plain.verdict,
                                 "origin": plain.origin.as_json() if plain.origin else None}


def local_table(result: Diff) -> pd.DataFrame:
    """One row per site and pass: local error, propagated error, amplification, verdict."""
    rows = result.rows
    if "propagated_ratio" not in rows:
        rows = rows.assign(propagated_ratio=np.nan, amplification=np.nan)
    roles = {"forward": ["output"], "backward": ["grad_input", "weight_grad"]}
    parts = []
    for pass_, wanted in roles.items():
        chosen = rows[(rows["pass"] == pass_) & rows["role"].isin(wanted)]
        grouped = chosen.groupby(["site", "port_site"], sort=False).agg(
            seq=("seq", "min"), local=("ratio", "max"), propagated=("propagated_ratio", "max"),
            amplification=("amplification", "max"),
            holds=("status", lambda s: (s == "holds-origin").any())).reset_index()
        grouped["pass"] = pass_
        parts.append(grouped)
    table = pd.concat(parts, ignore_index=True)
    table["verdict"] = np.where(
        table["holds"], "holds one", np.where(table["local"] > 1, "LOCAL ERROR", np.where(
            table["propagated"] > 1, "exonerated", "within")))
    return table.sort_values(["pass", "seq"], ascending=[False, True], kind="stable")
