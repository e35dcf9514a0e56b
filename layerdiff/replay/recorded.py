"""The reference's recorded calls, as replay needs them: inputs, output gradients, nesting."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.errors import DiffError
from layerdiff.trace import Trace, schema
from layerdiff.trace.arguments import plain_value
from layerdiff.trace.schema import Role


@dataclass
class RecordedCall:
    """One call of one reference module in step 0, with the rows replay reads."""

    site: str
    module: str
    type: str
    enter_seq: int
    exit_seq: int
    inputs: list[tuple[str, pd.Series]]     # (argument, index row), in recording order
    grad_outputs: dict[str, pd.Series]      # output argument -> index row
    grad_input_args: set[str]               # arguments the reference sent a gradient to

    def contains(self, other: RecordedCall) -> bool:
        return self.enter_seq <= other.enter_seq and other.exit_seq <= self.exit_seq \
            and other is not self


def recorded_calls(ref: Trace, sites: Sequence[str] = ()) -> list[RecordedCall]:
    """Step 0's calls in call order (the loss aside); ``sites`` globs narrow them."""
    if ref.summary:
        raise DiffError(f"{ref.path} is a summary trace: replay feeds each port layer the "
                        "reference's recorded tensors, and a summary holds only statistics; "
                        "capture the reference again without --summary")
    index = ref.index[ref.index["step"] == 0]
    table = ref.sites[ref.sites["step"] == 0].sort_values("enter_seq", kind="stable")
    groups = {site: rows for site, rows in index.groupby("site", sort=False)}
    calls = []
    for row in table.itertuples(index=False):
        if (row.site == schema.LOSS_SITE or row.site not in groups
                or schema.is_op_site(row.site)):  # an op is not a layer to replay
            continue
        if sites and not any(fnmatch.fnmatchcase(row.site, glob) or fnmatch.fnmatchcase(
                row.module, glob) for glob in sites):
            continue
        rows = groups[row.site]
        calls.append(RecordedCall(
            row.site, row.module, row.type, int(row.enter_seq), int(row.exit_seq),
            [(r["arg"], r) for _, r in rows[rows["role"] == Role.INPUT].iterrows()],
            {r["arg"]: r for _, r in rows[(rows["role"] == Role.GRAD_OUTPUT)
                                          & (rows["kind"] == "tensor")].iterrows()},
            set(rows.loc[rows["role"] == Role.GRAD_INPUT, "arg"])))
    if sites and not calls:
        raise DiffError(f"--site {' '.join(sites)} matches no site of {ref.path}; its sites "
                        f"look like {', '.join(table['site'][:4])}")
    return calls


def read_array(ref: Trace, row: pd.Series) -> np.ndarray:
    """A recorded tensor, as numpy (bfloat16 widened to float32)."""
    return np.array(ref.read(row))


def read_value(ref: Trace, row: pd.Series) -> Any:
    """A recorded tensor as numpy, or a recorded plain value."""
    if row["kind"] == "tensor":
        return read_array(ref, row)
    return plain_value(row["value"], f"{ref.path} {row['site']} input {row['arg']}")


def reference_weights(ref: Trace, site: str) -> dict[str, np.ndarray]:
    """The weights the reference recorded at a site in step 0, by parameter name."""
    rows = ref.records(0, site, Role.WEIGHT)
    return {r["arg"]: read_array(ref, r) for _, r in rows.iterrows()}


def grad_outputs_at_port(call: RecordedCall, outputs: list[tuple[str, Any]],
                         renames: dict[str, str]) -> dict[str, pd.Series]:
    """The reference's recorded output gradients keyed by the port layer's output paths, paired
    by the diff's own rule (the mapping's ``outputs =`` renames, the same path, then the one
    tensor of a shape): a port that returns ``(cache, x)`` where the reference returns ``x``
    gets the gradient at ``x``, the output the diff compares, not at the cache."""
    from layerdiff.compare.records import output_partners

    port = {arg: schema.format_shape(np.shape(value)) if value is not None else ""
            for arg, value in outputs}
    ref = {arg: str(row["shape"]) for arg, row in call.grad_outputs.items()}
    partners = output_partners(ref, port, renames)
    return {partners[arg]: row for arg, row in call.grad_outputs.items()
            if partners.get(arg) in port}
