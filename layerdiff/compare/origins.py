"""Origins: the sites whose own error is out of tolerance while what came into them was within.

Within the first step that has anything out of tolerance (later steps inherit its divergence
through the weights):
- weights: a weight out of tolerance is an origin of its own (at step 0 the port was not
  loaded with the reference's weights; later, the optimizer step or clipping differs);
- forward, in execution order: the output is out while every input and weight is within,
  or the output holds NaN/Inf where the reference is finite while the inputs do not;
- backward, in backward execution order: ``grad_input`` or ``weight_grad`` is out while every
  ``grad_output`` is within and the site's forward was within (otherwise the backward error is
  the forward's, propagated). A ``weight_grad`` sums every call of its module, so it counts only
  when all calls received a gradient within tolerance; and a site that ran before a forward
  origin gets its gradient through that origin's backward, so it is not a backward origin;
- nesting: of a container and sites inside it that all qualify, the innermost are the origins
  and the containers are marked as holding them; a container that qualifies with no qualifying
  site inside has the fault in its own code between its children.
- no false secondary origins: a candidate whose error is no larger than what the errors
  measured on what came into it can produce (a first-order bound, see :func:`_propagated_bound`)
  is propagated, not an origin; a candidate some of whose inputs or incoming gradients have no
  partner in the port cannot be judged, and is listed as such rather than named an origin.
Every other failing row is marked as propagated from the nearest origin before it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from layerdiff.compare import result as R
from layerdiff.compare.judge import PASSING, Status
from layerdiff.compare.result import Column
from layerdiff.trace import schema
from layerdiff.trace.schema import (
    CALL_ROLES,
    COMPUTED_GRAD_ROLES,
    FORWARD_ROLES,
    GRAD_ROLES,
    PARAM_ROLES,
    Pass,
    Role,
)

# The Jacobian of a site without a weight matrix is estimated from the reference's aggregate
# gains (see _gain); the worst row's gain can be larger (a layer norm's 1/sigma is largest for
# the token with the smallest spread). Measured: an error arriving just within tolerance at a
# GPT block's first layer norm left it at 1.02x the estimate; planted bugs are 10-1000x.
GAIN_SLACK = 2.0

METRIC_KEYS = (Column.RATIO, Column.MAX_ABS, Column.MAX_REL, Column.MEAN_ABS, Column.RMS,
               Column.COSINE, Column.MAX_ULP, Column.FRAC_OUT, Column.WORST_INDEX, Column.RTOL,
               Column.ATOL, Column.TOL_SOURCE, Column.NOTE)


@dataclass
class _Site:
    """What one site's rows say, in one step."""

    name: str
    port_name: str
    order: int                       # forward order: seq of its first row
    backward_order: int = 1 << 62    # seq of its first backward row
    bad: dict[str, list[int]] = field(default_factory=dict)   # role -> failing row positions
    new_non_finite: dict[str, bool] = field(default_factory=dict)  # role -> port NaN/Inf extra
    rows: dict[str, list[int]] = field(default_factory=dict)  # role -> every compared row
    missing: set[str] = field(default_factory=set)  # roles the reference has, unpaired here
    explained: tuple[float, float] | None = None  # (error, bound) when its inputs explain it
    why_missing: list[str] = field(default_factory=list)  # what has no partner, in sentences
    handed: list[str] = field(default_factory=list)  # children whose records stand for its result

    def is_bad(self, *roles: str) -> bool:
        return any(self.bad.get(role) for role in roles)

    def lacks(self, *roles: str) -> bool:
        return any(role in self.missing for role in roles)


@dataclass(frozen=True)
class Words:
    """How a comparison calls a record that is off and one that agrees, in an origin's reason:
    the diff judges against a tolerance; a diagnostic by its own test (finite or not, the same
    in every run, free of other samples). ``weights``: the reason of a weight origin at step 0
    and at a later step ``{step}``."""

    out: str = "out of tolerance"
    within: str = "within"
    short: str = "out"          # "no site inside it is <short> on its own"
    weights: tuple[str, str] = (
        "its weights differ before anything ran: the port was not given the reference's "
        "weights (capture it with --weights-from and the mapping)",
        "its weights differ at the start of step {step} while every earlier step was within "
        "tolerance: the optimizer step, gradient clipping or unscaling differs")


TOLERANCE = Words()


