"""Whether, and how, the port's optimizer update differs from the reference's: the update that
ended one step, rerun from the reference's inputs.

``diverge`` finds step k+1, the first whose records differ after every record of step k agreed
(its weight gradients among them). Whether the update that ended step k is the cause is a
question about the optimizer alone, so it is asked of the optimizer alone, in three bare runs
(no capture) of steps 0..k from the starting weights:

1. the reference, recording at step k its weights, its gradients as backward left them, its
   optimizer's state before the update, its weights after the update and its param groups;
2. the port, recording the same: what its update actually did;
3. the port again, given at step k (after backward, before its own clipping and optimizer step)
   the reference's weights and gradients, and the reference's optimizer state (all in the port's
   layout, through the mapping): what the port's optimizer makes of the reference's inputs.

Run 3 against the reference's weights after the update leaves only the optimizer's own
difference, ``delta``, with no gradient or earlier rounding in it (an optimizer that normalizes
each element, Adam, turns gradients that agree within rounding into whole steps of opposite
sign, so the port's actual update cannot tell a rule from rounding). Per parameter, ``delta`` is
fitted as ``a * w(k) + b * u`` (``u`` the reference's update):

- ``b`` = 0: a constant relative difference, the same on every element: weight decay (AdamW's
  ``w(k)(1 - lr*wd) - lr*u``; a = lr*wd of the reference minus that of the port);
- ``a`` = 0: the same direction, another length: the learning rate or its schedule (the step
  ratio is 1 + b);
- neither fits: the update's direction differs from the same weights, gradients and state:
  for Adam-family optimizers its moments, betas or eps.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerdiff.capture.run import run_case
from layerdiff.case import Case
from layerdiff.mapping import Mapping, ParamSource
from layerdiff.weights import as_mapping, combine, resolve_weights

# An element's update differs when it is off by more than this many roundings of the weight
# and of the update (each side rounds each once or twice; a different but correct order of
# operations a few times more).
ROUNDING_ULPS = 8
# A rule moves most elements of a parameter (measured: 37-100% for the planted optimizer bugs);
# a handful beyond rounding is not a rule.
MOVED = 0.01
# What a fit may leave of the difference and still name it; a term smaller than this share of
# the difference is taken as absent. Measured on the cases in tests/optimizer_cases.py and
# tests/test_diverge.py: a weight decay, learning rate, schedule or clipping difference leaves
# 1e-15 to 1e-4 of it; other betas 0.07-0.77 (the low end a bias of few elements, which
# _one_rule_per_group settles), another eps 0.75-1.
FIT = 0.05
# Settings that choose an implementation, not a value of the update.
IMPLEMENTATION = {"foreach", "fused", "capturable", "differentiable"}

AGREES = "agrees"
WEIGHT_DECAY = "weight decay"
STEP_SIZE = "step size"
DECAY_AND_STEP = "weight decay and step size"
DIRECTION = "direction"


@dataclass
class ParamUpdate:
    """One port parameter's update at step k, against its reference parameter(s)."""

    port: str
    reference: list[str]
    numel: int
    kind: str                         # AGREES, WEIGHT_DECAY, STEP_SIZE, DECAY_AND_STEP, DIRECTION
    moved: float                      # share of elements whose update differs beyond rounding
    update_difference: float          # |delta| / |reference's update|
    actual_difference: float | None = None  # the same for the port's own run (its own inputs)
    decay: float | None = None        # a: the port's weight after the update is w + a*w(k)
    step_ratio: float | None = None   # 1 + b: the port's step over the reference's
    residual: float | None = None     # what the fit leaves of |delta|
    cosine: float | None = None       # between the port's update (reference inputs) and the ref's
    grad_difference: float | None = None  # |g_port - g_ref| / |g_ref|, backward's gradients
    fed_ratio: float | None = None    # |gradient the port's optimizer got| / |the reference's|
    weight_difference: float | None = None  # max |w_port - w_ref| / max |w_ref| after the update
    reference_group: int | None = None
    port_group: int | None = None
    rounding: float = 0.0             # the parameter dtype's machine epsilon

    @property
    def differs(self) -> bool:
        return self.kind != AGREES

    def as_json(self) -> dict[str, Any]:
        return {key: _plain(value) for key, value in dataclasses.asdict(self).items()}


