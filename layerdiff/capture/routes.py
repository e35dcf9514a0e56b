"""Routing forced: a mixture-of-experts run made to send each token where another run did.

A token whose router scores nearly tie may go to another expert in the port, and everything
downstream of it differs although no code is wrong. Forcing the reference's recorded routes
into the port (or the port's into the reference) measures the experts and everything after
them apart from routing, as replay measures a layer apart from its inputs (rollout routing
replay, "R3", does this for RL rollouts).

While forced, every ``torch.topk`` over a router's scores returns the recorded route: the
experts the other run chose for each token, in the order it took them, and as values the
scores *this* run computed at those experts (so its own weighting, renormalisation and
gradients stay its own). A top-k call takes the next route of its step when it looks like it:
(..., E) scores with as many rows as the route has tokens, the same k, over the last axis,
largest first. Others (a sampler's top-k over the vocabulary) run as they are. Routers are
called in the same order in both runs, layer after layer, so the n-th router-like top-k of a
step takes the n-th recorded route; a route no call took is an error the caller reports, since
its diff would then judge a run that was not forced.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from layerdiff.errors import CaptureError
from layerdiff.mapping import Mapping
from layerdiff.trace.routers import Route, recorded_routes

_TOPK = (torch.topk, torch.Tensor.topk)
_TOPK_PARAMETERS = ("input", "k", "dim", "largest", "sorted")


@dataclass
class Forced:
    """What one router call's forcing changed."""

    site: str                   # the recorded router the route came from
    tokens: int
    rerouted: list[int]         # tokens whose own top-k chose another set of experts


class RouteForcer(TorchFunctionMode):
    """While entered, router-like ``torch.topk`` calls of each step return that step's
    ``routes`` in order (:meth:`begin_step` says which step runs)."""

    def __init__(self, routes: dict[int, list[Route]], source: str = "") -> None:
        super().__init__()
        self.routes = routes
        self.source = source  # the trace the routes were recorded in
        self.step = 0
        self.taken: dict[int, list[Forced]] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    def left(self, step: int | None = None) -> list[Route]:
        """The routes of ``step`` (this one by default) that no top-k call took (yet)."""
        step = self.step if step is None else step
        return self.routes.get(step, [])[len(self.taken.get(step, [])):]

    def check_steps(self, steps: int, name: str) -> None:
        """Refuse a run of more steps than the routes were recorded for: its later steps would
        route on their own while the trace says they were forced."""
        missing = [step for step in range(steps) if step not in self.routes]
        if missing:
            held = ", ".join(map(str, sorted(self.routes))) or "none"
            raise CaptureError(f"--force-routing {self.source} holds routes for step(s) {held}; "
                               f"case {name} runs step(s) {', '.join(map(str, missing))} too: "
                               "capture as many steps as that trace recorded (--steps)")

    def check_taken(self, step: int, where: str) -> None:
        """Refuse a step (or a replayed call) in which a route was left: the run routed by
        other means than a top-k of that shape, and is not forced."""
        left = self.left(step)
        if left:
            tokens, experts, k = left[0].shape
            raise CaptureError(
                f"--force-routing {self.source}: {where} made {len(self.taken.get(step, []))} "
                f"of the {len(self.routes[step])} router-like top-k calls that trace recorded; "
                f"none took the route of {left[0].site} (top-{k} over ({tokens}, {experts}) "
                "scores): this run routes by other means (argmax, sort, a top-k of another "
                "shape), so its routing cannot be forced; compare it without --force-routing")

    def forced(self) -> list[Forced]:
        return [forced for step in sorted(self.taken) for forced in self.taken[step]]

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        left = self.left() if func in _TOPK else []
        if not left:
            return result
        call = _topk_arguments(args, kwargs)
        route = left[0]
        if call is None or not _takes(call, route):
            return result
        scores = call["input"]
        k = route.chosen.shape[1]
        chosen = torch.as_tensor(route.chosen, device=scores.device).reshape(
            *scores.shape[:-1], k)
        own = np.sort(result.indices.detach().reshape(-1, k).cpu().numpy(), axis=-1)
        rerouted = np.flatnonzero((own != np.sort(route.chosen, axis=-1)).any(axis=-1))
        self.taken.setdefault(self.step, []).append(
            Forced(route.site, route.chosen.shape[0], rerouted.tolist()))
        return torch.return_types.topk((scores.gather(-1, chosen), chosen))


