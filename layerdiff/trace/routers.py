"""Mixture-of-experts routers found in a trace, and the experts each token went to.

A *router* is a site whose output 0 holds scores over experts (last axis E), of which the model
takes the top ``k`` per token. Routers are declared (``[[router]] site = "model.layers.*.mlp.gate"
k = 2``) or detected: a site whose float output 0 is (..., E) with, beside it, an integer tensor
(T, k), k < E, T the number of score rows and every value in [0, E): the top-k indices, recorded
as the router's own output or as an input of a sibling site (HF passes ``top_k_index`` to its
experts, gpt-fast ``expert_indices`` to its ``cond_ffn``), and which is the top k of those scores
for most tokens. An argmax router's one expert per token may be (T,) or (B, S). A tensor the
model was fed (a classifier's labels beside its logits, which a trained classifier predicts) is
data, never a choice: its digest is that of one of the root's inputs.
A run's decision is that recorded index tensor when there is one (the choice the model actually
took, in whatever precision it chose), else the top k of its recorded scores.

The diff compares decisions (:mod:`layerdiff.compare.routing`); a capture, replay or swap forces
one run's decisions into another (:mod:`layerdiff.capture.routes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from layerdiff.mapping import Mapping
from layerdiff.trace import schema
from layerdiff.trace.reader import Trace


def routers(ref: Trace, mapping: Mapping) -> list[tuple[int, str, int]]:
    """(step, site, k) of each router call, in call order: declared by the mapping, else
    detected. Detection starts from the few integer (T, k) tensors a forward records (the
    router that made one is the site that returns it or a sibling of the site that takes it),
    so a trace without any costs one pass over its index."""
    sites = ref.sites
    found: dict[tuple[int, str], int] = {}
    if mapping.routers:
        for site in sites.itertuples(index=False):
            k = next((rule.k for rule in mapping.routers
                      if rule.site.match(site.module) is not None), None)
            if k is not None:
                found[(int(site.step), site.site)] = k
    index = ref.index
    ints = index[(index["pass"] == "forward") & (index["kind"] == "tensor")
                 & (index["segment"] >= 0) & index["dtype"].astype(str).str.startswith(
                     ("int", "uint")) & (index["shape"].astype(str).str.count(",") <= 1)]
    parent = dict(zip(zip(sites["step"].astype(int), sites["site"], strict=True),
                      sites["parent"], strict=True))
    outputs = index[(index["pass"] == "forward") & (index["role"] == "output")
                    & (index["arg"] == "0") & (index["kind"] == "tensor")]
    shapes = {(int(step), str(site)): schema.parse_shape(shape) for step, site, shape
              in outputs[["step", "site", "shape"]].itertuples(index=False)}

    def could_be(step: int, candidate: str, dims: tuple[int, ...]) -> bool:
        """Scores whose rows are the integer tensor's tokens, over more experts than it
        takes: checked on the index alone, before any read."""
        shape = shapes.get((step, candidate), ())
        return len(shape) >= 2 and choice_width(dims, math.prod(shape[:-1])) in range(
            1, shape[-1])

    for step, site, role, text in {(int(a), str(b), str(c), str(d)) for a, b, c, d in
                                   ints[["step", "site", "role", "shape"]].itertuples(
                                       index=False)}:
        dims = schema.parse_shape(text)
        if role == "output":  # the router returns its choice
            candidates = [site]
        elif role == "input":  # a sibling of the router takes it (the experts)
            above = parent.get((step, site), "")
            candidates = sites.loc[(sites["step"] == step) & (sites["parent"] == above)
                                   & (sites["site"] != site), "site"].tolist() if above else []
        else:
            continue
        for candidate in candidates:
            if (step, candidate) not in found and could_be(step, candidate, dims):
                k = _detected_k(ref, step, candidate, parent.get((step, candidate), ""))
                if k is not None:
                    found[(step, candidate)] = k
    order = {key: n for n, key in enumerate(parent)}
    return [(step, site, k) for (step, site), k in
            sorted(found.items(), key=lambda item: order.get(item[0], 0))]



def scores_row(trace: Trace, step: int, site: str) -> pd.Series | None:
    row = trace.find(step, site, "output", "0", pass_="forward", kind="tensor")
    if row is None or "float" not in str(row["dtype"]) or row["segment"] < 0:
        return None
    shape = schema.parse_shape(row["shape"])
    return row if len(shape) >= 2 and shape[-1] >= 2 else None


AGREE = 0.9  # the share of tokens whose recorded choice must be the top k of the scores

def _detected_k(trace: Trace, step: int, site: str, parent: str) -> int | None:
    """k when ``site`` is a router: its scores beside a recorded (T, k) choice (see
    :func:`_decision_rows`) that is the top k of those scores for at least AGREE of the tokens
    (not all: a router that chooses in a lower precision than it records may differ from its
    recorded scores on near-ties). The check on the values keeps out a block that merely holds
    a router (its output's top k are no experts) and any (T, k) integers that happen to fit.

    A group-limited router with a selection-only bias (DeepSeek-V3: the top k within the best
    groups of sigmoid scores plus a bias) takes the global top k for a third to three quarters
    of the tokens only, yet chooses among each token's highest scores: it is one when every
    chosen expert ranks in the upper half of its token's scores for AGREE of them (integers
    that merely fit do so for about half)."""
    row = scores_row(trace, step, site)
    if row is None:
        return None
    for found in decision_rows(trace, step, site, parent, row):
        scores_shape = schema.parse_shape(row["shape"])
        k = choice_width(schema.parse_shape(found["shape"]), math.prod(scores_shape[:-1]))
        scores = np.asarray(trace.read(row, compared=True), dtype=np.float64)
        scores = scores.reshape(-1, scores.shape[-1])
        chosen = np.sort(np.asarray(trace.read(found, compared=True)).reshape(len(scores), k),
                         axis=-1)
        top = np.sort(np.argsort(-scores, axis=-1, kind="stable")[:, :k], axis=-1)
        if (top == chosen).all(axis=-1).mean() >= AGREE:
            return k
        ranks = np.argsort(np.argsort(-scores, axis=-1, kind="stable"), axis=-1)
        if (np.take_along_axis(ranks, chosen, axis=-1) < scores.shape[-1] / 2).mean() >= AGREE:
            return k
    return None



def choice_width(dims: tuple[int, ...], tokens: int) -> int:
    """k of a recorded choice of shape ``dims`` for ``tokens`` score rows: (T, k), or one expert
    per token as an argmax gives it, (T,) or (B, S) with B*S = T; 0 when it is neither."""
    if len(dims) == 2 and dims[0] == tokens:
        return dims[1]
    if 1 <= len(dims) <= 2 and math.prod(dims) == tokens:
        return 1
    return 0


def decision_rows(trace: Trace, step: int, site: str, parent: str,
                   scores: pd.Series, k: int | None = None) -> list[pd.Series]:
    """The recorded top-k indices of ``site``'s scores: an integer (T, k) tensor, k < E, values
    in [0, E), that the router or an op inside it (--ops) returns, or that a sibling (same
    parent call: the experts) takes; an argmax's one expert per token may be (T,) or (B, S).
    Not a sibling's output nor the router's own input: a site that takes or a sibling that
    returns expert numbers is no router of them. Not the model's own input either: labels fed
    in beside a classifier's logits are data, no decision of the model."""
    shape = schema.parse_shape(scores["shape"])
    experts, tokens = shape[-1], math.prod(shape[:-1])
    sites = trace.sites
    at = sites[sites["step"] == step]
    returns = set(at.loc[at["parent"] == site, "site"]) | {site}
    takes = set(at.loc[(at["parent"] == parent) & (at["site"] != site), "site"])
    index = trace.index
    candidates = index[(index["step"] == step) & (index["pass"] == "forward")
                       & (index["kind"] == "tensor") & (index["segment"] >= 0)
                       & ((index["site"].isin(returns) & (index["role"] == "output"))
                          | (index["site"].isin(takes) & (index["role"] == "input")))]
    fed = set(index.loc[(index["step"] == step) & (index["role"] == "input")
                        & (index["site"] == schema.ROOT_MODULE + "#0"), "digest"])
    found = []
    for _, row in candidates.iterrows():
        if not str(row["dtype"]).startswith(("int", "uint")):
            continue
        width = choice_width(schema.parse_shape(row["shape"]), tokens)
        if not 1 <= width < experts or (k is not None and width != k):
            continue
        if not (row["min"] >= 0 and row["max"] < experts) or row["digest"] in fed:
            continue
        found.append(row)
    return found



