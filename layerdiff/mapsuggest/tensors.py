"""Where each port tensor comes from: its module's partner's tensor, transposed where shapes or
layouts say so, else left-over reference tensors: one, several stacked, or one split."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from layerdiff.mapping import Mapping
from layerdiff.mapsuggest.calls import _Call
from layerdiff.mapsuggest.names import _tokens
from layerdiff.mapsuggest.pairing import _shape_text
from layerdiff.trace import schema
from layerdiff.weights import SHAPE_MISMATCH


@dataclass
class _Source:
    port: str
    reference: list[str]
    transform: tuple[str, ...]
    confidence: float
    evidence: list[str]
    rule: bool          # needs a [[param]] rule (does not follow its module)
    group: tuple[str, ...] = ()   # split: every port tensor of the split, in order
    axis: int = 0

    def rule_key(self) -> tuple:
        """Sources that one [[param]] rule gives share this (a split's parts share theirs)."""
        return (self.group or (self.port,), tuple(self.reference), self.transform, self.axis)


def _find_sources(port, weights: dict[str, np.ndarray], mapping: Mapping,
                  module_partner: dict[str, str], ref_order: dict[str, int],
                  module_confidence: dict[str, float], types: dict[str, str],
                  port_order: dict[str, int],
                  layouts) -> tuple[list[_Source], list[str]]:
    """Each port tensor's source: its module's partner's tensor, transposed where the shapes
    say so, else a leftover reference tensor of its shape, or several stacked."""
    assignments = port.resolve(weights, mapping)
    shapes = {name: tuple(a.shape) for name, a in weights.items()}
    used: set[str] = set()
    sources: dict[str, _Source] = {}
    open_: list[tuple[str, tuple[int, ...], str]] = []   # (port name, shape, why)
    for found in assignments:
        module = found.port.rpartition(".")[0]
        confidence = module_confidence.get(module, 0.6)
        refs = found.source.reference
        if not found.problem:
            used.update(refs)
            sources[found.port] = _Source(found.port, refs, ("copy",), confidence, [
                f"follows its module, shape {_shape_text(found.shape)}"], False)
        elif (found.problem == SHAPE_MISMATCH and len(refs) == 1
              and tuple(reversed(shapes[refs[0]])) == found.shape and len(found.shape) == 2):
            used.update(refs)
            sources[found.port] = _Source(found.port, refs, ("transpose",), confidence, [
                f"shape {_shape_text(found.shape)} is the reference's "
                f"{_shape_text(shapes[refs[0]])} transposed"], True)
        else:
            open_.append((found.port, found.shape, found.problem))
    _transpose_square(sources, shapes, types, layouts)
    decided = set(sources)
    free = {name for name in weights if name not in used}
    conversions = port.layout_conversions()
    _pick_singles(open_, shapes, free, module_partner, sources, unique_only=True,
                  conversions=conversions)
    _pick_stacks(open_, shapes, free, module_partner, ref_order, sources)
    _pick_splits(open_, shapes, free, module_partner, port_order, sources, layouts)
    _pick_singles(open_, shapes, free, module_partner, sources, unique_only=False,
                  conversions=conversions)
    # a square weight picked under another name (Flax's kernel for torch's weight) has its
    # layout decided as one that follows its module
    _transpose_square(sources, shapes, types, layouts, set(sources) - decided)
    order = list(port.shapes())
    missing = [name for name, _, _ in open_ if name not in sources]
    return [sources[name] for name in order if name in sources], missing


def _layout(call: _Call | None, shape: tuple[int, ...], dense) -> str | None:
    """How a dense layer keeps a 2-D weight: "out_in" (torch's Linear) or "in_out" (Hugging
    Face's Conv1D, Flax), from its call's input and output widths, else from its class as its
    framework keeps it (``dense(class name)``: torch's Linear (out, in), Flax's (in, out));
    None when neither tells."""
    if call is None or len(shape) != 2 or call.kind != "dense":
        return None
    if call.input and call.output:
        widths = (call.output[-1], call.input[-1])
        if shape == widths and shape != widths[::-1]:
            return "out_in"
        if shape == widths[::-1] and shape != widths:
            return "in_out"
    return dense(call.type)


def _layout_text(layout: str) -> str:
    return "(" + layout.replace("_", ", ") + ")"


def _transpose_square(sources: dict[str, _Source], shapes: dict[str, tuple[int, ...]],
                      types: dict[str, str], layouts, only: set[str] | None = None) -> None:
    """A square weight fits both ways round: it is transposed when every non-square weight
    of the same leaf, between modules of the same two classes, needed a transpose (Hugging
    Face's Conv1D keeps (in, out) where nn.Linear keeps (out, in))."""
    def classes(source: _Source) -> tuple[str, str, str]:
        ref = source.reference[0]
        return (types.get("ref:" + ref.rpartition(".")[0], "?"),
                types.get("port:" + source.port.rpartition(".")[0], "?"),
                source.port.rsplit(".", 1)[-1])

    votes: dict[tuple[str, str, str], list[bool]] = defaultdict(list)
    for source in sources.values():
        shape = shapes[source.reference[0]]
        if len(source.reference) == 1 and len(shape) == 2 and shape[0] != shape[1]:
            votes[classes(source)].append(source.transform == ("transpose",))
    for source in sources.values():
        shape = shapes[source.reference[0]]
        if len(source.reference) != 1 or len(shape) != 2 or shape[0] != shape[1] or (
                only is not None and source.port not in only):
            continue
        key = classes(source)
        seen = votes.get(key, [])
        sides = (layouts("ref", source.reference[0], shape), layouts("port", source.port, shape))
        if None not in sides:
            if sides[0] != sides[1] and source.transform == ("copy",):
                source.transform, source.rule = ("transpose",), True
                source.evidence = [f"square {_shape_text(shape)}: the reference's {key[0]} "
                                   f"keeps it {_layout_text(sides[0])}, the port's {key[1]} "
                                   f"{_layout_text(sides[1])}"]
            continue
        if seen and all(seen) and source.transform == ("copy",):
            source.transform, source.rule = ("transpose",), True
            source.evidence = [f"square {_shape_text(shape)}: the other {len(seen)} "
                               f"{key[2]}s of {key[0]} -> {key[1]} are transposed"]
        elif seen and any(seen):
            source.confidence = min(source.confidence, 0.3)
            source.evidence.append(f"UNSURE: square {_shape_text(shape)}, and {sum(seen)} of "
                                   f"{len(seen)} other {key[2]}s of {key[0]} -> {key[1]} are "
                                   "transposed")
            source.rule = True


def _anchor(port_name: str, module_partner: dict[str, str]) -> str | None:
    """The reference module under which a port tensor's source should lie: the partner of
    its module or of its nearest paired ancestor."""
    module = port_name.rpartition(".")[0]
    while True:
        if module in module_partner:
            return module_partner[module]
        if not module:
            return None
        module = module.rpartition(".")[0]


def _under(anchor: str | None, names: set[str]) -> list[str]:
    if anchor in (None, "", schema.ROOT_MODULE):
        return sorted(names)
    return sorted(n for n in names if n.startswith(anchor + "."))


def _pick_singles(open_, shapes, free, module_partner, sources, *, unique_only: bool,
                  conversions=()) -> None:
    for port, shape, _ in open_:
        if port in sources:
            continue
        pool = _under(_anchor(port, module_partner), free)
        where = "under the partner module"
        if not pool:
            pool, where = sorted(free), "in the reference (nothing under the partner module)"
        # a layout the port's framework keeps otherwise (Flax's HWIO convolution kernels)
        fits = [(ref, name) for name, layout in conversions for ref in pool
                if shapes[ref] != shape and layout(shapes[ref]) == shape]
        fits += [(ref, "copy") for ref in pool if shapes[ref] == shape]
        if len(shape) == 2 and shape[0] != shape[1]:
            fits += [(ref, "transpose") for ref in pool if shapes[ref] == shape[::-1]]
        if not fits:
            continue
        ranked = sorted(fits, key=lambda f: -_tensor_similarity(f[0], port))
        best = _tensor_similarity(ranked[0][0], port)
        tied = len(ranked) > 1 and _tensor_similarity(ranked[1][0], port) >= best
        if unique_only and (tied or best <= 0):
            continue
        ref, how = ranked[0]
        free.discard(ref)
        evidence = [f"left over {where}, shape {_shape_text(shapes[ref])}"
                    + (" transposed" if how == "transpose" else "")
                    + (f" as {_shape_text(shape)} through {how}" if ":" in how else "")]
        if best > 0:
            evidence.append(f"name {ref.rsplit('.', 2)[-2] if '.' in ref else ref}~"
                            f"{port.rsplit('.', 1)[-1]}")
        if tied or best <= 0:
            evidence.append(f"UNSURE: {len(fits)} left-over tensors fit and the names do not "
                            "decide; the first in name order was taken")
        sources[port] = _Source(port, [ref], (how,), 0.75 if not tied and best > 0 else 0.3,
                                evidence, True)


def _tensor_similarity(ref: str, port: str) -> float:
    """Names of tensors: the module segment and the leaf ('w_o.weight' ~ 'out_proj_weight')."""
    ref_words = set().union(*(_tokens(p) for p in ref.split(".")[-2:]))
    port_words = set().union(*(_tokens(p) for p in port.split(".")[-2:]))
    leaf_bonus = 0.5 if ref.rsplit(".", 1)[-1] == port.rsplit(".", 1)[-1] else 0.0
    return len(ref_words & port_words) / max(1, len(ref_words | port_words)) + leaf_bonus


def _pick_stacks(open_, shapes, free, module_partner, ref_order, sources) -> None:
    """A port tensor that is several leftover reference tensors stacked along axis 0, in the
    order their modules are called (fused q, k, v)."""
    for port, shape, _ in open_:
        if port in sources or not shape:
            continue
        leaf = port.rsplit(".", 1)[-1]
        pool = _under(_anchor(port, module_partner), free)
        candidates = [r for r in pool if len(shapes[r]) == len(shape)
                      and shapes[r][1:] == shape[1:]
                      and _leaf_kind(r.rsplit(".", 1)[-1]) == _leaf_kind(leaf)]
        candidates.sort(key=lambda r: ref_order.get(r.rpartition(".")[0], 1 << 30))
        runs = []
        for start in range(len(candidates)):
            total = 0
            for stop in range(start, len(candidates)):
                total += shapes[candidates[stop]][0]
                if total == shape[0] and stop > start:
                    runs.append(candidates[start:stop + 1])
                if total >= shape[0]:
                    break
        if not runs:
            continue
        run = runs[0]
        free.difference_update(run)
        names = ", ".join(r.rsplit(".", 2)[-2] for r in run)
        sources[port] = _Source(port, run, ("concat",), 0.6 if len(runs) == 1 else 0.3, [
            f"shape {_shape_text(shape)} is {names} {'/'.join(_shape_text(shapes[r]) for r in run)}"
            " stacked on axis 0 in call order"], True)


def _pick_splits(open_, shapes, free, module_partner, port_order, sources, layouts) -> None:
    """Several port tensors of one shape that are one leftover reference tensor cut into
    equal parts along an axis (transposed first where that fits), in the order the port calls
    their modules (a fused reference qkv against separate q, k, v)."""
    groups: dict[tuple, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for port, shape, _ in open_:
        if port not in sources and shape:
            anchor = _anchor(port, module_partner)
            groups[anchor, port.rsplit(".", 1)[-1]].append((port, shape))
    for (anchor, leaf), members in groups.items():
        members.sort(key=lambda m: port_order.get(m[0].rpartition(".")[0], 1 << 30))
        _split_group(anchor, leaf, members, "in call order", shapes, free, sources, layouts)
    # several tensors of one shape under one port module, with names of their own (stacked
    # experts' w1 and w3 against HF's gate_up_proj): in the order the module holds them
    held: dict[tuple, list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for port, shape, _ in open_:
        if port not in sources and shape:
            held[_anchor(port, module_partner), port.rpartition(".")[0], shape].append(
                (port, shape))
    for (anchor, _, _), members in held.items():
        if len(members) > 1:
            _split_group(anchor, members[0][0].rsplit(".", 1)[-1], members,
                         "in the order the port's module holds them", shapes, free, sources,
                         layouts, unsure="which part is which is only the order the port's "
                         "module holds them in; check it against the reference's code")


def _split_group(anchor, leaf, members, order: str, shapes, free, sources, layouts,
                 unsure: str = "") -> None:
    """One group of port tensors against each leftover reference tensor under ``anchor``;
    ``unsure`` marks every rule it writes (the order of the parts is a guess)."""
    for ref in _under(anchor, free):
        if _leaf_kind(ref.rsplit(".", 1)[-1]) != _leaf_kind(leaf):
            continue
        left = [m for m in members if m[0] not in sources]
        sides = (layouts("ref", ref, shapes[ref]),
                 layouts("port", left[0][0], left[0][1]) if left else None)
        want = None if None in sides else sides[0] != sides[1]
        found = _split_of(shapes[ref], left, want)
        if found is None:
            continue
        run, chain, axis, other = found
        free.discard(ref)
        names = tuple(port for port, _ in run)
        evidence = [f"{_shape_text(shapes[ref])}{' transposed' if 'transpose' in chain else ''}"
                    f" is {len(run)} equal parts along axis {axis}: "
                    + ", ".join(_part_name(n, names) for n in names) + f", {order}"]
        if want is not None:
            evidence.append(f"the reference keeps it {_layout_text(sides[0])}, the "
                            f"port {_layout_text(sides[1])}")
        elif other:
            evidence.append("UNSURE: the parts fit with and without a transpose, and "
                            "nothing says which layout each side keeps")
        if unsure:
            evidence.append(f"UNSURE: {unsure}")
        low = unsure or (other and want is None)
        for port in names:
            sources[port] = _Source(port, [ref], chain, 0.3 if low else 0.6, list(evidence),
                                    True, names, axis)


def _part_name(name: str, names: tuple[str, ...]) -> str:
    """A part's module name, or its own name where the parts share one module."""
    modules = {n.rpartition(".")[0] for n in names}
    return name.rsplit(".", 1)[-1] if len(modules) == 1 else name.rsplit(".", 2)[-2]


def _split_of(shape: tuple[int, ...], members: list[tuple[str, tuple[int, ...]]],
              transpose: bool | None):
    """(the run of members, the chain, the axis, whether the other layout fits too) whose
    equal parts make ``shape``; ``transpose`` says which layout, None: either."""
    layouts = [(shape, ("split",))]
    if len(shape) == 2 and shape[0] != shape[1]:
        layouts.append((shape[::-1], ("transpose", "split")))
    if transpose is not None:
        layouts = [layout for layout in layouts if ("transpose" in layout[1]) == transpose]
    fits = [found for whole, chain in layouts
            if (found := _split_layout(whole, chain, members)) is not None]
    return (*fits[0], len(fits) > 1) if fits else None


def _split_layout(whole: tuple[int, ...], chain: tuple[str, ...],
                  members: list[tuple[str, tuple[int, ...]]]):
    """The first run of members of one shape whose equal parts along an axis make ``whole``."""
    for axis in range(len(whole)):
        for start, (_, part) in enumerate(members):
            if len(part) != len(whole) or not part[axis] or whole[axis] % part[axis]:
                continue
            count = whole[axis] // part[axis]
            run = members[start:start + count]
            same_rest = all(part[i] == whole[i] for i in range(len(whole)) if i != axis)
            if count > 1 and len(run) == count and same_rest and all(m[1] == part
                                                                     for m in run):
                return run, chain, axis
    return None


def _leaf_kind(leaf: str) -> str:
    return "bias" if "bias" in leaf else "weight"