def find_origins(rows: pd.DataFrame, ref_sites: pd.DataFrame, *, independent: bool = False,
                 ref_index: pd.DataFrame | None = None,
                 dropped: set[tuple[int, str, str, str]] | None = None,
                 port_missing: list[tuple[int, str, str, str, str]] | None = None,
                 extra_norms: dict[tuple[int, str, str, str], float] | None = None,
                 words: Words = TOLERANCE) -> tuple[list[R.Origin], int | None]:
    """Origins of the first failing step; fills ``status`` and ``cause`` of ``rows``.

    ``independent``: every site ran on the reference's own inputs and gradients (a replay), so
    no site's backward inherits another's error and every qualifying site is an origin.
    ``ref_index``: the reference's index, to tell a site whose inputs have no partner (it
    cannot be judged) and to bound the error its inputs can produce (their norms).
    ``dropped``: reference records (step, site, role, arg) whose lack of a partner never keeps
    their site from being judged (arguments the port does not take, outputs without partner
    and their gradients, records the mapping declares). ``port_missing``: port inputs that
    nothing pairs, (step, reference site, port site, port argument, its name): their site
    cannot be judged. ``extra_norms``: L2 norms of compared reference tensors the index lacks (what
    a call adapter made), keyed as ``dropped``. ``words``: how the reasons call a failing record
    (a diagnostic's rows fail by its own test, not a tolerance).

    A diagnostic applies the same rule to its own comparison: ``rows`` need only ``step``,
    ``pass``, ``seq``, ``site``, ``port_site``, ``role``, ``arg``, ``port_arg``, ``dtype``,
    ``verdict`` (failing when not in ``PASSING``), ``status`` and ``cause`` (see
    :func:`layerdiff.debug.origin.judged_rows`), and ``ref_sites`` ``step``, ``site`` and
    ``parent``."""
    failing = ~rows[Column.VERDICT].isin(PASSING)
    if not failing.any():
        return [], None
    step = int(rows.loc[failing, Column.STEP].min())
    in_step = rows.index[rows[Column.STEP] == step]
    sites = _collect(rows, in_step)
    norms: dict[int, float] = {}
    if ref_index is not None:
        _find_missing(sites, rows, ref_index, step, dropped or set())
    _port_only(sites, step, port_missing or [])
    if ref_index is not None:
        norms = _norms(rows, in_step, ref_index, extra_norms or {})
    parents = _parents(ref_sites, step)
    _root_output_feeds_loss(sites)
    _unrecorded_results(rows, sites, parents)

    weight_origins = [s for s in sites.values() if s.is_bad(Role.WEIGHT)]
    forward_all = [s for s in sites.values() if _forward_candidate(s)]
    backward_all = [s for s in sites.values() if _backward_candidate(s, sites, independent)]
    unjudged = [s for s in forward_all + backward_all if _cannot_judge(s)]
    blocked = _blocked(forward_all, backward_all, unjudged, parents)
    forward = [s for s in forward_all if s not in blocked[Pass.FORWARD]]
    backward = [s for s in backward_all if s not in blocked[Pass.BACKWARD]]
    if norms and not independent:
        forward = _unexplained(rows, forward, (Role.OUTPUT,), norms, sites)
        backward = _unexplained(rows, backward, COMPUTED_GRAD_ROLES, norms, sites)
    # The gradient reaching a site that ran before a forward origin has passed through that
    # origin's backward: small errors there, summed into a weight gradient, are its doing.
    last_forward = -1 if independent else max((s.order for s in forward), default=-1)
    backward = [s for s in backward if s.order > last_forward]
    origins: list[R.Origin] = []
    # A site with wrong weights is an origin of its own; for nesting it qualifies like a
    # forward candidate, so the containers around it hold it rather than become origins.
    _, weight_holders = _innermost(weight_origins + forward, parents)
    for site in sorted(weight_origins, key=lambda s: s.order):
        origin = _origin(rows, site, step, Role.WEIGHT,
                         _weight_reason(step, _previous_step(rows, step), words))
        origin.holders = sorted(weight_holders.get(site.name, []))
        origins.append(origin)
    origins += _pass_origins(rows, forward, backward, weight_origins, parents, sites, step,
                             words)
    _mark_unjudged(rows, unjudged, blocked)
    _mark(rows, origins, sites, step, failing)
    return origins, step


def _blocked(forward: list[_Site], backward: list[_Site], unjudged: list[_Site],
             parents: dict[str, str]) -> dict[str, list[_Site]]:
    """Per pass, the candidates that cannot be judged and the containers around them.

    A container around a site that cannot be judged cannot be judged either, in that pass:
    the fault may be that site's (an attention whose rotary tables have no partner, inside
    its block). A child unjudged only backward (a weight gradient at a projection whose
    output has no partner) says nothing of the container's forward."""
    blocked: dict[str, list[_Site]] = {}
    for pass_, candidates in ((Pass.FORWARD, forward), (Pass.BACKWARD, backward)):
        inner = [s for s in candidates if s in unjudged]
        around = {a: s.name for s in inner for a in _ancestors(s.name, parents)}
        blocked[pass_] = list(inner)
        for site in candidates:
            if site.name in around and site not in unjudged:
                site.why_missing.append(f"it holds {around[site.name]}, which cannot be judged")
                blocked[pass_].append(site)
    return blocked