def tokens_shape(trace: Trace, step: int, parent: str, tokens: int) -> tuple[int, int] | None:
    """(batch, sequence) of the router's tokens: from its enclosing call's input 0, a (B, S, D)
    tensor whose B*S is the number of score rows."""
    if not parent:
        return None
    row = trace.find(step, parent, "input", "0", pass_="forward")
    if row is None:
        return None
    dims = schema.parse_shape(row["shape"])
    if len(dims) == 3 and dims[0] * dims[1] == tokens:
        return dims[0], dims[1]
    return None



@dataclass
class RouterSide:
    """One run's router call: its scores, the experts it chose and where that was read."""

    scores: np.ndarray          # (T, E) float64
    chosen: np.ndarray          # (T, k) the experts each token went to, in the order taken
    dtype: str                  # the scores' dtype
    source: str                 # where the choice was read from, for the report
    records: list[list[str]]    # every record of the choice as [site, role, arg]


def read_side(trace: Trace, step: int, site: str, k: int) -> RouterSide | None:
    """The router call ``site`` of ``step``: None when its scores were not recorded as data."""
    found = scores_row(trace, step, site)
    if found is None:
        return None
    scores = np.asarray(trace.read(found, compared=True), dtype=np.float64)
    scores = scores.reshape(-1, scores.shape[-1])
    sites = trace.sites
    parent = sites.loc[(sites["step"] == step) & (sites["site"] == site), "parent"]
    decisions = decision_rows(trace, step, site, str(parent.iloc[0]) if len(parent) else "",
                              found, k)
    records = [[str(r["site"]), str(r["role"]), str(r["arg"])] for r in decisions]
    if decisions:
        chosen = np.asarray(trace.read(decisions[0], compared=True)).reshape(len(scores), k)
        source = f"{decisions[0]['site']} {decisions[0]['role']} '{decisions[0]['arg']}'"
    else:  # top k of the scores, ties to the lower index (torch.topk's order on CPU)
        chosen = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
        source = f"top-{k} of {site}'s scores"
    return RouterSide(scores, chosen.astype(np.int64), str(found["dtype"]), source, records)


@dataclass
class Route:
    """The experts one router call sent each of its tokens to."""

    step: int
    site: str                   # the router, as the trace it was read from names it
    experts: int                # E
    chosen: np.ndarray          # (T, k) int64, in the order the run took them

    @property
    def shape(self) -> tuple[int, int, int]:
        """(tokens, experts, k): what a top-k call must look like to take this route."""
        return self.chosen.shape[0], self.experts, self.chosen.shape[1]


@dataclass
class Routes:
    """Every router call's route in a trace, per step in call order."""

    source: str
    by_step: dict[int, list[Route]] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # routers found without their data

    def count(self) -> int:
        return sum(len(routes) for routes in self.by_step.values())


def recorded_routes(trace: Trace, mapping: Mapping | None = None) -> Routes:
    """The routes of every router call ``trace`` recorded (declared by ``mapping`` or
    detected), for forcing them into another run."""
    routes = Routes(str(trace.path))
    for step, site, k in routers(trace, mapping or Mapping()):
        side = read_side(trace, step, site, k)
        if side is None:
            routes.unreadable.append(site)
            continue
        routes.by_step.setdefault(step, []).append(
            Route(step, site, side.scores.shape[-1], side.chosen))
    return routes
