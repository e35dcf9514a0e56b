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

from layerdiff.compare import hints
from layerdiff.compare import result as R
from layerdiff.compare.judge import PASSING, Status
from layerdiff.errors import TraceError
from layerdiff.trace import Trace, schema

# The Jacobian of a site without a weight matrix is estimated from the reference's aggregate
# gains (see _gain); the worst row's gain can be larger (a layer norm's 1/sigma is largest for
# the token with the smallest spread). Measured: an error arriving just within tolerance at a
# GPT block's first layer norm left it at 1.02x the estimate; planted bugs are 10-1000x.
GAIN_SLACK = 2.0

METRIC_KEYS = ("ratio", "max_abs", "max_rel", "mean_abs", "rms", "cosine", "max_ulp",
               "frac_out", "worst_index", "rtol", "atol", "tol_source", "note")


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
    failing = ~rows["verdict"].isin(PASSING)
    if not failing.any():
        return [], None
    step = int(rows.loc[failing, "step"].min())
    in_step = rows.index[rows["step"] == step]
    sites = _collect(rows, in_step)
    norms: dict[int, float] = {}
    if ref_index is not None:
        _find_missing(sites, rows, ref_index, step, dropped or set())
    lone: dict[tuple[str, str], list[str]] = {}
    for missing_step, site, port_site, _, name in port_missing or []:
        if missing_step == step and site in sites:
            lone.setdefault((site, port_site), []).append(name)
    for (site, port_site), names in lone.items():
        sites[site].missing.add("input")
        sites[site].why_missing.append(
            f"the port's {'input' if len(names) == 1 else 'inputs'} "
            f"{', '.join(repr(n) for n in names)} at {port_site} "
            f"{'has' if len(names) == 1 else 'have'} no partner in the reference: write a call "
            f"adapter that makes {'it' if len(names) == 1 else 'them'} from the reference's "
            f"arguments (call = \"pkg.module:function\" on the mapping's [[site]] rule for "
            f"{schema.split_site(site)[0]}; see docs/diff.md)")
    if ref_index is not None:
        norms = _norms(rows, in_step, ref_index, extra_norms or {})
    parents = _parents(ref_sites, step)
    _root_output_feeds_loss(sites)
    _unrecorded_results(rows, sites, parents)

    weight_origins = [s for s in sites.values() if s.is_bad("weight")]
    forward_all = [s for s in sites.values() if _forward_candidate(s)]
    backward_all = [s for s in sites.values() if _backward_candidate(s, sites, independent)]
    unjudged = [s for s in forward_all + backward_all if _cannot_judge(s)]
    # a container around a site that cannot be judged cannot be judged either, in that pass:
    # the fault may be that site's (an attention whose rotary tables have no partner, inside
    # its block). A child unjudged only backward (a weight gradient at a projection whose
    # output has no partner) says nothing of the container's forward.
    blocked: dict[str, list[_Site]] = {}
    for pass_, candidates in (("forward", forward_all), ("backward", backward_all)):
        inner = [s for s in candidates if s in unjudged]
        around = {a: s.name for s in inner for a in _ancestors(s.name, parents)}
        blocked[pass_] = list(inner)
        for site in candidates:
            if site.name in around and site not in unjudged:
                site.why_missing.append(f"it holds {around[site.name]}, which cannot be judged")
                blocked[pass_].append(site)
    forward = [s for s in forward_all if s not in blocked["forward"]]
    backward = [s for s in backward_all if s not in blocked["backward"]]
    if norms and not independent:
        forward = _unexplained(rows, forward, ("output",), norms, sites)
        backward = _unexplained(rows, backward, ("grad_input", "weight_grad"), norms, sites)
    # The gradient reaching a site that ran before a forward origin has passed through that
    # origin's backward: small errors there, summed into a weight gradient, are its doing.
    last_forward = -1 if independent else max((s.order for s in forward), default=-1)
    backward = [s for s in backward if s.order > last_forward]
    origins: list[R.Origin] = []
    # A site with wrong weights is an origin of its own; for nesting it qualifies like a
    # forward candidate, so the containers around it hold it rather than become origins.
    _, weight_holders = _innermost(weight_origins + forward, parents)
    for site in sorted(weight_origins, key=lambda s: s.order):
        origin = _origin(rows, site, step, "weight", _weight_reason(step, words))
        origin.holders = sorted(weight_holders.get(site.name, []))
        origins.append(origin)
    for group, role_order, reason in ((forward, ("output",), _forward_reason),
                                      (backward, ("grad_input", "weight_grad"),
                                       _backward_reason)):
        if group is forward:
            innermost, holders = _innermost(weight_origins + forward, parents)
            innermost = [s for s in innermost if s in forward]
        else:
            innermost, holders = _innermost(group, parents)
        key = (lambda s: s.order) if role_order == ("output",) else (
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
    _mark_unjudged(rows, unjudged, blocked)
    _mark(rows, origins, sites, step, failing)
    return origins, step


def _collect(rows: pd.DataFrame, positions: pd.Index) -> dict[str, _Site]:
    """Rows grouped by the port site they compare with, named by its reference partner.

    Grouping by the port's site puts a parameter compared through a mapping (the reference's
    ``w_q.weight`` with a slice of the port's fused ``in_proj_weight``) with the site that
    uses it in the port."""
    frame = rows.loc[positions]
    params = frame["role"].isin(["weight", "weight_grad"])
    partner = dict(zip(frame.loc[~params, "port_site"], frame.loc[~params, "site"],
                       strict=True))
    sites: dict[str, _Site] = {}
    for pos, site, port_site, role, seq, verdict, ref_bad, port_bad in zip(
            frame.index, frame["site"], frame["port_site"], frame["role"], frame["seq"],
            frame["verdict"], frame["ref_nan"].fillna(0) + frame["ref_inf"].fillna(0),
            frame["port_nan"].fillna(0) + frame["port_inf"].fillna(0), strict=True):
        name = partner.get(port_site, site)
        entry = sites.get(name)
        if entry is None:
            entry = sites[name] = _Site(name, port_site, int(seq))
        if role in ("grad_output", "grad_input"):
            entry.backward_order = min(entry.backward_order, int(seq))
        entry.rows.setdefault(role, []).append(pos)
        if verdict not in PASSING:
            entry.bad.setdefault(role, []).append(pos)
        if port_bad > ref_bad:
            entry.new_non_finite[role] = True
    return sites


def _find_missing(sites: dict[str, _Site], rows: pd.DataFrame, ref_index: pd.DataFrame,
                  step: int, dropped: set[tuple[int, str, str, str]]) -> None:
    """Note, per site, the roles with a floating-point reference tensor that has no partner
    in the port (unmatched, or declared so) and whose values no paired record of the same site
    and role holds (``attn(x, x, x)`` pairs one of three equal inputs). An argument the
    mapping drops (``dropped``: the port computes what it holds itself) is not missing."""
    wanted = ref_index[(ref_index["step"] == step) & (ref_index["kind"] == "tensor")
                       & ref_index["role"].isin(["input", "grad_output", "output"])
                       & ref_index["dtype"].str.contains("float")]
    frame = rows[rows["step"] == step]
    paired = set(zip(frame["site"], frame["role"], frame["arg"], strict=True))
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
    fed = set(wanted.loc[(wanted["site"] == root) & (wanted["role"] == "grad_output"), "arg"])
    for site, role, arg, digest in unpaired:
        if digest in digests.get((site, role), set()):
            continue
        if site == root and role == "output":
            if arg in fed and schema.LOSS_SITE in sites:
                sites[schema.LOSS_SITE].missing.add("input")
                sites[schema.LOSS_SITE].why_missing.append(
                    f"the model's output '{arg}', which the loss takes, has no partner in the "
                    "port (name its partner with outputs = { ... } on a [[site]] rule for "
                    "<root>)")
        elif site in sites:
            sites[site].missing.add(role)
            sites[site].why_missing.append(f"its {role} '{arg}' has no partner in the port")


def _cannot_judge(site: _Site) -> bool:
    """Whether what comes into the failing record has no partner to be judged against."""
    if site.is_bad("output") and not site.is_bad("grad_input", "weight_grad"):
        return site.lacks("input")
    return site.lacks("grad_output", "input")


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
            for pos, step, site, role, arg in zip(frame.index, frame["step"], frame["site"],
                                                  frame["role"], frame["arg"], strict=True)}