@dataclass
class UpdateEvidence:
    """The update that ended step ``step``, rerun in the port's optimizer from the reference's
    weights, gradients and (``state_given``) optimizer state. ``bool`` is whether it differs."""

    step: int
    reference_optimizer: str
    port_optimizer: str
    reference_groups: list[dict[str, Any]]
    port_groups: list[dict[str, Any]]
    params: list[ParamUpdate]
    state_given: bool
    notes: list[str] = field(default_factory=list)
    clip_grad_norm: dict[str, float | None] = field(default_factory=dict)  # by side

    def __bool__(self) -> bool:
        return any(param.differs for param in self.params)

    @property
    def differing(self) -> list[ParamUpdate]:
        return [param for param in self.params if param.differs]

    @property
    def grad_difference(self) -> tuple[float, str] | None:
        """The largest relative difference of step k's gradients, and its parameter."""
        known = [(p.grad_difference, p.port) for p in self.params
                 if p.grad_difference is not None]
        return max(known) if known else None

    def findings(self) -> list[str]:
        """One sentence per kind of difference and pair of param groups, the evidence in it."""
        groups: dict[tuple, list[ParamUpdate]] = {}
        for param in self.differing:
            groups.setdefault((param.kind, param.reference_group, param.port_group),
                              []).append(param)
        return [self._finding(kind, ref_group, port_group, params)
                for (kind, ref_group, port_group), params in groups.items()]

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "differs": bool(self),
                "reference_optimizer": self.reference_optimizer,
                "port_optimizer": self.port_optimizer,
                "reference_groups": _plain(self.reference_groups),
                "port_groups": _plain(self.port_groups),
                "state_given": self.state_given,
                "clip_grad_norm": _plain(self.clip_grad_norm), "findings": self.findings(),
                "params": [param.as_json() for param in self.params],
                "notes": list(self.notes)}

    # ---- sentences

    def _finding(self, kind: str, ref_group: int | None, port_group: int | None,
                 params: list[ParamUpdate]) -> str:
        ref = self._group("reference", ref_group)
        port = self._group("port", port_group)
        who = (f"{len(params)} parameter{'s' if len(params) != 1 else ''} "
               f"({names_said(p.port for p in params)})")
        groups = self._groups_said(ref_group, port_group)
        if kind == WEIGHT_DECAY:
            decays = [p.decay for p in params if p.decay is not None]
            way = "larger" if min(decays) > 0 else "smaller" if max(decays) < 0 else "off"
            return (f"weight decay: {who} come out of the port's update {way} by "
                    f"{_spread([abs(d) for d in decays])} x their weight before it, the same "
                    f"factor on every element (port/reference - 1 = "
                    f"{_spread(decays, signed=True)}; the fit leaves "
                    f"{_worst(params, 'residual')} of the difference); "
                    f"{self._decay_said(params, ref, port)}"
                    f"{self._settings_said(ref, port, groups, ALREADY_SAID)}")
        if kind == STEP_SIZE:
            return (f"step size: {who} move {_spread([p.step_ratio for p in params])}x as far in "
                    f"the port's update as in the reference's, in the same direction (the fit "
                    f"leaves {_worst(params, 'residual')} of the difference); "
                    f"{self._rate_said(params, ref, port)}"
                    f"{self._settings_said(ref, port, groups, ALREADY_SAID)}")
        if kind == DECAY_AND_STEP:
            return (f"weight decay and step size: {who} come out of the port's update with "
                    f"{_spread([p.decay for p in params], signed=True)} x their weight added "
                    f"and a step {_spread([p.step_ratio for p in params])}x as long "
                    f"(the fit leaves {_worst(params, 'residual')} of the difference); "
                    f"{self._decay_said(params, ref, port)}; "
                    f"{self._rate_said(params, ref, port)}"
                    f"{self._settings_said(ref, port, groups, ALREADY_SAID)}")
        cosines = [p.cosine for p in params if p.cosine is not None]
        said = (f"update direction: the port's optimizer moves {who} another way from the same "
                f"inputs (cosine with the reference's update "
                f"{min(cosines) if cosines else math.nan:.4g} at worst, differing by "
                f"{_worst(params, 'update_difference')} of it in {_worst(params, 'moved', '.0%')} "
                "of the elements; in the port's own run by "
                f"{_worst(params, 'actual_difference')}), not by a constant factor of the weight "
                "or of the update")
        if _differing_settings(ref, port):
            return said + self._settings_said(ref, port, groups)
        if "betas" in ref or "betas" in port:
            return said + ("; their groups' settings agree, so look at how the moments are "
                           "kept (bias correction, eps inside or outside the square root, "
                           "state reset or shared)")
        return said + f"; {groups} have the same settings"

    @staticmethod
    def _settings_said(ref: dict[str, Any], port: dict[str, Any], groups: str,
                       skip: frozenset[str] = frozenset()) -> str:
        """'; their groups differ in momentum (reference 0.9, port 0)', or '' when they agree
        (besides ``skip``, settings a finding has already compared)."""
        differing = [key for key in _differing_settings(ref, port) if key not in skip]
        if not differing:
            return ""
        return f"; {groups} {'also differ' if skip else 'differ'} in " + ", ".join(
            f"{key} (reference {_value(ref.get(key))}, port {_value(port.get(key))})"
            for key in differing)

    def _group(self, side: str, index: int | None) -> dict[str, Any]:
        groups = self.reference_groups if side == "reference" else self.port_groups
        return groups[index] if index is not None and 0 <= index < len(groups) else {}

    def _groups_said(self, ref_group: int | None, port_group: int | None) -> str:
        return (f"their group in the reference ({_index(ref_group)}) and in the port "
                f"({_index(port_group)})")

    def _decay_said(self, params: list[ParamUpdate], ref: dict[str, Any],
                    port: dict[str, Any]) -> str:
        measured = float(np.median([p.decay for p in params]))
        lr_r, wd_r = _number(ref.get("lr")), _number(ref.get("weight_decay"))
        lr_p, wd_p = _number(port.get("lr")), _number(port.get("weight_decay"))
        if None in (lr_r, wd_r, lr_p, wd_p):
            more = "the reference" if measured > 0 else "the port"
            return (f"{more} decays them by {abs(measured):.4g} more per step (lr x "
                    "weight_decay; the param groups do not say lr and weight_decay)")
        # with the step's length fitted apart, what is left of the decay (decoupled as AdamW's,
        # or coupled into SGD's gradient) is the port's lr times the difference of the decays
        expected = lr_p * (wd_r - wd_p)
        said = (f"lr x weight_decay is {lr_r:g} x {wd_r:g} = {lr_r * wd_r:.4g} in the "
                f"reference's group {_index(self._ref_index(params))} and {lr_p:g} x {wd_p:g} "
                f"= {lr_p * wd_p:.4g} in the port's group {_index(self._port_index(params))}, "
                + (f"a difference of {expected:.4g}" if lr_p == lr_r else
                   f"at the port's lr a difference of {expected:.4g}"))
        # each weight after the update is rounded once on each side: up to an epsilon of the
        # weight, so of a measured factor a up to epsilon / a, besides 2% for the fit itself
        close = math.isclose(measured, expected, rel_tol=0.02 + max(
            p.rounding for p in params) / max(abs(measured), 1e-30))
        if wd_p == 0 and wd_r > 0:
            verdict = "the reference decays them and the port does not"
        elif wd_r == 0 and wd_p > 0:
            verdict = "the port decays them and the reference does not"
        elif close:
            verdict = "both decay them, by different amounts"
        else:
            verdict = ("the groups' settings do not account for it: the decay is applied "
                       "differently (coupled into the gradient, or by another rate)")
        return said + (" (as measured)" if close else " (measured otherwise)") + ": " + verdict

    def _rate_said(self, params: list[ParamUpdate], ref: dict[str, Any],
                   port: dict[str, Any]) -> str:
        measured = float(np.median([p.step_ratio for p in params]))
        fed = [p.fed_ratio for p in params if p.fed_ratio is not None]
        clipped = ""
        # the same gradients went in: one that the optimizer received at another size was
        # scaled between backward and the step, by clipping or unscaling
        if fed and abs(float(np.median(fed)) - 1) > 1e-4:
            clip = self.clip_grad_norm
            clipped = (f"; the gradients the port's optimizer received are "
                       f"{float(np.median(fed)):.4g}x the reference's (clip_grad_norm: "
                       f"reference {clip.get('reference')}, port {clip.get('port')}): the "
                       "gradient clipping (or unscaling) differs")
        lr_r, lr_p = _number(ref.get("lr")), _number(port.get("lr"))
        if lr_r is None or lr_p is None or lr_r == 0:
            return "the param groups do not say their learning rate" + clipped
        said = (f"the learning rate at that update is {lr_r:g} in the reference's group "
                f"{_index(self._ref_index(params))} and {lr_p:g} in the port's group "
                f"{_index(self._port_index(params))}")
        if lr_p != lr_r:
            return said + (f" (ratio {lr_p / lr_r:.4g}"
                           + (", as measured" if math.isclose(lr_p / lr_r, measured,
                                                              rel_tol=0.02) else "")
                           + "): the learning rate or its schedule differs") + clipped
        if clipped:
            return said + ": the same rate" + clipped
        return said + (": the same rate, so a scaling inside the step differs (a schedule "
                       "applied inside it, momentum, a gradient scale)")

    def _ref_index(self, params: list[ParamUpdate]) -> int | None:
        return params[0].reference_group

    def _port_index(self, params: list[ParamUpdate]) -> int | None:
        return params[0].port_group


