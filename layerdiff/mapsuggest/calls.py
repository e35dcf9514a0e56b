"""What each side did: the reference's recorded calls, and the port's, seen by running its
case once with every module's ``forward`` wrapped."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from layerdiff.errors import CaseError
from layerdiff.mapsuggest.names import module_kind
from layerdiff.replay.ports import PortModel
from layerdiff.signature import Signature
from layerdiff.trace import Trace, schema
from layerdiff.trace.schema import CALL_ROLES, Pass, Role


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
    # the port's side only: its module's signature, and the outputs its run gave as None
    signature: Signature | None = None
    none_outputs: list[str] = field(default_factory=list)
    # outputs other than the first that the value run shows to be another quantity than the
    # reference's (arg -> relative error) while the first output equals it
    other_outputs: dict[str, float] = field(default_factory=dict)
    output_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # by output path

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
    """Runs the port case's forward once, seeing every module call (for torch, ``module(...)``
    and ``module.forward(...)`` alike), through the port model's ``watch``: torch's or Flax's
    (:mod:`layerdiff.replay.ports`)."""

    def __init__(self, port: PortModel) -> None:
        self.port = port
        self.paths = port.modules()   # module path -> class name

    def run(self, keep_values: bool) -> tuple[list[_Call], dict[str, tuple[dict, dict]]]:
        port = self.port
        shapes = {name: tuple(shape) for name, shape in port.shapes().items()}
        own = _own_tensors(shapes)
        calls: list[_Call] = []
        values: dict[str, tuple[dict, dict]] = {}
        stack: list[str] = []
        counts: Counter = Counter()

        def hook(path: str, type_name: str, run, args: tuple, kwargs: dict):
            site = schema.site_name(path, counts[path])
            counts[path] += 1
            call = _Call(site, path, counts[path] - 1, type_name, stack[-1] if stack else "",
                         len(calls), own.get(path, {}), None)
            call.signature = Signature.of(run)
            calls.append(call)
            stack.append(site)
            try:
                out = run(*args, **kwargs)
            finally:
                stack.pop()
            outs = port.leaves(out)
            arrays = [v for _, v in outs if port.is_array(v)]
            call.output = tuple(arrays[0].shape) if arrays else None
            call.none_outputs = [arg for arg, v in outs if v is None]
            call.output_shapes = {arg: tuple(v.shape) for arg, v in outs if port.is_array(v)}
            ins = port.leaves(args) + port.leaves(kwargs)
            first = next((v for _, v in ins if port.is_array(v)), None)
            call.input = tuple(first.shape) if first is not None else None
            if keep_values:  # copied to numpy only when the values are evidence
                given = port.arrays(args) + port.arrays(kwargs)
                made = port.arrays(out)
                # an array the port model gives no value of (a scanned layer's, traced) makes
                # the call no evidence: kept out, not taken as an argument left None
                if all(isinstance(v, np.ndarray) or not port.is_array(v)
                       for _, v in given + made):
                    values[site] = (_tensors(given), _tensors(made))
            return out

        try:
            port.watch(hook)
        except Exception as exc:
            raise CaseError(f"case {port.name}: its forward raised {type(exc).__name__} while "
                            f"map-suggest watched its calls: {exc}") from None
        return _number_siblings(calls), values


def _tensors(pairs) -> dict[str, np.ndarray]:
    return {arg: value.astype(np.float32) if np.issubdtype(value.dtype, np.floating) else value
            for arg, value in pairs if isinstance(value, np.ndarray)}