def _pass_origins(rows: pd.DataFrame, forward: list[_Site], backward: list[_Site],
                  weight_origins: list[_Site], parents: dict[str, str],
                  sites: dict[str, _Site], step: int, words: Words) -> list[R.Origin]:
    """The forward origins (innermost, a site with wrong weights counting as one for
    nesting), then the backward ones, each in its pass's order."""
    origins: list[R.Origin] = []
    for group, role_order, reason in ((forward, (Role.OUTPUT,), _forward_reason),
                                      (backward, COMPUTED_GRAD_ROLES,
                                       _backward_reason)):
        if group is forward:
            innermost, holders = _innermost(weight_origins + forward, parents)
            innermost = [s for s in innermost if s in forward]
        else:
            innermost, holders = _innermost(group, parents)
        key = (lambda s: s.order) if role_order == (Role.OUTPUT,) else (
            lambda s: s.backward_order)
        for site in sorted(innermost, key=key):
            role = next(r for r in role_order if site.is_bad(r))
            text = reason(site, parents, sites, words)
            if site.explained is not None:
                text += (f"; its error ({site.explained[0]:.3g}) is within what the errors "
                         f"arriving at it can produce ({site.explained[1]:.3g}), but nothing "
                         "before it is out: the difference began below tolerance upstream")
            origin = _origin(rows, site, step, role, text)
            origin.holders = sorted(holders.get(site.name, []))
            origins.append(origin)
    return origins


def unjudgeable_sites(rows: pd.DataFrame, ref_index: pd.DataFrame, *,
                      dropped: set[tuple[int, str, str, str]],
                      port_missing: list[tuple[int, str, str, str, str]],
                      step: int | None = None) -> list[R.Unjudgeable]:
    """Every paired site of ``step`` (default: the first) whose own code cannot be judged,
    whatever its records hold, with why and the rule or adapter to write: an input or an
    incoming gradient without partner, an output a gradient arrives at without partner, a
    port input that nothing in the reference pairs with. The same notes :func:`find_origins`
    gives a failing site as its "cannot judge" cause, so that ``map-check`` can say them before
    any record fails. Arguments as :func:`find_origins`'s."""
    if rows.empty:
        return []
    step = int(rows[Column.STEP].min()) if step is None else step
    in_step = rows.index[rows[Column.STEP] == step]
    sites = _collect(rows, in_step)
    _find_missing(sites, rows, ref_index, step, dropped)
    _port_only(sites, step, port_missing)
    # a site the mapping leaves unpaired may still have its weights compared (through a
    # [[param]] rule): it is listed as unmatched, not as a pair that cannot be judged
    frame = rows.loc[in_step]
    paired = set(frame.loc[~frame[Column.ROLE].isin(PARAM_ROLES), Column.SITE])
    found = []
    for site in sorted(sites.values(), key=lambda s: s.order):
        if not site.missing or site.name not in paired:
            continue
        passes = [pass_ for pass_, roles in ((Pass.FORWARD, (Role.INPUT,)),
                                             (Pass.BACKWARD, (Role.INPUT, Role.GRAD_OUTPUT)))
                  if site.lacks(*roles)]
        found.append(R.Unjudgeable(step, site.name, site.port_name, sorted(site.missing),
                                   passes, list(dict.fromkeys(site.why_missing))))
    return found


def _port_only(sites: dict[str, _Site], step: int,
               port_missing: list[tuple[int, str, str, str, str]]) -> None:
    """Note the port's inputs that nothing in the reference pairs with: their site cannot be
    judged until a call adapter makes them from the reference's arguments, or the mapping
    declares them the port's own."""
    lone: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for missing_step, site, port_site, arg, name in port_missing:
        if missing_step == step and site in sites:
            lone.setdefault((site, port_site), []).append((arg, name))
    for (site, port_site), inputs in lone.items():
        sites[site].missing.add(Role.INPUT)
        sites[site].why_missing.append(_port_only_input(site, port_site, inputs))


def _port_only_input(site: str, port_site: str, inputs: list[tuple[str, str]]) -> str:
    """What a port input without partner keeps from judging, the right way round (the port has
    it, the reference does not), and the two rules that end it: an adapter on the site's
    [[site]] rule (named by the reference's module), or a declaration on the port's module."""
    one = len(inputs) == 1
    module = schema.split_site(port_site)[0]
    names = ", ".join(repr(name) for _, name in inputs)
    declare = "; ".join(f'[[unmatched]] port = "{module}" input = "{arg}"'
                        for arg, _ in inputs)
    return (f"the port's {'input' if one else 'inputs'} {names} at {port_site} "
            f"{'has' if one else 'have'} no partner in the reference: write a call adapter "
            f"that makes {'it' if one else 'them'} from the reference's arguments (call = "
            f"\"pkg.module:function\" on a [[site]] rule for {schema.split_site(site)[0]}; see "
            f"docs/diff.md), or, "
            f"where the port makes {'it' if one else 'them'} from nothing the reference passes, "
            f"declare {'it' if one else 'each'} the port's own ({declare})")