def compare_update(reference: Case, port: Case, starts: dict[str, dict[str, torch.Tensor]],
                   mapping: str | os.PathLike | Mapping | None, step: int) -> UpdateEvidence:
    """Rerun the update that ended ``step`` (see the module docstring). ``starts`` holds each
    side's starting state (``"reference"``, ``"port"``); both models are left at it."""
    mapping = as_mapping(mapping)
    ref_model, port_model = reference.model, port.model
    sources = _sources(ref_model, port_model, mapping)
    targets = dict(port_model.named_parameters())
    try:
        ref = _run(reference, starts["reference"], step)
        actual = _run(port, starts["port"], step)
        given = {name: (_convert(source, ref.weights_before, name, targets),
                        _convert(source, ref.grads, name, targets))
                 for name, source in sources.items()
                 if all(r in ref.grads for r in source.reference)}
        state, notes = _state_for_port(sources, ref, actual, targets)
        rerun = _run(port, starts["port"], step, given=given, state=state)
    finally:
        for case, side in ((reference, "reference"), (port, "port")):
            case.model.load_state_dict(starts[side], strict=True)
    params = [_param_update(name, source, ref, actual, rerun, targets)
              for name, source in sources.items()
              if name in given and name in rerun.weights_after]
    _one_rule_per_group(params)
    return UpdateEvidence(step, ref.optimizer, actual.optimizer, ref.groups, rerun.groups,
                          params, state is not None, notes,
                          {"reference": reference.clip_grad_norm, "port": port.clip_grad_norm})