def _error(rows: pd.DataFrame, positions: list[int]) -> float:
    """Frobenius norm of the error over these rows (rms x sqrt(size)); NaN if any is unknown
    (a statistics-only row has no rms)."""
    parts = []
    for pos in positions:
        rms = rows.at[pos, "rms"]
        if rms is None or not np.isfinite(rms):
            return np.nan
        parts.append(float(rms) * math.sqrt(int(rows.at[pos, "numel"])))
    return math.hypot(*parts)  # no square overflows: float64 errors near the largest value


def _norm(norms: dict[int, float], positions: list[int]) -> float:
    return math.hypot(*(norms.get(p, np.nan) for p in positions))


def _float_inputs(rows: pd.DataFrame, site: _Site) -> list[int]:
    """A site's input rows that carry errors (token ids and masks do not)."""
    return [p for p in site.rows.get("input", [])
            if str(rows.at[p, "dtype"]).startswith(("float", "bfloat", "complex"))]


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
    if role == "weight_grad":
        module = schema.split_site(site.name)[0]
        calls = [s for n, s in sites.items() if schema.split_site(n)[0] == module] or [site]
        bound = 0.0
        for call in calls:
            grads = call.rows.get("grad_output", [])
            inputs = _float_inputs(rows, call)
            e_a, n_a = _error(rows, grads), _norm(norms, grads)
            e_b, n_b = _error(rows, inputs), _norm(norms, inputs)
            bound += e_a * n_b + n_a * e_b + e_a * e_b
        return bound
    incoming = site.rows.get("grad_output", []) if role == "grad_input" else float_rows
    outgoing = site.rows.get(role, [])
    weights = site.rows.get("weight", [])
    matrices = [p for p in weights if len(str(rows.at[p, "shape"]).split(",")) >= 2]
    e_a, n_a = _error(rows, incoming), _norm(norms, incoming)
    e_w, n_w = _error(rows, weights), _norm(norms, weights)
    if matrices:
        bound = e_a * n_w + n_a * e_w + e_a * e_w
    else:
        bound = GAIN_SLACK * e_a * _gain(site, norms, float_rows) + _norm(norms, outgoing) * (
            e_w / n_w if n_w > 0 else 0.0)
    if role == "grad_input":  # the forward inputs' error changes the Jacobian itself
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
    for out, into in ((site.rows.get("output", []), float_inputs),
                      (site.rows.get("grad_input", []), site.rows.get("grad_output", []))):
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
        first = min(candidates, key=lambda s: s.order if "output" in roles
                    else s.backward_order)
        kept.append(first)
    return kept