class RouteRecorder(TorchFunctionMode):
    """While entered, keeps the experts of every router-like top-k (over the last axis of
    (..., E) scores, k < E, largest first) per step, as routes a :class:`RouteForcer` can
    force into another run of the same model (swap: the pure reference's into the swapped
    one). A run without a trace of its own has no router sites: each route is named by its
    call, "top-k call n"."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.routes: dict[int, list[Route]] = {}

    def begin_step(self, step: int) -> None:
        self.step = step

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        call = _topk_arguments(args, kwargs) if func in _TOPK else None
        if call is not None and _router_like(call):
            scores = call["input"]
            routes = self.routes.setdefault(self.step, [])
            k = int(call["k"])
            routes.append(Route(self.step, f"top-k call {len(routes)}", int(scores.shape[-1]),
                                result.indices.detach().reshape(-1, k).cpu().numpy()))
        return result


class StepsOf:
    """The step loop's observer (:class:`layerdiff.capture.run.StepObserver`) that tells a
    route forcer or recorder which step runs."""

    phase = ""

    def __init__(self, mode: RouteForcer | RouteRecorder) -> None:
        self.mode = mode

    def begin_step(self, step: int) -> None:
        self.mode.begin_step(step)

    def record_loss(self, loss: torch.Tensor) -> None:
        pass

    def after_backward(self) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass


def _router_like(call: dict[str, Any]) -> bool:
    scores = call["input"]
    dim = int(call.get("dim", -1))
    return (scores.dim() >= 2 and dim in (-1, scores.dim() - 1) and scores.is_floating_point()
            and 1 <= int(call["k"]) < scores.shape[-1] and bool(call.get("largest", True)))


def _topk_arguments(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """topk's arguments by name (``input`` is the tensor for the method form too)."""
    named = dict(zip(_TOPK_PARAMETERS, args, strict=False)) | kwargs
    if "self" in named:
        named["input"] = named.pop("self")
    if not torch.is_tensor(named.get("input")) or "k" not in named:
        return None
    return named


def _takes(call: dict[str, Any], route: Route) -> bool:
    """Whether a top-k call is the router call ``route`` was recorded from."""
    scores = call["input"]
    tokens, experts, k = route.shape
    dim = int(call.get("dim", -1))
    return (scores.dim() >= 1 and dim in (-1, scores.dim() - 1) and scores.shape[-1] == experts
            and int(call["k"]) == k and bool(call.get("largest", True))
            and int(np.prod(scores.shape[:-1])) == tokens)


def describe(taken: list[Forced]) -> str:
    """One clause: how many calls were forced and how many tokens that sent elsewhere."""
    moved = sum(len(forced.rerouted) for forced in taken)
    calls = [forced for forced in taken if forced.rerouted]
    where = "; ".join(f"{forced.site}: {len(forced.rerouted)} of {forced.tokens} tokens"
                      for forced in calls[:4])
    return (f"{len(taken)} router call{'s' if len(taken) != 1 else ''} forced; "
            + (f"{moved} token{'s' if moved != 1 else ''} went to other experts than this "
               f"run's own router chose ({where}{'; …' if len(calls) > 4 else ''})" if moved
               else "every token went where this run's own router sent it"))



def forcer_from(trace: str | os.PathLike, mapping: Mapping | None = None) -> RouteForcer:
    """A forcer of the routes ``trace`` recorded (its routers declared by ``mapping`` or
    detected); refuses a trace with none."""
    from layerdiff.trace import open_trace

    with open_trace(trace) as opened:
        routes = recorded_routes(opened, mapping)
    if not routes.count():
        unread = (f" (router(s) {', '.join(routes.unreadable[:3])} were recorded as statistics "
                  "only: capture it without --summary)" if routes.unreadable else "")
        raise CaptureError(f"--force-routing {trace}: the trace records no router whose "
                           f"routes can be read{unread}; a router is a site whose output is "
                           "(..., E) expert scores beside the (T, k) expert indices taken from "
                           "them, or one declared with [[router]] in the mapping")
    return RouteForcer(routes.by_step, str(trace))