# ---- the runs


class _Probe:
    """Watches one run of a case at step ``step``: the step loop's observer, and hooks on the
    case's optimizer. ``given`` (name -> (weight, gradient)) and ``state`` (name -> optimizer
    state) are put in at that step, after backward and before the optimizer step."""

    phase = ""

    def __init__(self, model: torch.nn.Module, step: int,
                 given: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 state: dict[str, dict[str, Any]] | None = None) -> None:
        self.params = dict(model.named_parameters(remove_duplicate=False))  # tied: every name
        self.names = {id(p): name for name, p in model.named_parameters()}
        self.step, self.current = step, -1
        self.given, self.given_state = given, state
        self.weights_before: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.fed: dict[str, torch.Tensor] = {}
        self.state: dict[str, dict[str, Any]] = {}
        self.weights_after: dict[str, torch.Tensor] = {}
        self.groups: list[dict[str, Any]] = []
        self.group_of: dict[str, int] = {}
        self.optimizer = "none"

    # the step loop's observer
    def begin_step(self, step: int) -> None:
        self.current = step

    def record_loss(self, loss: torch.Tensor) -> None:
        pass

    def end_step(self, step: int) -> None:
        pass

    @torch.no_grad()
    def after_backward(self) -> None:
        if self.current != self.step:
            return
        for name, (weight, grad) in (self.given or {}).items():
            param = self.params[name]
            param.copy_(weight)
            param.grad = grad.to(param.dtype).clone()
        self.weights_before = {n: p.detach().clone() for n, p in self.params.items()}
        self.grads = {n: p.grad.detach().clone() for n, p in self.params.items()
                      if p.grad is not None}

    # the optimizer's hooks
    def wrap(self, factory: Callable[..., torch.optim.Optimizer]
             ) -> Callable[..., torch.optim.Optimizer]:
        def build(params: Any) -> torch.optim.Optimizer:
            optimizer = factory(params)
            optimizer.register_step_pre_hook(self._before_update)
            optimizer.register_step_post_hook(self._after_update)
            return optimizer
        return build

    @torch.no_grad()
    def _before_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.current != self.step:
            return
        self.fed = {n: p.grad.detach().clone() for n, p in self.params.items()
                    if p.grad is not None}
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = self.names.get(id(param))
                if name is None:
                    continue
                self.state[name] = {key: value.detach().clone()
                                    if isinstance(value, torch.Tensor) else value
                                    for key, value in optimizer.state.get(param, {}).items()}
                if self.given_state is not None and name in self.given_state:
                    optimizer.state[param] = dict(self.given_state[name])

    @torch.no_grad()
    def _after_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.current != self.step:
            return
        self.weights_after = {n: p.detach().clone() for n, p in self.params.items()}
        self.optimizer = type(optimizer).__name__
        self.groups = [{key: _plain(value) for key, value in group.items() if key != "params"}
                       for group in optimizer.param_groups]
        self.group_of = {self.names[id(p)]: index
                         for index, group in enumerate(optimizer.param_groups)
                         for p in group["params"] if id(p) in self.names}