_PASS_ROLES = {"forward": ("input", "output"),
               "backward": ("grad_output", "grad_input", "weight_grad")}


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
    cause = "; ".join(site.why_missing) or "its inputs have no partner in the port"
    for positions in bad.values():
        for pos in positions:
            rows.at[pos, "status"] = Status.CANNOT_JUDGE
            rows.at[pos, "cause"] = cause


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
                   for role in ("input", "output", "weight") for p in s.bad.get(role, [])]
        if earlier:
            loss.bad.setdefault("input", []).extend(earlier)
    if loss is not None and root is not None:
        if root.is_bad("output"):
            loss.bad.setdefault("input", []).extend(root.bad["output"])
        if root.new_non_finite.get("output"):
            loss.new_non_finite["input"] = True


def _unrecorded_results(rows: pd.DataFrame, sites: dict[str, _Site],
                        parents: dict[str, str]) -> None:
    """A container whose own result has no record (no ``grad_input`` where its inputs need no
    gradient, no ``output`` where it was not captured) still shows its own code's fault in
    what that code hands its children: a child's ``input`` (forward) or ``grad_output``
    (backward) that is off while what came into the container before it (its inputs and
    weights, or the gradient at its outputs, and its children's results recorded earlier)
    agrees. Those child records then count as the container's result."""
    children: dict[str, list[_Site]] = {}
    for site in sites.values():
        if parents.get(site.name) in sites:
            children.setdefault(parents[site.name], []).append(site)
    for name, inside in children.items():
        site = sites[name]
        for result, handed, came, returned in (
                ("output", "input", ("input", "weight"), "output"),
                ("grad_input", "grad_output", ("grad_output",), "grad_input")):
            if site.rows.get(result) or site.is_bad(*came):
                continue
            if result == "grad_input" and any(  # a backward inherits its forward's error
                    s.is_bad("input", "output", "weight") for s in [site, *inside]):
                continue
            bad = sorted(p for child in inside for p in child.bad.get(handed, []))
            if not bad:
                continue
            seq = min(rows.at[p, "seq"] for p in bad)
            if any(rows.at[p, "seq"] < seq for child in inside
                   for p in child.bad.get(returned, [])):
                continue  # a child's own result came first: the fault may be that child's
            site.bad[result] = bad
            site.rows[result] = bad
            site.handed = sorted({rows.at[p, "site"] for p in bad})