def first_unjudged(rows: pd.DataFrame, ref_sites: pd.DataFrame, origins: list[R.Origin],
                   step: int | None) -> R.Unjudged | None:
    """The first out-of-tolerance record of ``step`` (the forward's in execution order, else
    the backward's) when it lies at or inside a site that cannot be judged (``rows`` as
    :func:`find_origins` marked them): an attention whose inputs have no partner makes its
    output projection's input wrong before its own output. Every origin then comes after that
    record and may be its consequence: each is marked ``hedged`` saying so."""
    if step is None:
        return None
    failing = rows[(rows[Column.STEP] == step) & ~rows[Column.VERDICT].isin(PASSING)]
    forward = failing[failing[Column.PASS] == Pass.FORWARD]
    ordered = (forward if len(forward) else failing).sort_values(Column.SEQ, kind="stable")
    if ordered.empty or ordered.iloc[0][Column.STATUS] in (Status.ORIGIN,
                                                           Status.HOLDS_ORIGIN):
        return None
    first = ordered.iloc[0]
    in_pass = failing[(failing[Column.PASS] == first[Column.PASS])
                      & (failing[Column.STATUS] == Status.CANNOT_JUDGE)]
    unjudged = dict(zip(in_pass[Column.SITE], zip(in_pass[Column.PORT_SITE],
                                                  in_pass[Column.CAUSE], strict=True),
                        strict=True))
    record_site = str(first[Column.SITE])
    site = next((s for s in (record_site, *_ancestors(record_site, _parents(ref_sites, step)))
                 if s in unjudged), None)
    if site is None:
        return None
    port_site, why = unjudged[site]
    found = R.Unjudged(step, str(first[Column.PASS]), site, str(port_site), record_site,
                       str(first[Column.ROLE]), str(first[Column.ARG]),
                       _ratio(first[Column.RATIO]), str(why))
    for origin in origins:
        origin.hedged = (f"after the first record out, {record_site} {found.pass_} "
                         f"{found.role} '{found.arg}' ({found.ratio:.3g}x), inside {site}, "
                         "which cannot be judged: this origin may be its consequence")
    return found


def _collect(rows: pd.DataFrame, positions: pd.Index) -> dict[str, _Site]:
    """Rows grouped by the port site they compare with, named by its reference partner.

    Grouping by the port's site puts a parameter compared through a mapping (the reference's
    ``w_q.weight`` with a slice of the port's fused ``in_proj_weight``) with the site that
    uses it in the port."""
    frame = rows.loc[positions]
    params = frame[Column.ROLE].isin(PARAM_ROLES)
    partner = dict(zip(frame.loc[~params, Column.PORT_SITE], frame.loc[~params, Column.SITE],
                       strict=True))
    sites: dict[str, _Site] = {}
    for pos, site, port_site, role, seq, verdict, ref_bad, port_bad in zip(
            frame.index, frame[Column.SITE], frame[Column.PORT_SITE], frame[Column.ROLE],
            frame[Column.SEQ], frame[Column.VERDICT],
            frame[Column.REF_NAN].fillna(0) + frame[Column.REF_INF].fillna(0),
            frame[Column.PORT_NAN].fillna(0) + frame[Column.PORT_INF].fillna(0), strict=True):
        name = partner.get(port_site, site)
        entry = sites.get(name)
        if entry is None:
            entry = sites[name] = _Site(name, port_site, int(seq))
        if role in (Role.GRAD_OUTPUT, Role.GRAD_INPUT):
            entry.backward_order = min(entry.backward_order, int(seq))
        entry.rows.setdefault(role, []).append(pos)
        if verdict not in PASSING:
            entry.bad.setdefault(role, []).append(pos)
        if port_bad > ref_bad and verdict not in PASSING:  # a NaN only where nothing reads
            entry.new_non_finite[role] = True             # it passes (padding-only)
    return sites


def _find_missing(sites: dict[str, _Site], rows: pd.DataFrame, ref_index: pd.DataFrame,
                  step: int, dropped: set[tuple[int, str, str, str]]) -> None:
    """Note, per site, the roles with a floating-point reference tensor that has no partner
    in the port (unmatched, or declared so) and whose values no paired record of the same site
    and role holds (``attn(x, x, x)`` pairs one of three equal inputs). An argument the
    mapping drops (``dropped``: the port computes what it holds itself) is not missing."""
    wanted = ref_index[(ref_index["step"] == step) & (ref_index["kind"] == "tensor")
                       & ref_index["role"].isin([Role.INPUT, Role.GRAD_OUTPUT, Role.OUTPUT])
                       & ref_index["dtype"].str.contains("float")]
    frame = rows[rows[Column.STEP] == step]
    paired = set(zip(frame[Column.SITE], frame[Column.ROLE], frame[Column.ARG], strict=True))
    digests: dict[tuple[str, str], set[str]] = {}
    unpaired = []
    for site, role, arg, digest in zip(wanted["site"], wanted["role"], wanted["arg"],
                                       wanted["digest"], strict=True):
        if (site, role, arg) in paired:
            digests.setdefault((site, role), set()).add(digest)
        elif (step, site, role, arg) not in dropped:
            unpaired.append((site, role, arg, digest))
    root = f"{schema.ROOT_MODULE}#0"
    # what the loss takes: the model's outputs that a gradient arrived at
    fed = set(wanted.loc[(wanted["site"] == root) & (wanted["role"] == Role.GRAD_OUTPUT), "arg"])
    for site, role, arg, digest in unpaired:
        if digest in digests.get((site, role), set()):
            continue
        if site == root and role == Role.OUTPUT:
            if arg in fed and schema.LOSS_SITE in sites:
                sites[schema.LOSS_SITE].missing.add(Role.INPUT)
                sites[schema.LOSS_SITE].why_missing.append(
                    f"the model's output '{arg}', which the loss takes, has no partner in the "
                    "port (name its partner with outputs = { ... } on a [[site]] rule for "
                    "<root>)")
        elif site in sites:
            sites[site].missing.add(role)
            sites[site].why_missing.append(_no_partner(site, role, arg))


