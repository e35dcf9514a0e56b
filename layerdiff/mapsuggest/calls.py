"""What each side did: the reference's recorded calls, and the port's, seen by running its
case once with every module's ``forward`` wrapped."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import call_arguments, flatten
from layerdiff.capture.modules import named_modules
from layerdiff.case import Case, seed_everything
from layerdiff.errors import CaseError
from layerdiff.mapsuggest.names import module_kind
from layerdiff.trace import Trace, schema
from layerdiff.trace.schema import CALL_ROLES, Pass, Role
from layerdiff.weights import port_tensors


@dataclass
class _Call:
    site: str
    module: str
    call: int
    type: str
    parent: str                      # the enclosing site, '' for the outermost
    order: int
    params: dict[str, tuple[int, ...]]   # the module's own tensors: leaf name -> shape
    output: tuple[int, ...] | None    # the shape of its first output tensor
    input: tuple[int, ...] | None = None  # the shape of its first input tensor
    nth: int = 0                     # its place among its caller's calls (0: the first)
    siblings: int = 1                # how many calls its caller makes

    @property
    def kind(self) -> str:
        return module_kind(self.type)


def _reference_calls(trace: Trace, weights: dict[str, np.ndarray]) -> list[_Call]:
    sites = trace.sites
    sites = sites[sites["step"] == sites["step"].min()].sort_values("enter_seq")
    outputs: dict[str, tuple[int, ...]] = {}
    inputs: dict[str, tuple[int, ...]] = {}
    rows = trace.records(int(sites["step"].min()), pass_=Pass.FORWARD, kind="tensor")
    for site, role, shape in zip(rows["site"], rows["role"], rows["shape"], strict=True):
        if role in CALL_ROLES:
            (inputs if role == Role.INPUT else outputs).setdefault(site, schema.parse_shape(shape))
    own = _own_tensors({name: tuple(array.shape) for name, array in weights.items()})
    calls = []
    for row in sites.itertuples():
        if schema.is_op_site(row.site) or row.site == schema.LOSS_SITE:
            continue
        calls.append(_Call(row.site, row.module, int(row.call), row.type, row.parent,
                           len(calls), own.get(row.module, {}), outputs.get(row.site),
                           inputs.get(row.site)))
    return _number_siblings(calls)


def _number_siblings(calls: list[_Call]) -> list[_Call]:
    by_parent: dict[str, list[_Call]] = defaultdict(list)
    for call in calls:
        by_parent[call.parent].append(call)
    for group in by_parent.values():
        for nth, call in enumerate(group):
            call.nth, call.siblings = nth, len(group)
    return calls


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _own_tensors(shapes: dict[str, tuple[int, ...]]) -> dict[str, dict[str, tuple[int, ...]]]:
    own: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
    for name, shape in shapes.items():
        module, _, leaf = name.rpartition(".")
        own[module or schema.ROOT_MODULE][leaf] = shape
    return own


class _PortRun:
    """Runs the port case's forward once, seeing every module call (``module(...)`` and
    ``module.forward(...)`` alike) by wrapping each module's ``forward`` for the run."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self.paths = {module: path for path, module in named_modules(case.model)}

    def run(self, keep_values: bool) -> tuple[list[_Call], dict[str, tuple[dict, dict]]]:
        model = self.case.model
        shapes = {name: tuple(t.shape) for name, t in port_tensors(model).items()}
        own = _own_tensors(shapes)
        calls: list[_Call] = []
        values: dict[str, tuple[dict, dict]] = {}
        stack: list[str] = []
        counts: Counter = Counter()
        saved = []

        def wrap(module: nn.Module, path: str):
            inner = module.forward

            def forward(*args, **kwargs):
                site = schema.site_name(path, counts[path])
                counts[path] += 1
                call = _Call(site, path, counts[path] - 1, type(module).__name__,
                             stack[-1] if stack else "", len(calls), own.get(path, {}), None)
                calls.append(call)
                stack.append(site)
                try:
                    out = inner(*args, **kwargs)
                finally:
                    stack.pop()
                outs = [v for _, v in flatten(out, "") if torch.is_tensor(v)]
                call.output = tuple(outs[0].shape) if outs else None
                ins = [v for _, v in call_arguments(args, kwargs) if torch.is_tensor(v)]
                call.input = tuple(ins[0].shape) if ins else None
                if keep_values:
                    values[site] = (_tensors(call_arguments(args, kwargs)),
                                    _tensors(flatten(out, "")))
                return out
            return forward

        for module, path in self.paths.items():
            before = module.__dict__.get("forward")
            try:
                module.forward = wrap(module, path)
            except (AttributeError, TypeError, RuntimeError):
                continue  # a scripted module takes no new attributes: its calls go unseen
            saved.append((module, before))
        try:
            seed_everything(self.case.seed)
            with torch.no_grad():
                self.case.call_model()
        except Exception as exc:
            raise CaseError(f"case {self.case.name or type(model).__name__}: its forward "
                            f"raised {type(exc).__name__} while map-suggest watched its calls: "
                            f"{exc}") from None
        finally:
            for module, before in saved:
                if before is None:
                    del module.forward
                else:
                    module.forward = before
        return _number_siblings(calls), values


def _tensors(pairs) -> dict[str, np.ndarray]:
    return {arg: value.detach().cpu().float().numpy() if value.is_floating_point()
            else value.detach().cpu().numpy()
            for arg, value in pairs if torch.is_tensor(value)}
