"""What a diff returns: the row table, the origins, what has no partner. Plain data, no torch.

A :class:`Diff` is true when the port is within tolerance everywhere (``if diff: ...``), in
the manner of Polygraphy's comparator results.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pandas as pd

from layerdiff.compare.judge import PASSING


class Column(StrEnum):
    """The columns of :attr:`Diff.rows` (one row per compared step, site, role and tensor), in
    their order. A member is its name's string, so ``rows[Column.VERDICT]``, CSV headers and
    JSON keys read as before."""

    STEP = "step"                 # the reference's names: step, pass, seq, site, role, arg
    PASS = "pass"
    SEQ = "seq"
    SITE = "site"
    ROLE = "role"
    ARG = "arg"
    PORT_SITE = "port_site"       # how the port's record was paired
    PORT_ARG = "port_arg"
    MATCH = "match"
    CONFIDENCE = "confidence"
    SHAPE = "shape"
    PORT_SHAPE = "port_shape"
    DTYPE = "dtype"
    PORT_DTYPE = "port_dtype"
    NUMEL = "numel"
    MAX_ABS = "max_abs"
    MAX_REL = "max_rel"
    MEAN_ABS = "mean_abs"
    RMS = "rms"
    COSINE = "cosine"
    MAX_ULP = "max_ulp"
    FRAC_OUT = "frac_out"
    WORST_INDEX = "worst_index"
    RATIO = "ratio"               # max |d| / (atol + rtol|ref|)
    REF_NAN = "ref_nan"
    REF_INF = "ref_inf"
    PORT_NAN = "port_nan"
    PORT_INF = "port_inf"
    RTOL = "rtol"
    ATOL = "atol"
    TOL_SOURCE = "tol_source"
    RMS_TOL = "rms_tol"           # a baseline's rms limit
    VERDICT = "verdict"
    NOTE = "note"
    BATCH_RATIO = "batch_ratio"   # per batch element, or None
    STATUS = "status"
    CAUSE = "cause"


ROW_COLUMNS = [str(column) for column in Column]

# declared: the mapping file says this site has no partner (and why)
UNMATCHED_COLUMNS = ["side", "step", "site", "role", "arg", "reason", "declared"]

# Reference arguments the port's forward has no parameter for: left out of the input check,
# never a reason not to judge the site (the port layer computed its output from what it took).
# shape: the tensor's shape, or the recorded value (JSON) when it is no tensor.
NOT_TAKEN_COLUMNS = ["step", "site", "port_site", "role", "arg", "dtype", "shape", "reason"]


def _no_rows() -> pd.DataFrame:
    return pd.DataFrame(columns=NOT_TAKEN_COLUMNS)


class DiffVerdict(StrEnum):
    """A :class:`Diff`'s verdict (``Diff.verdict``); a string, as its JSON has it."""

    PASS = "pass"   # every compared record within tolerance
    FAIL = "fail"


@dataclass
class Origin:
    """A site whose own error is over tolerance while what came into it was within."""

    step: int
    pass_: str                  # forward | backward
    site: str                   # reference's name
    port_site: str
    role: str                   # the role that is out: output, grad_input, weight_grad, weight
    arg: str
    port_arg: str
    reason: str                 # one sentence: why this is an origin
    metrics: dict[str, Any] = field(default_factory=dict)   # the row's metrics and tolerance
    holders: list[str] = field(default_factory=list)        # containers around it that qualify
    # the likely cause, {"kind", "evidence"} (see layerdiff.compare.hints), or None
    hint: dict[str, str] | None = None
    # a multi-rank port's record cut across ranks: the ranks whose part holds the error
    ranks: list[int] | None = None
    # how the port's record lies on the ranks, and where it stands to their collectives
    # (compare/rank_parts.py); "" for a one-process port
    shards: str = ""
    # how an op site was paired with a port op of another name: by position, or as a group
    # (see layerdiff.compare.op_alignment); "" when names paired it
    pairing: str = ""
    # why this origin is offered only hedged: an earlier out-of-tolerance record lies at a
    # site that cannot be judged, and this origin may be its consequence ("" when confident)
    hedged: str = ""
    # the error along the sequence axis (compare/positions.py): the worst ratio per position
    # of axis ``position_axis`` of the origin's record; None where it has no sequence axis
    positions: list[float] | None = None
    position_axis: int | None = None
    # the routing flip its worst element lies on (layerdiff.compare.routing): {"router",
    # "port_router", "token", "position", "reference", "port", "tie", "text", "lead",
    # "baseline_command" (a tie), "outside_ratio", "confined"}, or None
    routing: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        data["positions"] = _plain(self.positions)
        return data


@dataclass
class Unjudged:
    """The first out-of-tolerance record of a diff, when it lies at a site that cannot be
    judged (what came into that site has no partner in the port): the diff's headline, since
    no later origin can be told apart from its consequence."""

    step: int
    pass_: str
    site: str                   # the site that cannot be judged (reference's name)
    port_site: str
    record_site: str            # the first failing record: its site (``site`` or inside it),
    role: str                   # role, argument and ratio
    arg: str
    ratio: float
    why: str                    # what has no partner, and the rule or adapter to write

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        data["ratio"] = _plain(self.ratio)
        return data