def _no_partner(site: str, role: str, arg: str) -> str:
    """What a reference record without a partner keeps from judging, and the rule to write."""
    module = schema.split_site(site)[0]
    if role == Role.INPUT:
        rule = (f"name its port argument (args = {{ {arg} = \"...\" }}) or build the port's "
                f"call with a call adapter (call = \"pkg.module:function\") on a [[site]] rule "
                f"for {module}")
    elif role == Role.OUTPUT:
        rule = (f"name its partner (outputs = {{ {arg} = \"...\" }} on a [[site]] rule for "
                f"{module}), or declare it [[unmatched]] reference = \"{module}\" "
                f"output = \"{arg}\" if the port has none")
    else:
        rule = (f"the gradient arrives at its output '{arg}', which needs a partner (outputs = "
                f"{{ ... }} on a [[site]] rule for {module})")
    return f"its {role} '{arg}' has no partner in the port: {rule}"


def _cannot_judge(site: _Site) -> bool:
    """Whether what comes into the failing record has no partner to be judged against."""
    if site.is_bad(Role.OUTPUT) and not site.is_bad(*COMPUTED_GRAD_ROLES):
        return site.lacks(Role.INPUT)
    return site.lacks(Role.GRAD_OUTPUT, Role.INPUT)


def _norms(rows: pd.DataFrame, positions: pd.Index, ref_index: pd.DataFrame,
           extra: dict[tuple[int, str, str, str], float]) -> dict[int, float]:
    """Row position -> L2 norm of its reference tensor (the index has it for every record;
    ``extra``, for what a call adapter made)."""
    keys = zip(ref_index["step"], ref_index["site"], ref_index["role"], ref_index["arg"],
               strict=True)
    l2 = dict(extra)
    l2.update(zip(keys, ref_index["l2"], strict=True))
    frame = rows.loc[positions]
    return {pos: float(l2.get((int(step), site, role, arg), np.nan))
            for pos, step, site, role, arg in zip(
                frame.index, frame[Column.STEP], frame[Column.SITE], frame[Column.ROLE],
                frame[Column.ARG], strict=True)}


def _error(rows: pd.DataFrame, positions: list[int]) -> float:
    """Frobenius norm of the error over these rows (rms x sqrt(size)); NaN if any is unknown
    (a statistics-only row has no rms)."""
    parts = []
    for pos in positions:
        rms = rows.at[pos, Column.RMS]
        if rms is None or not np.isfinite(rms):
            return np.nan
        parts.append(float(rms) * math.sqrt(int(rows.at[pos, Column.NUMEL])))
    return math.hypot(*parts)  # no square overflows: float64 errors near the largest value


def _norm(norms: dict[int, float], positions: list[int]) -> float:
    return math.hypot(*(norms.get(p, np.nan) for p in positions))


def _float_inputs(rows: pd.DataFrame, site: _Site) -> list[int]:
    """A site's input rows that carry errors (token ids and masks do not)."""
    return [p for p in site.rows.get(Role.INPUT, [])
            if str(rows.at[p, Column.DTYPE]).startswith(("float", "bfloat", "complex"))]


def _propagated_bound(rows: pd.DataFrame, site: _Site, role: str, norms: dict[int, float],
                      sites: dict[str, _Site]) -> float:
    """A first-order bound on the error (Frobenius norm) that the errors measured on what came
    into ``site`` can produce in its ``role`` records.

    Every bound is Cauchy-Schwarz on a product: for ``z = a . b`` (a sum of products over an
    inner index: a matmul, a convolution, a weight gradient summed over batch and positions),
    ``|dz| <= |da| |b| + |a| |db| + |da| |db|`` in Frobenius norms, whatever the inner size.
    - weight_grad = sum over every call and position of grad_output x input:
      ``a`` = the grad_outputs, ``b`` = the float inputs, over all calls of the module;
    - grad_input = grad_output through the site's Jacobian; output = inputs through the site:
      with weights of its own (a matrix), ``b`` is those weights; without, the Jacobian's size
      is taken from the reference's own gain (|grad_input| / |grad_output|, |output| / |input|),
      an estimate for element-wise and container sites, and the inputs' relative error carries
      over at that gain.
    """
    float_rows = _float_inputs(rows, site)
    if role == Role.WEIGHT_GRAD:
        module = schema.split_site(site.name)[0]
        calls = [s for n, s in sites.items() if schema.split_site(n)[0] == module] or [site]
        bound = 0.0
        for call in calls:
            grads = call.rows.get(Role.GRAD_OUTPUT, [])
            inputs = _float_inputs(rows, call)
            e_a, n_a = _error(rows, grads), _norm(norms, grads)
            e_b, n_b = _error(rows, inputs), _norm(norms, inputs)
            bound += e_a * n_b + n_a * e_b + e_a * e_b
        return bound
    incoming = site.rows.get(Role.GRAD_OUTPUT, []) if role == Role.GRAD_INPUT else float_rows
    outgoing = site.rows.get(role, [])
    weights = site.rows.get(Role.WEIGHT, [])
    matrices = [p for p in weights if len(str(rows.at[p, Column.SHAPE]).split(",")) >= 2]
    e_a, n_a = _error(rows, incoming), _norm(norms, incoming)
    e_w, n_w = _error(rows, weights), _norm(norms, weights)
    if matrices:
        bound = e_a * n_w + n_a * e_w + e_a * e_w
    else:
        bound = GAIN_SLACK * e_a * _gain(site, norms, float_rows) + _norm(norms, outgoing) * (
            e_w / n_w if n_w > 0 else 0.0)
    if role == Role.GRAD_INPUT:  # the forward inputs' error changes the Jacobian itself
        e_x, n_x = _error(rows, float_rows), _norm(norms, float_rows)
        bound += _norm(norms, outgoing) * (e_x / n_x if n_x > 0 else 0.0)
    return bound