def _run(case: Case, start: dict[str, torch.Tensor], step: int, **given: Any) -> _Probe:
    case.model.load_state_dict(start, strict=True)
    probe = _Probe(case.model, step, **given)
    run_case(dataclasses.replace(case, optimizer=probe.wrap(case.optimizer)), steps=step + 1,
             observer=probe)
    return probe


# ---- names and layouts


def _sources(ref_model: torch.nn.Module, port_model: torch.nn.Module,
             mapping: Mapping) -> dict[str, ParamSource]:
    """Each port parameter that the reference provides: which reference parameters, how."""
    shapes = {name: np.zeros(tuple(p.shape), dtype=np.float32)
              for name, p in ref_model.named_parameters(remove_duplicate=False)}
    shapes.update((name, np.zeros(tuple(b.shape), dtype=np.float32))
                  for name, b in ref_model.named_buffers())
    params = dict(port_model.named_parameters())
    return {found.port: found.source for found in resolve_weights(port_model, shapes, mapping)
            if found.port in params and not found.problem}


def _convert(source: ParamSource, tensors: dict[str, torch.Tensor], name: str,
             targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference tensors (weights, gradients, moments) in the port parameter ``name``'s
    layout, through the mapping's chain."""
    parts = [_numpy(tensors[ref]) for ref in source.reference]
    target = targets[name]
    value = torch.from_numpy(np.array(combine(source, parts, port=name), order="C"))
    return value.to(device=target.device, dtype=target.dtype)


def _state_for_port(sources: dict[str, ParamSource], ref: _Probe, port: _Probe,
                    targets: dict[str, torch.Tensor]
                    ) -> tuple[dict[str, dict[str, Any]] | None, list[str]]:
    """The reference's optimizer state before the update, in the port's layout, where the
    port's optimizer keeps the same kinds of state; None (and why) where it does not."""
    state: dict[str, dict[str, Any]] = {}
    for name, source in sources.items():
        own = port.state.get(name, {})
        theirs = [ref.state.get(r, {}) for r in source.reference]
        if set(own) != set(theirs[0]) or any(set(t) != set(theirs[0]) for t in theirs):
            return None, [f"the port's optimizer keeps other state than the reference's "
                          f"({name}: {sorted(own)} against {sorted(theirs[0])}), so it ran "
                          "from its own"]
        shape = tuple(targets[name].shape)
        given: dict[str, Any] = {}
        for key in own:
            values = [t[key] for t in theirs]
            if isinstance(values[0], torch.Tensor) and values[0].ndim > 0:
                converted = _convert(source, {r: v for r, v in zip(source.reference, values,
                                                                    strict=True)},
                                     name, targets).to(own[key].dtype)
                if tuple(converted.shape) != shape and tuple(converted.shape) != tuple(
                        own[key].shape):
                    return None, [f"the reference's optimizer state {key!r} of {name} does "
                                  "not fit the port's, so it ran from its own"]
                given[key] = converted
            else:
                given[key] = values[0].clone() if isinstance(values[0], torch.Tensor) \
                    else values[0]
        state[name] = given
    return state, []


# ---- one parameter


def _param_update(name: str, source: ParamSource, ref: _Probe, actual: _Probe, rerun: _Probe,
                  targets: dict[str, torch.Tensor]) -> ParamUpdate:
    def converted(tensors: dict[str, torch.Tensor]) -> np.ndarray:
        return _float64(_convert(source, tensors, name, targets))

    before, after = converted(ref.weights_before), converted(ref.weights_after)
    update = after - before
    delta = _float64(rerun.weights_after[name]) - after
    eps = torch.finfo(rerun.weights_after[name].dtype).eps
    allowed = ROUNDING_ULPS * eps * (np.abs(after) + np.abs(update))
    moved = float(np.mean(np.abs(delta) > allowed)) if delta.size else 0.0
    size = _norm(delta)
    port_update = delta + update
    result = ParamUpdate(
        name, list(source.reference), int(delta.size), AGREES, moved,
        _ratio(size, _norm(update)),
        actual_difference=_ratio(_norm(_float64(actual.weights_after[name])
                                       - _float64(actual.weights_before[name]) - update),
                                 _norm(update)),
        cosine=_ratio(float(np.dot(port_update.ravel(), update.ravel())),
                      _norm(port_update) * _norm(update)),
        grad_difference=_ratio(_norm(_float64(actual.grads[name]) - converted(ref.grads)),
                               _norm(converted(ref.grads))) if name in actual.grads else None,
        fed_ratio=_fed_ratio(name, source, ref, rerun, targets),
        weight_difference=_ratio(float(np.max(np.abs(_float64(actual.weights_after[name])
                                                     - after), initial=0.0)),
                                 float(np.max(np.abs(after), initial=0.0))),
        reference_group=ref.group_of.get(source.reference[0]),
        port_group=rerun.group_of.get(name), rounding=float(eps))
    if moved <= MOVED:
        return result
    columns = np.stack([before.ravel(), update.ravel()], axis=1)
    (a, b), *_ = np.linalg.lstsq(columns, delta.ravel(), rcond=None)
    result.residual = _ratio(_norm(delta.ravel() - columns @ np.array([a, b])), size)
    # A term is there when it explains well over what the fit leaves (noise projects onto a
    # term at about the residual's size) and at least a thousandth of the difference.
    floor = max(10 * (result.residual or 0.0), 1e-3)
    has_decay, has_step = _norm(a * before) / size > floor, _norm(b * update) / size > floor
    # A decay takes a share of the weight (|a| < 1) and a step keeps its direction (1 + b > 0);
    # a fit outside that is a coincidence of few elements, not a rule.
    if result.residual is None or result.residual > FIT or abs(a) >= 1 or 1 + b <= 0:
        result.kind = DIRECTION
    elif not has_step:
        result.kind, result.decay = WEIGHT_DECAY, float(a)
    elif not has_decay:
        result.kind, result.step_ratio = STEP_SIZE, float(1 + b)
    else:
        result.kind, result.decay, result.step_ratio = DECAY_AND_STEP, float(a), float(1 + b)
    return result


def _one_rule_per_group(params: list[ParamUpdate]) -> None:
    """An optimizer's settings act on a whole param group: where some parameters of a pair of
    groups (the reference's, the port's) change direction, those that fitted a factor fitted
    it by chance (a bias of a few elements fits two numbers easily), so they change direction
    too."""
    pairs: dict[tuple[int | None, int | None], list[ParamUpdate]] = {}
    for param in params:
        if param.differs:
            pairs.setdefault((param.reference_group, param.port_group), []).append(param)
    for members in pairs.values():
        if any(p.kind == DIRECTION for p in members):
            for param in members:
                param.kind, param.decay, param.step_ratio = DIRECTION, None, None


def _fed_ratio(name: str, source: ParamSource, ref: _Probe, rerun: _Probe,
               targets: dict[str, torch.Tensor]) -> float | None:
    """How the gradient the port's optimizer received (the reference's, after the port's
    clipping) compares in size with the one the reference's optimizer received."""
    if name not in rerun.fed or not all(r in ref.fed for r in source.reference):
        return None
    return _ratio(_norm(_float64(rerun.fed[name])),
                  _norm(_float64(_convert(source, ref.fed, name, targets))))


# ---- small helpers


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _float64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().cpu().double().numpy()


def _norm(values: np.ndarray) -> float:
    return float(np.linalg.norm(values.ravel()))


def _ratio(top: float, bottom: float) -> float | None:
    return top / bottom if bottom > 0 and math.isfinite(top / bottom) else None


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _plain(value: Any) -> Any:
    """A param group's value, or a measurement, as JSON can hold it."""
    if isinstance(value, torch.Tensor):
        return _plain(value.item()) if value.numel() == 1 else None
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


def names_said(names: Any, shown: int = 4) -> str:
    """'a, b, c, d and 3 more'."""
    names = list(names)
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more"
                                       if len(names) > shown else "")


def _index(index: int | None) -> str:
    return "?" if index is None else str(index)


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(_value(v) for v in value) + ")"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _spread(values: list[float | None], signed: bool = False) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "?"
    low, high = min(known), max(known)
    form = "+.4g" if signed else ".4g"
    if math.isclose(low, high, rel_tol=5e-3):
        return format(float(np.median(known)), form)
    return f"{format(low, form)} to {format(high, form)}"


def _worst(params: list[ParamUpdate], attribute: str, form: str = ".2g") -> str:
    known = [getattr(p, attribute) for p in params if getattr(p, attribute) is not None]
    return format(max(known), form) if known else "?"


# settings the decay and step-size sentences already compare side by side
ALREADY_SAID = frozenset({"lr", "weight_decay", "initial_lr"})


def _differing_settings(ref: dict[str, Any], port: dict[str, Any]) -> list[str]:
    return [key for key in ref if key in port and key not in IMPLEMENTATION
            and ref[key] != port[key]]


__all__ = ["ParamUpdate", "UpdateEvidence", "compare_update"]