@dataclass
class Unjudgeable:
    """A paired site whose own code cannot be judged whatever its records hold, found before
    anything fails (``Diff.cannot_judge``, ``map-check``): an input, an incoming gradient or an
    output a gradient arrives at has no partner, or the port takes an input the reference has
    no partner for."""

    step: int
    site: str                   # reference's name
    port_site: str
    roles: list[str]            # the roles without partner: input, output, grad_output
    passes: list[str]           # the passes its own code cannot be judged in
    why: list[str]              # per record without partner: what, and the rule to write

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class DiffMeta(TypedDict, total=False):
    """What a diff says besides its rows (``Diff.meta``; in the JSON as ``meta``)."""

    loss_scale: dict[str, float]        # {"reference": s, "port": s}
    mapping: str | None                 # the mapping file (and where it came from), or None
    tolerances: dict[str, Any]          # Tolerances.as_json()
    sites: dict[str, int]               # {"reference", "port", "paired"}: site counts
    summary: bool                       # either trace holds statistics only
    baseline: dict[str, Any] | None     # {"trace", "factor"}: the precision baseline used
    warnings: list[str]                 # sentences for the user (unused rules, baseline doubts)
    precision: dict[str, Any] | None    # a port in another precision with no baseline: the advice
    routing: list[dict[str, Any]]       # routers whose top-k differ (compare.routing), per call
    padding: dict[str, Any] | None      # the padding mask and what it excused (compare.padding)
    op_pairings: list[dict[str, Any]]   # op sites paired across names (compare.op_alignment)
    ops_commands: list[str]             # captures with --ops that would name the op inside
    full_commands: list[str]            # captures with --full-around for a summary trace
    gathered: dict[str, Any]            # a gathered multi-rank port: how it was joined
    replicas: dict[str, Any] | None     # ... and its first replica disagreement, or None
    structure: str                      # ci check: what changed in the model's structure


@dataclass
class Diff:
    """The comparison of a port's trace with its reference's."""

    reference: Path
    port: Path
    rows: pd.DataFrame
    origins: list[Origin]
    unmatched: pd.DataFrame
    first_failing_step: int | None
    meta: DiffMeta = field(default_factory=DiffMeta)
    not_taken: pd.DataFrame = field(default_factory=_no_rows)  # see NOT_TAKEN_COLUMNS
    # how each row's records were paired (compare.records.RecordPair by compare.pair.row_key):
    # what compare.pair reads a row back through; not part of the JSON
    pairs: dict[tuple[int, str, str, str], Any] = field(default_factory=dict, repr=False)
    # the first failing record, when a site that cannot be judged holds it (every origin is
    # then hedged)
    cannot_judge_first: Unjudged | None = None
    # every paired site of the first step whose own code cannot be judged, failing or not
    cannot_judge: list[Unjudgeable] = field(default_factory=list)
    # what the origins were judged with besides the rows (find_origins' dropped, port_missing
    # and extra_norms): a caller that re-judges the rows (diverge's golden band) passes them
    # on, or a site whose dropped argument has no partner could no longer be judged
    judging: dict[str, Any] = field(default_factory=dict, repr=False)
    # per failing record with a sequence axis (compare/positions.py), by row key (step, site,
    # role, arg): (axis, worst ratio per position); in the JSON as "positions"
    positions: dict[tuple[int, str, str, str], tuple[int, np.ndarray]] = field(
        default_factory=dict, repr=False)
    # of those, each record the padding check read (compare/padding.py): per position, whether
    # some batch row is padding there, and the worst ratio over the padding (b, t) (NaN where
    # none); in the JSON's "positions" entries as "padding" and "padding_ratios"
    padding: dict[tuple[int, str, str, str], tuple[np.ndarray, np.ndarray]] = field(
        default_factory=dict, repr=False)

    @property
    def passed(self) -> bool:
        return bool(self.rows.empty or self.rows[Column.VERDICT].isin(PASSING).all())

    def __bool__(self) -> bool:
        return self.passed

    @property
    def verdict(self) -> DiffVerdict:
        return DiffVerdict.PASS if self.passed else DiffVerdict.FAIL

    @property
    def origin(self) -> Origin | None:
        """The first origin: earliest step, forward before backward, in execution order."""
        return self.origins[0] if self.origins else None

    def undeclared_sites(self) -> pd.DataFrame:
        """Sites with no partner that no mapping declares so: a layer missing or extra."""
        unmatched = self.unmatched
        return unmatched[(unmatched["role"] == "") & ~unmatched["declared"].astype(bool)]

    def failing(self) -> pd.DataFrame:
        """Rows out of tolerance, in order."""
        return self.rows[~self.rows[Column.VERDICT].isin(PASSING)]

    def as_json(self) -> dict[str, Any]:
        """Everything, as plain JSON types: the JSON report."""
        return {
            "verdict": self.verdict,
            "reference": str(self.reference),
            "port": str(self.port),
            "first_failing_step": self.first_failing_step,
            "origin": self.origin.as_json() if self.origin else None,
            "cannot_judge_first": (self.cannot_judge_first.as_json()
                                   if self.cannot_judge_first else None),
            "cannot_judge": [site.as_json() for site in self.cannot_judge],
            "origins": [origin.as_json() for origin in self.origins],
            "unmatched": _records(self.unmatched),
            "not_taken": _records(self.not_taken),
            "rows": _records(self.rows),
            "meta": self.meta,
            "positions": [{"step": step, "site": site, "role": role, "arg": arg, "axis": axis,
                           "ratios": _plain(ratios), **self._padding_json((step, site, role, arg))}
                          for (step, site, role, arg), (axis, ratios) in self.positions.items()],
        }

    def _padding_json(self, key: tuple[int, str, str, str]) -> dict[str, Any]:
        if key not in self.padding:
            return {}
        flags, ratios = self.padding[key]
        return {"padding": [bool(flag) for flag in flags], "padding_ratios": _plain(ratios)}


def _plain(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if np.isfinite(value) else None if np.isnan(value) else (
            "inf" if value > 0 else "-inf")
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _records(frame: pd.DataFrame) -> list[dict[str, Any]]:
    return [{key: _plain(value) for key, value in row.items()}
            for row in frame.to_dict(orient="records")]