def _gain(site: _Site, norms: dict[int, float], float_inputs: list[int]) -> float:
    """An estimate of the size of a site's Jacobian, from the reference's own tensors: the
    larger of its forward gain (|output| / |input|) and its backward gain (|grad_input| /
    |grad_output|). A linear map and its transpose have the same norm, and either gain alone
    can miss it: a layer norm's backward removes the mean of the gradient it receives, so its
    backward gain is small while an error arriving there passes at 1/sigma, its forward gain."""
    gains = []
    for out, into in ((site.rows.get(Role.OUTPUT, []), float_inputs),
                      (site.rows.get(Role.GRAD_INPUT, []), site.rows.get(Role.GRAD_OUTPUT, []))):
        n_in = _norm(norms, into)
        if out and into and n_in > 0:
            gains.append(_norm(norms, out) / n_in)
    finite = [g for g in gains if np.isfinite(g)]
    return max(finite) if finite else np.inf


def _unexplained(rows: pd.DataFrame, candidates: list[_Site], roles: tuple[str, ...],
                 norms: dict[int, float], sites: dict[str, _Site]) -> list[_Site]:
    """The candidates whose failing records hold more error than what came into them can
    produce; when none does, the first candidate stays (the difference began below tolerance
    before it, and it is where it first shows)."""
    kept = []
    for site in candidates:
        role = next(r for r in roles if site.is_bad(r))
        error = _error(rows, site.bad[role])
        bound = _propagated_bound(rows, site, role, norms, sites)
        if not (np.isfinite(error) and np.isfinite(bound)) or error > bound:
            kept.append(site)
        else:
            site.explained = (error, bound)
    if not kept and candidates:
        first = min(candidates, key=lambda s: s.order if Role.OUTPUT in roles
                    else s.backward_order)
        kept.append(first)
    return kept


_PASS_ROLES = {Pass.FORWARD: CALL_ROLES,
               Pass.BACKWARD: GRAD_ROLES}


def _mark_unjudged(rows: pd.DataFrame, unjudged: list[_Site],
                   blocked: dict[str, list[_Site]]) -> None:
    """Every failing row of a site that cannot be judged; of a container blocked by a child,
    the rows of the pass it is blocked in."""
    for site in unjudged:
        _mark_rows(rows, site, site.bad)
    for pass_, sites in blocked.items():
        for site in sites:
            if site not in unjudged:
                _mark_rows(rows, site, {role: site.bad[role] for role in _PASS_ROLES[pass_]
                                        if role in site.bad})


def _mark_rows(rows: pd.DataFrame, site: _Site, bad: dict[str, list[int]]) -> None:
    cause = "; ".join(site.why_missing) or "what comes into it has no partner"
    for positions in bad.values():
        for pos in positions:
            rows.at[pos, Column.STATUS] = Status.CANNOT_JUDGE
            rows.at[pos, Column.CAUSE] = cause


def _parents(ref_sites: pd.DataFrame, step: int) -> dict[str, str]:
    in_step = ref_sites[ref_sites["step"] == step]
    return dict(zip(in_step["site"], in_step["parent"], strict=True))


def _root_output_feeds_loss(sites: dict[str, _Site]) -> None:
    """The loss records no inputs: what goes into it is the model's output."""
    loss, root = sites.get(schema.LOSS_SITE), sites.get(f"{schema.ROOT_MODULE}#0")
    if loss is not None and root is None:
        # the model's output was not captured (--include): blame nothing on the loss unless
        # every other forward record was within
        earlier = [p for s in sites.values() if s is not loss
                   for role in FORWARD_ROLES for p in s.bad.get(role, [])]
        if earlier:
            loss.bad.setdefault(Role.INPUT, []).extend(earlier)
    if loss is not None and root is not None:
        if root.is_bad(Role.OUTPUT):
            loss.bad.setdefault(Role.INPUT, []).extend(root.bad[Role.OUTPUT])
        if root.new_non_finite.get(Role.OUTPUT):
            loss.new_non_finite[Role.INPUT] = True


