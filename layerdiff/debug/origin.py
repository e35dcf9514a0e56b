"""The diff's origin rule applied to a diagnostic's own comparison.

A diagnostic (``nan``, ``determinism``, ``batch-independence``) judges each record by its own
test: non-finite or not, the same in every run or not, free of other samples or not. It writes
its records as rows in the diff's shape, each failing or passing, and hands them to
:func:`layerdiff.compare.origins.find_origins`, the one rule: a site whose record is off while
what came into it agrees is an origin, the innermost of nested ones, and a container with no
such site inside it has the fault in its own code between its children.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pandas as pd

from layerdiff.compare import result as R
from layerdiff.compare.judge import Verdict
from layerdiff.compare.origins import Words, find_origins


@dataclass(frozen=True)
class Record:
    """One record of a diagnostic's comparison and whether it is off (``bad``)."""

    step: int
    pass_: str
    seq: int
    site: str
    role: str
    arg: str
    bad: bool
    dtype: str = "float32"


def judged_rows(records: Iterable[Record]) -> pd.DataFrame:
    """Rows in the diff's shape (:data:`layerdiff.compare.result.ROW_COLUMNS`): a bad record's
    verdict is ``out``, any other ``identical``; there is no port, so each record is its own
    partner."""
    rows = []
    for record in records:
        row: dict[str, Any] = dict.fromkeys(R.ROW_COLUMNS)
        row.update(step=int(record.step), seq=int(record.seq), site=record.site,
                   role=record.role, arg=record.arg, port_site=record.site,
                   port_arg=record.arg, dtype=record.dtype, port_dtype=record.dtype,
                   verdict=Verdict.OUT if record.bad else Verdict.IDENTICAL,
                   ref_nan=0, ref_inf=0, port_nan=0, port_inf=0, status="", cause="")
        row[R.Column.PASS] = record.pass_  # "pass" cannot be a keyword above
        rows.append(row)
    return pd.DataFrame(rows, columns=R.ROW_COLUMNS)


def sites_frame(parents: Mapping[tuple[int, str], str]) -> pd.DataFrame:
    """The sites table the rule reads nesting from: (step, site) -> the site it ran inside."""
    return pd.DataFrame([(step, site, parent) for (step, site), parent in parents.items()],
                        columns=["step", "site", "parent"])


def find_origin(records: Iterable[Record], sites: pd.DataFrame, words: Words, *,
                independent: bool = False, excused: Iterable[str] = ()) -> R.Origin | None:
    """The first origin (in the order the diff lists them) of these records, by the diff's
    rule; None when nothing is off or what is off came in from outside every site (the case's
    inputs). ``independent``: every site was tested on its own recorded inputs. ``excused``:
    sites whose records are off by design; they may be origins (so the containers around them
    are not), but are never the one named."""
    rows = judged_rows(records)
    if rows.empty:
        return None
    origins, _ = find_origins(rows, sites, independent=independent, words=words)
    excused = set(excused)
    return next((origin for origin in origins if origin.site not in excused), None)


def origin_json(origin: R.Origin | None) -> dict[str, Any] | None:
    """The diff's origin fields that apply to a diagnostic."""
    if origin is None:
        return None
    return {"site": origin.site, "pass": origin.pass_, "step": origin.step,
            "role": origin.role, "arg": origin.arg, "reason": origin.reason,
            "holders": list(origin.holders)}


__all__ = ["Record", "find_origin", "judged_rows", "origin_json", "sites_frame"]