def _forward_candidate(site: _Site) -> bool:
    if site.is_bad("weight"):
        return False
    if site.is_bad("output") and not site.is_bad("input"):
        return True
    return bool(site.new_non_finite.get("output") and not site.new_non_finite.get("input"))


def _backward_candidate(site: _Site, sites: dict[str, _Site], independent: bool) -> bool:
    if site.is_bad("grad_output", "input", "output", "weight"):
        return False
    if site.is_bad("grad_input"):
        return True
    if not site.is_bad("weight_grad"):
        return False
    if independent:
        return True
    module = schema.split_site(site.name)[0]
    return not any(other.is_bad("grad_output") for name, other in sites.items()
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
    if site.new_non_finite.get("output"):
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
    role = "grad_input" if site.is_bad("grad_input") else "weight_grad"
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


def _weight_reason(step: int, words: Words = TOLERANCE) -> str:
    return words.weights[0] if step == 0 else words.weights[1].format(step=step)


def _origin(rows: pd.DataFrame, site: _Site, step: int, role: str, reason: str) -> R.Origin:
    positions = site.bad[role]
    worst = max(positions, key=lambda p: _ratio(rows.at[p, "ratio"]))
    row = rows.loc[worst]
    metrics = {key: _plain(row[key]) for key in METRIC_KEYS}
    batch = row["batch_ratio"]
    metrics["batch_ratio"] = None if batch is None else [float(x) for x in batch]
    arg = str(row["arg"])
    if role in ("weight", "weight_grad") and row["site"] != site.name:
        arg = schema.param_name(row["site"], arg)  # compared through the mapping: name the tensor
    return R.Origin(step, str(row["pass"]), site.name, site.port_name, role, arg,
                    str(row["port_arg"]), reason, metrics)


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
                    rows.at[pos, "status"] = Status.HOLDS_ORIGIN
                    rows.at[pos, "cause"] = origin.site
    first = origins[0] if origins else None
    forward = [o for o in origins if o.pass_ == "forward"]
    order_of = {pos: site.backward_order for site in sites.values()
                for pos in site.bad.get("weight_grad", [])}
    ordered = sorted(origins, key=lambda o: _first_seq(rows, sites, o))
    for pos in rows.index[failing]:
        if pos in origin_rows:
            rows.at[pos, "status"] = Status.ORIGIN
            rows.at[pos, "cause"] = origin_rows[pos].site
            continue
        if rows.at[pos, "status"]:
            continue
        rows.at[pos, "status"] = Status.PROPAGATED
        if rows.at[pos, "step"] != step:
            rows.at[pos, "cause"] = f"step {step}" + (f" ({first.site})" if first else "")
            continue
        seq = rows.at[pos, "seq"]
        if rows.at[pos, "role"] == "weight_grad":  # recorded after the whole backward
            seq = order_of.get(pos, seq)
        before = [o for o in ordered if _first_seq(rows, sites, o) <= seq
                  and (o.pass_ == rows.at[pos, "pass"] or o.pass_ == "forward")]
        cause = before[-1] if before else (forward[0] if forward else first)
        rows.at[pos, "cause"] = cause.site if cause else ""


def _first_seq(rows: pd.DataFrame, sites: dict[str, _Site], origin: R.Origin) -> int:
    return int(min(rows.at[p, "seq"] for p in sites[origin.site].bad[origin.role]))


# ---------------------------------------------------------------------------------------------
# Likely-cause hints: each origin's tensors, read from the two traces, and what they suggest

# An origin whose tensor is larger is examined on its first batch elements only (as many as
# fit); a weight larger than this gets no hint. 2^20 float64 values are 8 MiB per copy, and a
# hint makes a few dozen passes over them.
HINT_MAX_ELEMENTS = 1 << 20
# A replay judges every site on its own and can name hundreds of origins: the first ones (in
# the order the diff lists them) get hints, a bounded cost.
HINT_MAX_ORIGINS = 32


def attach_hints(origins: list[R.Origin], ref: Trace, port: Trace, *, grad_factor: float = 1.0,
                 max_elements: int = HINT_MAX_ELEMENTS,
                 max_origins: int = HINT_MAX_ORIGINS) -> None:
    """Set each origin's ``hint``: the kind of porting mistake its error looks like, with the
    numbers (see :mod:`layerdiff.compare.hints`), or None when nothing matches, when the traces
    hold no tensor data there (summary traces) or past the first ``max_origins``.
    ``grad_factor`` brings the port's gradients to the reference's loss scale, as the diff
    does."""
    if ref.summary or port.summary:
        return
    for origin in origins[:max_origins]:
        try:
            with np.errstate(all="ignore"):  # -inf from a mask in the inputs: no warnings
                found = _hint(origin, ref, port, grad_factor, max_elements)
        except (TraceError, ValueError, np.linalg.LinAlgError):
            # a record that cannot be read, or tensors no model fits the shapes of: a hint is
            # a help, never a reason for the diff to fail
            found = None
        origin.hint = None if found is None else found.as_json()


def _hint(origin: R.Origin, ref: Trace, port: Trace, grad_factor: float,
          max_elements: int) -> hints.Hint | None:
    step, role = origin.step, origin.role
    ref_row = _tensor_row(ref, step, origin.site, role, origin.arg)
    port_row = _tensor_row(port, step, origin.port_site or origin.site, role, origin.port_arg)
    if ref_row is None or port_row is None:
        return None
    ref_values, port_values = ref.read(ref_row), port.read(port_row)
    found = _hint_at(origin, ref, ref_values, port_values, ref_row, grad_factor, max_elements)
    if found is not None or role != "output" or origin.pass_ != "forward":
        return found
    inner = _own_code_record(origin, ref, port, max_elements)
    if inner is None:
        return None
    # the first value the site's own code made wrong, before its later children reshaped it
    child, ref_values, port_values = inner
    found = _hint_at(origin, ref, ref_values, port_values, ref_row, grad_factor,
                     max_elements, children_only=True)
    if found is None:
        return None
    return hints.Hint(found.kind, f"at {child}'s input (the first value the site's own code "
                      f"makes that is out): {found.evidence}")


def _relative(site: str, child: str) -> str:
    """The child's module path below the site's ('mlp.down_proj' under 'mlp': 'down_proj')."""
    parent, module = schema.split_site(site)[0], schema.split_site(child)[0]
    if parent != schema.ROOT_MODULE and module.startswith(parent + "."):
        return module[len(parent) + 1:]
    return module


def _own_code_record(origin: R.Origin, ref: Trace, port: Trace, max_elements: int
                     ) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(child, reference, port) for the first child of the origin's site, in call order, whose
    input is out of the origin's tolerance while the site's own output is the origin: the
    site's own code between its children made it. Port children are found by the same name
    under the port's site (a mapping that renames children leaves this out)."""
    rtol = float(origin.metrics.get("rtol") or 0.0)
    atol = float(origin.metrics.get("atol") or 0.0)
    sites = ref.sites
    rows = sites[(sites["step"] == origin.step) & (sites["parent"] == origin.site)]
    if rows.empty or len(rows) > MAX_CHILDREN:
        return None
    ref_module = schema.split_site(origin.site)[0]
    port_module = schema.split_site(origin.port_site or origin.site)[0]
    for child in rows.sort_values("enter_seq")["site"]:
        module, call = schema.split_site(child)
        if schema.is_op_site(child):
            continue
        suffix = module if ref_module == schema.ROOT_MODULE else module[len(ref_module) + 1:]
        if ref_module != schema.ROOT_MODULE and not module.startswith(ref_module + "."):
            continue
        port_child = (suffix if port_module == schema.ROOT_MODULE
                      else f"{port_module}.{suffix}") + f"#{call}"
        ref_row = _tensor_row(ref, origin.step, child, "input", "0")
        port_row = _tensor_row(port, origin.step, port_child, "input", "0")
        if ref_row is None or port_row is None or int(ref_row["numel"]) > max_elements:
            continue
        a = np.asarray(ref.read(ref_row), np.float64)
        b = np.asarray(port.read(port_row), np.float64)
        if a.shape != b.shape:
            continue
        if np.any(np.abs(b - a) > atol + rtol * np.abs(a)):
            return suffix, a, b
    return None


def _hint_at(origin: R.Origin, ref: Trace, ref_values: np.ndarray, port_values: np.ndarray,
             ref_row: pd.Series, grad_factor: float, max_elements: int,
             children_only: bool = False) -> hints.Hint | None:
    step, role = origin.step, origin.role
    if role in ("grad_output", "grad_input", "weight_grad") and grad_factor != 1.0:
        port_values = port_values.astype(np.float64) * grad_factor
    port_values = _as_compared(ref_values, port_values, None if children_only
                               else origin.metrics.get("max_abs"))
    if port_values is None:
        return None
    keep = _batch_kept(ref_values, role, max_elements)
    if keep == 0:
        return None
    batch = ref_values.shape[0] if ref_values.ndim else 0

    def cut(values: np.ndarray) -> np.ndarray:
        return values[:keep] if values.ndim and values.shape[0] == batch else values

    params = role in ("weight", "weight_grad")
    inputs = {} if params else _site_tensors(ref, step, origin.site, "input", max_elements)
    weights = _module_weights(ref, step, origin.site, max_elements)
    grad_output = None
    if role == "grad_input":
        grads = _site_tensors(ref, step, origin.site, "grad_output", max_elements)
        grad_output = cut(grads["0"]) if "0" in grads else None
    attention = (_attention_parts(ref, step, origin.site, ref_row, max_elements)
                 if role == "output" and origin.pass_ == "forward" and not children_only
                 else None)
    if attention is not None:
        attention = hints.Attention(
            cut(attention.q), cut(attention.k), cut(attention.v), cut(attention.context),
            attention.out_weight, attention.out_bias,
            None if attention.mask is None else cut(attention.mask), attention.output_heads)
    children = (_children(ref, step, origin.site, max_elements, cut)
                if role == "output" and origin.pass_ == "forward" else [])
    rtol, atol = origin.metrics.get("rtol"), origin.metrics.get("atol")
    return hints.hint(cut(ref_values), cut(port_values), role=role,
                      rtol=float(rtol or 0.0), atol=float(atol or 0.0),
                      inputs={k: cut(v) for k, v in inputs.items()}, weights=weights,
                      grad_output=grad_output, attention=attention, children=children)


MAX_CHILDREN = 16      # a module with more sub-modules than this is not looked inside


def _children(trace: Trace, step: int, site: str, max_elements: int, cut) -> list[hints.Child]:
    """What the site's sub-modules recorded (first input, first output, weight and bias), in
    call order: the pieces a hint may rebuild the site's own code from."""
    sites = trace.sites
    rows = sites[(sites["step"] == step) & (sites["parent"] == site)].sort_values("enter_seq")
    if len(rows) > MAX_CHILDREN:
        return []
    out = []
    for child in rows["site"]:
        tensors = []
        for role in ("input", "output"):
            row = _tensor_row(trace, step, child, role, "0")
            small = row is not None and int(row["numel"]) <= max_elements
            tensors.append(cut(trace.read(row)) if small else None)
        params = []
        for arg in ("weight", "bias"):
            row = _module_param(trace, step, child, arg)
            small = row is not None and int(row["numel"]) <= max_elements
            params.append(np.asarray(trace.read(row)) if small else None)
        out.append(hints.Child(_relative(site, child), *tensors, *params))
    return out


def _as_compared(ref_values: np.ndarray, port_values: np.ndarray,
                 max_abs: float | None) -> np.ndarray | None:
    """The port's tensor as the diff compared it with the reference's: as stored, or
    transposed (a mapping that transposes a weight), whichever gives the diff's own largest
    difference; None when neither does (a parameter the mapping transforms otherwise, say
    permutes its rows, or a slice of a fused one): a hint of the stored tensors would describe
    the mapping's layout, not the port's mistake."""
    candidates = [port_values] if port_values.shape == ref_values.shape else []
    if port_values.ndim == 2 and port_values.shape[::-1] == ref_values.shape:
        candidates.append(port_values.T)
    if max_abs is None or not np.isfinite(max_abs):
        return candidates[0] if candidates else None
    for values in candidates:
        with np.errstate(all="ignore"):
            gap = float(np.max(np.abs(np.asarray(values, np.float64) - ref_values), initial=0.0))
        if abs(gap - max_abs) <= 1e-3 * max(gap, max_abs) + 1e-30:
            return values
    return None


def _batch_kept(values: np.ndarray, role: str, max_elements: int) -> int:
    """How many leading batch elements a hint examines (all when small enough; 0: none)."""
    if values.size <= max_elements:
        return values.shape[0] if values.ndim else 1
    if role in ("weight", "weight_grad") or values.ndim < 2:
        return 0
    per_element = values.size // values.shape[0]
    return max_elements // per_element


def _tensor_row(trace: Trace, step: int, site: str, role: str, arg: str) -> pd.Series | None:
    """The record of one tensor with data; a parameter compared through a mapping is named by
    its full name (``module.param``), whichever call recorded it."""
    row = trace.find(step, site, role, arg, kind="tensor")
    if row is None and role in ("weight", "weight_grad"):
        rows = trace.records(step, role=role, kind="tensor")
        named = [i for i, (s, a) in enumerate(zip(rows["site"], rows["arg"], strict=True))
                 if schema.param_name(s, a) == arg]
        row = rows.iloc[named[0]] if named else None
    return None if row is None or int(row["segment"]) < 0 else row


def _site_tensors(trace: Trace, step: int, site: str, role: str,
                  max_elements: int) -> dict[str, np.ndarray]:
    rows = trace.records(step, site, role, kind="tensor")
    return {str(row["arg"]): trace.read(row) for _, row in rows.iterrows()
            if int(row["segment"]) >= 0 and int(row["numel"]) <= max_elements}


def _module_weights(trace: Trace, step: int, site: str,
                    max_elements: int) -> dict[str, np.ndarray]:
    """The site's own parameters, as whichever call of its module recorded them."""
    weights: dict[str, np.ndarray] = {}
    for _, row in _module_params(trace, step, site).iterrows():
        if row["arg"] not in weights and int(row["numel"]) <= max_elements:
            weights[str(row["arg"])] = trace.read(row)
    return weights


def _module_params(trace: Trace, step: int, site: str) -> pd.DataFrame:
    """The weight records, with data, of the module ``site`` is a call of (any call)."""
    rows = trace.records(step, role="weight", kind="tensor")
    module = schema.split_site(site)[0]
    same = [schema.split_site(s)[0] == module for s in rows["site"]]
    rows = rows[np.asarray(same, dtype=bool)] if len(rows) else rows
    return rows[rows["segment"] >= 0]


def _module_param(trace: Trace, step: int, site: str, arg: str) -> pd.Series | None:
    rows = _module_params(trace, step, site)
    rows = rows[rows["arg"] == arg]
    return None if rows.empty else rows.iloc[0]


def _attention_parts(trace: Trace, step: int, site: str, output_row: pd.Series,
                     max_elements: int) -> hints.Attention | None:
    """The reference's q, k, v and context at ``site`` when it is attention: a module built
    as attention usually is (see :func:`_projected_attention`), or else a kernel whose inputs
    are q, k and v and whose output is the context."""
    inputs = trace.records(step, site, "input", kind="tensor")
    floats = [row for _, row in inputs.iterrows()
              if str(row["dtype"]).startswith(("float", "bfloat")) and int(row["segment"]) >= 0]
    masks = [row for _, row in inputs.iterrows()
             if not str(row["dtype"]).startswith(("float", "bfloat", "complex"))
             and int(row["segment"]) >= 0]
    mask = trace.read(masks[0]) if masks else None
    projected = _projected_attention(trace, step, site, output_row, max_elements, mask)
    if projected is not None:
        return projected
    out_shape = schema.parse_shape(output_row["shape"])
    if len(floats) >= 3:
        shapes = [schema.parse_shape(row["shape"]) for row in floats[:3]]
        if _kernel_shapes(*shapes, out_shape) and all(
                int(row["numel"]) <= max_elements for row in floats[:3]):
            q, k, v = (trace.read(row) for row in floats[:3])
            context = trace.read(output_row)
            heads = None
            if q.ndim == 4:  # heads apart, (batch, heads, length, d): merged, and split back
                heads = q.shape[1]
                q, k, v, context = (_merge_heads(a) for a in (q, k, v, context))
            return hints.Attention(q, k, v, context, mask=mask, output_heads=heads)
    return None


def _kernel_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                   out: tuple[int, ...]) -> bool:
    """q (b, [h,] Lq, d), k (b, [h,] Lk, d), v (b, [h,] Lk, dv) -> out (b, [h,] Lq, dv)."""
    if not (len(q) == len(k) == len(v) == len(out) and len(q) in (3, 4)):
        return False
    lead = q[:-2]
    return (k[:-2] == lead and v[:-2] == lead and out[:-2] == lead and q[-1] == k[-1]
            and k[-2] == v[-2] and out[-2] == q[-2] and out[-1] == v[-1])