def _unrecorded_results(rows: pd.DataFrame, sites: dict[str, _Site],
                        parents: dict[str, str]) -> None:
    """A container's own code makes more than its result: it also makes what it hands its
    children, a child's ``input`` (forward) or ``grad_output`` (backward: the gradient an
    attention's softmax and rotary backward send its q/k projections). Such a record that is
    off while what came into the container before it (its inputs and weights, or the gradient
    at its outputs, and its children's results recorded earlier) agrees was made wrong by the
    container's own code, whatever its result record says: there is none (no ``grad_input``
    where its inputs need no gradient, no ``output`` where it was not captured), or it is
    within (a bfloat16 baseline allows the sum of q/k/v's input gradients more than each
    part). Those child records then count as the container's result; without this the child's
    record is out with its incoming gradient as its only cause, and nothing is named."""
    children: dict[str, list[_Site]] = {}
    for site in sites.values():
        if parents.get(site.name) in sites:
            children.setdefault(parents[site.name], []).append(site)
    for name, inside in children.items():
        site = sites[name]
        for result, handed, came, returned in (
                (Role.OUTPUT, Role.INPUT, (Role.INPUT, Role.WEIGHT), Role.OUTPUT),
                (Role.GRAD_INPUT, Role.GRAD_OUTPUT, (Role.GRAD_OUTPUT,), Role.GRAD_INPUT)):
            if site.is_bad(result, *came):
                continue  # a result already out makes the container a candidate as it is
            if result == Role.GRAD_INPUT and any(  # a backward inherits its forward's error
                    s.is_bad(*FORWARD_ROLES) for s in [site, *inside]):
                continue
            bad = sorted(p for child in inside for p in child.bad.get(handed, []))
            if not bad:
                continue
            seq = min(rows.at[p, Column.SEQ] for p in bad)
            if any(rows.at[p, Column.SEQ] < seq for child in inside
                   for p in child.bad.get(returned, [])):
                continue  # a child's own result came first: the fault may be that child's
            site.bad[result] = bad
            site.rows[result] = [*site.rows.get(result, []), *bad]
            site.handed = sorted({rows.at[p, Column.SITE] for p in bad})


def _forward_candidate(site: _Site) -> bool:
    if site.is_bad(Role.WEIGHT):
        return False
    if site.is_bad(Role.OUTPUT) and not site.is_bad(Role.INPUT):
        return True
    return bool(site.new_non_finite.get(Role.OUTPUT) and not site.new_non_finite.get(Role.INPUT))


def _backward_candidate(site: _Site, sites: dict[str, _Site], independent: bool) -> bool:
    if site.is_bad(Role.GRAD_OUTPUT, *FORWARD_ROLES):
        return False
    if site.is_bad(Role.GRAD_INPUT):
        return True
    if not site.is_bad(Role.WEIGHT_GRAD):
        return False
    if independent:
        return True
    module = schema.split_site(site.name)[0]
    return not any(other.is_bad(Role.GRAD_OUTPUT) for name, other in sites.items()
                   if schema.split_site(name)[0] == module)


def _ancestors(name: str, parents: dict[str, str]) -> list[str]:
    chain, seen = [], set()
    while (name := parents.get(name, "")) and name not in seen:
        seen.add(name)
        chain.append(name)
    return chain


def _innermost(group: list[_Site], parents: dict[str, str]
               ) -> tuple[list[_Site], dict[str, list[str]]]:
    """The candidates with no candidate inside them, and for each the containers around it."""
    names = {s.name for s in group}
    holders_of: dict[str, list[str]] = {}
    holding: set[str] = set()
    for site in group:
        around = [a for a in _ancestors(site.name, parents) if a in names]
        holders_of[site.name] = around
        holding.update(around)
    inner = [s for s in group if s.name not in holding]
    return inner, {s.name: holders_of[s.name] for s in inner}


def _has_children(name: str, parents: dict[str, str], sites: dict[str, _Site]) -> bool:
    """Whether any compared site runs inside this one."""
    return any(parent == name for child, parent in parents.items() if child in sites)


def _has_ops(name: str, parents: dict[str, str], sites: dict[str, _Site]) -> bool:
    """Whether op sites of this call's own code were compared (captured with --ops)."""
    return any(parent == name and schema.is_op_site(child)
               for child, parent in parents.items() if child in sites)


# Said of a call whose own code holds the fault when its ops were captured and none is out on
# its own: what --ops skips (views, indexing) is where it can be.
_NO_OP_OUT = ("; no op of its own code is {short} on its own either, so the fault is in a view "
              "or indexing op that --ops skips (capture with --ops-all to record them) or in an "
              "op whose arguments have no partner")


def _forward_reason(site: _Site, parents: dict[str, str], sites: dict[str, _Site],
                    words: Words = TOLERANCE) -> str:
    if site.new_non_finite.get(Role.OUTPUT):
        return "its output holds NaN or Inf where the reference is finite, while its inputs do not"
    if site.handed:
        return (f"the input it hands {', '.join(site.handed)} is {words.out} while all its "
                f"inputs and weights are {words.within}: the fault is in its own code between "
                "its children")
    text = f"its output is {words.out} while all its inputs and weights are {words.within}"
    if _has_ops(site.name, parents, sites):
        text += _NO_OP_OUT.format(short=words.short)
    elif _has_children(site.name, parents, sites):
        text += (f"; no site inside it is {words.short} on its own, so the fault is in its own "
                 "code between its children")
    return text


