"""``dead-units``: ReLU-family units whose output was exactly zero for every sample (and
position) at every step of the run: they pass no gradient, so they never come back. Watched at
each ReLU-family module's output, and at the first input of each other leaf module that no
watched module produced (a ``F.relu`` in a module's own code shows there, named ``fc2#0
input``). Thresholds, with why: docs/health.md."""

from __future__ import annotations

from layerdiff.health.record import Record
from layerdiff.health.result import Check, Verdict

# A unit with zero-mean input is off for one output with chance 1/2, for all R outputs of a
# batch with chance 2^-R: with R >= 20 a dead unit is never chance. A few dead units are
# common in a trained net; a module with a tenth dead loses a tenth of its width (warn); with
# half or more dead the layer is mostly off, and what lies before it learns through less than
# half of it (fail).
WARN_FRACTION = 0.1
FAIL_FRACTION = 0.5
MIN_ROWS = 20


def dead_units(record: Record) -> Check:
    units = [u for u in record.units if len(u.fired)]
    if not units:
        return Check("dead-units", Verdict.SKIP, "no activation was seen: no ReLU-family "
                     "module was called and no leaf module read another's output")
    steps = max(record.steps, 1)
    fractions = {u.site: u.dead / len(u.fired) for u in units}
    details = {"steps": steps, "modules": {u.site: {"type": u.type, "units": len(u.fired),
                                                   "dead": u.dead, "rows": u.rows}
                                          for u in units}}
    # a ReLU module's own site before the input of the call that reads it (same units)
    worst = max(units, key=lambda u: (fractions[u.site], not u.site.endswith(" input")))
    share = fractions[worst.site]
    said = (f"{worst.dead} of {len(worst.fired)} units ({worst.type}) never fired over "
            f"{worst.rows} outputs x {steps} step(s) ({share:.0%})")
    chance = 0.5 ** worst.rows
    if worst.rows < MIN_ROWS:
        said += f"; by chance alone {chance:.2g} of them would be"
    span = f"0-{steps - 1}" if steps > 1 else "0"
    details["span"] = span
    if share >= FAIL_FRACTION and share > 10 * chance:
        return Check("dead-units", Verdict.FAIL, said, worst.site, None, details)
    if share >= WARN_FRACTION and share > 10 * chance:
        return Check("dead-units", Verdict.WARN, said, worst.site, None, details)
    return Check("dead-units", Verdict.PASS,
                 f"{len(units)} activation(s) watched; the most dead (the site): {said}",
                 worst.site, None, details)