def _merge_heads(values: np.ndarray) -> np.ndarray:
    batch, heads, length, width = values.shape
    return values.transpose(0, 2, 1, 3).reshape(batch, length, heads * width)


def _projected_attention(trace: Trace, step: int, site: str, output_row: pd.Series,
                         max_elements: int, mask: np.ndarray | None) -> hints.Attention | None:
    """Sub-modules with matrix weights project q, k, v (three, one fused, or q and a fused
    k-v), and the last one, the output projection, gives the site's output."""
    sites = trace.sites
    children = sites[(sites["step"] == step) & (sites["parent"] == site)].sort_values(
        "enter_seq")
    linear = []
    for child in children["site"]:
        weight = _module_param(trace, step, child, "weight")
        if weight is not None and len(schema.parse_shape(weight["shape"])) == 2:
            linear.append((child, weight))
    if len(linear) < 2:
        return None
    out_site, out_weight = linear[-1]
    out = _tensor_row(trace, step, out_site, "output", "0")
    context = _tensor_row(trace, step, out_site, "input", "0")
    if out is None or context is None or not output_row["digest"] \
            or out["digest"] != output_row["digest"]:
        return None  # the last projection's output is not the site's: not this structure
    projected = [_tensor_row(trace, step, child, "output", "0") for child, _ in linear[:-1]]
    if any(p is None or int(p["numel"]) > max_elements for p in projected):
        return None
    values = [trace.read(p) for p in projected]
    if len(values) == 1 and values[0].shape[-1] % 3 == 0:
        q, k, v = np.split(values[0], 3, axis=-1)
    elif len(values) == 2 and values[1].shape[-1] % 2 == 0:
        q, (k, v) = values[0], np.split(values[1], 2, axis=-1)
    elif len(values) == 3:
        q, k, v = values
    else:
        return None
    bias = _module_param(trace, step, out_site, "bias")
    return hints.Attention(q, k, v, trace.read(context), trace.read(out_weight),
                           None if bias is None else trace.read(bias), mask)