def _backward_reason(site: _Site, parents: dict[str, str], sites: dict[str, _Site],
                     words: Words = TOLERANCE) -> str:
    role = Role.GRAD_INPUT if site.is_bad(Role.GRAD_INPUT) else Role.WEIGHT_GRAD
    if site.handed:
        return (f"the gradient it sends back to {', '.join(site.handed)} is {words.out} while "
                f"the gradient arriving at its outputs and its forward are {words.within}: the "
                "fault is in its own backward code between its children")
    text = (f"its {role} is {words.out} while the gradient arriving at its outputs and "
            f"its forward are {words.within}")
    if _has_ops(site.name, parents, sites):
        text += _NO_OP_OUT.format(short=words.short).replace(
            "view or indexing op", "view or indexing op's backward")
    elif _has_children(site.name, parents, sites):
        text += (f"; no site inside it is {words.short} on its own, so the fault is in its own "
                 "backward code between its children")
    return text


def _previous_step(rows: pd.DataFrame, step: int) -> int | None:
    """The last step before ``step`` that both sides recorded, if any."""
    earlier = rows.loc[rows[Column.STEP] < step, Column.STEP]
    return int(earlier.max()) if len(earlier) else None


def _weight_reason(step: int, previous: int | None, words: Words = TOLERANCE) -> str:
    if step == 0:
        return words.weights[0]
    if previous == step - 1:
        return words.weights[1].format(step=step)
    # steps in between were not recorded (a monitor's every=K, a window): the runs may have
    # parted in any of them, in the forward as well as in the optimizer
    since = "the first step recorded" if previous is None else (
        f"the first step recorded after step {previous}, which was {words.within}")
    return (f"its weights differ at the start of step {step}, {since}: the runs parted in a "
            "step that was not recorded, in its forward, backward or optimizer step; record "
            f"the steps up to {step} (every=1, or capture --steps {step + 1}) to see where")


def _origin(rows: pd.DataFrame, site: _Site, step: int, role: str, reason: str) -> R.Origin:
    positions = site.bad[role]
    worst = max(positions, key=lambda p: _ratio(rows.at[p, Column.RATIO]))
    row = rows.loc[worst]
    metrics = {key: _plain(row[key]) for key in METRIC_KEYS}
    batch = row[Column.BATCH_RATIO]
    metrics[Column.BATCH_RATIO] = None if batch is None else [float(x) for x in batch]
    arg = str(row[Column.ARG])
    if role in PARAM_ROLES and row[Column.SITE] != site.name:
        # compared through the mapping: name the tensor
        arg = schema.param_name(row[Column.SITE], arg)
    return R.Origin(step, str(row[Column.PASS]), site.name, site.port_name, role, arg,
                    str(row[Column.PORT_ARG]), reason, metrics)


def _ratio(value) -> float:
    value = float(value) if value is not None else 0.0
    return np.inf if np.isnan(value) else value


def _plain(value):
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    return value


def _mark(rows: pd.DataFrame, origins: list[R.Origin], sites: dict[str, _Site], step: int,
          failing: pd.Series) -> None:
    """Status and cause of every failing row."""
    origin_rows: dict[int, R.Origin] = {}
    for origin in origins:
        for pos in sites[origin.site].bad.get(origin.role, []):
            origin_rows[pos] = origin
        for holder in origin.holders:
            for positions in sites[holder].bad.values():
                for pos in positions:
                    rows.at[pos, Column.STATUS] = Status.HOLDS_ORIGIN
                    rows.at[pos, Column.CAUSE] = origin.site
    first = origins[0] if origins else None
    forward = [o for o in origins if o.pass_ == Pass.FORWARD]
    order_of = {pos: site.backward_order for site in sites.values()
                for pos in site.bad.get(Role.WEIGHT_GRAD, [])}
    ordered = sorted(origins, key=lambda o: _first_seq(rows, sites, o))
    for pos in rows.index[failing]:
        if pos in origin_rows:
            rows.at[pos, Column.STATUS] = Status.ORIGIN
            rows.at[pos, Column.CAUSE] = origin_rows[pos].site
            continue
        if rows.at[pos, Column.STATUS]:
            continue
        rows.at[pos, Column.STATUS] = Status.PROPAGATED
        if rows.at[pos, Column.STEP] != step:
            rows.at[pos, Column.CAUSE] = f"step {step}" + (f" ({first.site})" if first else "")
            continue
        seq = rows.at[pos, Column.SEQ]
        if rows.at[pos, Column.ROLE] == Role.WEIGHT_GRAD:  # recorded after the whole backward
            seq = order_of.get(pos, seq)
        before = [o for o in ordered if _first_seq(rows, sites, o) <= seq
                  and (o.pass_ == rows.at[pos, Column.PASS] or o.pass_ == Pass.FORWARD)]
        cause = before[-1] if before else (forward[0] if forward else first)
        rows.at[pos, Column.CAUSE] = cause.site if cause else ""


def _first_seq(rows: pd.DataFrame, sites: dict[str, _Site], origin: R.Origin) -> int:
    return int(min(rows.at[p, Column.SEQ] for p in sites[origin.site].bad[origin.role]))
