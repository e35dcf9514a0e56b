"""``suggest_mapping``: the drafting itself, and the draft's text."""

from __future__ import annotations

import os
import textwrap
from collections import Counter, defaultdict

import numpy as np

from layerdiff.case import Case
from layerdiff.errors import CaseError, TraceError
from layerdiff.mapping import Mapping
from layerdiff.mapsuggest.calls import _Call, _PortRun, _reference_calls
from layerdiff.mapsuggest.names import (
    _LEAF_KINDS,
    _NUMBER,
    _generalise,
    _glob,
    _glob_pattern,
    _glob_pattern_first,
)
from layerdiff.mapsuggest.pairing import (
    _align,
    _confirm_by_structure,
    _fill_out_of_order,
    _Pair,
    _pair_by_structure,
    _score,
    _shape_text,
)
from layerdiff.mapsuggest.result import MapSuggestion, Suggestion
from layerdiff.mapsuggest.tensors import _find_sources, _layout, _Source
from layerdiff.mapsuggest.values import (
    VALUE_RTOL,
    _agreed_args,
    _argument_map,
    _equal,
    _equal_output,
    _other_outputs,
    _output_error,
)
from layerdiff.replay.calling import CannotCall, bind_call
from layerdiff.replay.ports import PortModel, port_model
from layerdiff.signature import Signature
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.arguments import describe_value, map_argument
from layerdiff.trace.schema import Pass, Role
from layerdiff.weights import trace_weights


def suggest_mapping(ref_trace: str | os.PathLike, port_case: Case) -> MapSuggestion:
    """Draft a mapping between the reference trace (captured with weights) and a torch or Flax
    NNX port case; see :mod:`layerdiff.mapsuggest`. Changes nothing in the port for good."""
    port = port_model(port_case, "map-suggest")
    with open_trace(ref_trace) as ref:
        if ref.summary:
            raise TraceError(f"{ref.path} is a summary trace: map-suggest needs the "
                             "reference's weights and recorded values; capture the reference "
                             "without --summary")
        weights = trace_weights(ref)
        refs = _reference_calls(ref, weights)
        with port.restored():
            return _Drafter(ref, str(ref_trace), port, weights, refs).draft()


class _Drafter:
    def __init__(self, ref: Trace, ref_path: str, port: PortModel,
                 weights: dict[str, np.ndarray], refs: list[_Call]) -> None:
        self.ref, self.ref_path, self.port, self.weights, self.refs = (ref, ref_path, port,
                                                                       weights, refs)
        self.run = _PortRun(port)
        self.ports, _ = self.run.run(keep_values=False)
        self.port_modules = set(self.run.paths)
        # reference module -> (port module, why its call needs a call adapter)
        self.adapters: dict[str, tuple[str, str]] = {}
        # reference module -> the argument heads the port's run leaves None -> port class
        self.none_inputs: dict[str, dict[str, str]] = {}
        self.ref_order: dict[str, int] = {}
        for call in refs:
            self.ref_order.setdefault(call.module, call.order)

    def draft(self) -> MapSuggestion:
        root_ref = [c for c in self.refs if not c.parent]
        root_port = [c for c in self.ports if not c.parent]
        pairs = _align(self.refs, self.ports)
        if root_ref and root_port:
            pairs[root_ref[0].site] = _Pair(root_ref[0], root_port[0], 1.0, ["the model itself"])
        _fill_out_of_order(self.refs, self.ports, pairs)
        _pair_by_structure(self.refs, self.ports, pairs)
        _confirm_by_structure(self.refs, self.ports, pairs)
        mapping, site_rules = self._site_rules(pairs, {})
        sources, missing = self._sources(mapping, pairs)
        args = self._check_values(pairs, mapping, sources)
        mapping, site_rules = self._site_rules(pairs, args)
        strays = self._strays(pairs, mapping)
        if strays:  # a glob that reaches further than its pairs: those pair one by one
            mapping, site_rules = self._site_rules(pairs, args, strays)
        sources, missing = self._sources(mapping, pairs)
        text, suggestions = self._write(pairs, site_rules, sources, missing)
        draft = _own_text(text, "draft.toml")  # the draft must read back
        tensor_sources = self._tensor_sources(draft)
        return MapSuggestion(self.ref_path, self.port.name, text, suggestions, tensor_sources,
                             [n for n, s in tensor_sources.items() if not s])

    # -- sites
    def _strays(self, pairs: dict[str, _Pair], mapping: Mapping) -> set[str]:
        """Paired reference sites that the rules send to another port site."""
        from layerdiff.compare.matching import port_site_for

        ports = set(self.port_modules)
        return {site for site, pair in pairs.items()
                if (port_site_for(site, mapping, ports) or ("",))[0] != pair.port.site}

    def _site_rules(self, pairs: dict[str, _Pair], args: dict[str, list[dict]],
                    strays: set[str] = frozenset()):
        """[[site]] suggestions (globs where every block agrees) and [[pair]] ones, and the
        Mapping they make. ``strays`` are paired one by one."""
        by_module: dict[str, list[_Pair]] = defaultdict(list)
        for pair in pairs.values():
            by_module[pair.ref.module].append(pair)
        renames, singles = [], [pairs[site] for site in sorted(strays)]
        for module, found in by_module.items():
            if any(p.ref.site in strays for p in found):
                singles += [p for p in found if p.ref.site not in strays]
                continue
            port_modules = {p.port.module for p in found}
            same_calls = all(p.ref.call == p.port.call for p in found)
            renamed = len(port_modules) == 1 and same_calls
            target = next(iter(port_modules))
            if renamed and (target == module or module not in self.port_modules):
                if target != module or _agreed_args(args.get(module, []))[0]:
                    renames.append((module, target, found))
            elif not (renamed and target == module):
                singles += found
        universe = {c.module for c in self.refs}
        rules = []
        for ref_glob, (port_glob,), members in _generalise(
                [(m, [t]) for m, t, _ in renames], universe):
            found = [p for k in members for p in renames[k][2]]
            rule_args = _agreed_args([d for k in members for d in args.get(renames[k][0], [])])
            confidence = min(p.confidence for p in found)
            evidence = _merged_evidence(found)
            if len(members) > 1:
                evidence.append(f"{len(members)} blocks agree")
            if rule_args[1]:
                evidence.append(rule_args[1])
                confidence = min(confidence, 0.4)
            rules.append(Suggestion("site", [ref_glob], [port_glob], confidence, evidence,
                                    args=rule_args[0]))
        first = {c.module: c.order for c in reversed(self.refs)}
        rules.sort(key=lambda s: (-s.reference[0].count("."),
                                  first.get(_glob_pattern_first(s.reference[0], first), 0)))
        for pair in singles:
            rules.append(Suggestion("pair", [pair.ref.site], [pair.port.site], pair.confidence,
                                    list(pair.evidence),
                                    args=_agreed_args(args.get(pair.ref.site, []))[0]))
        mapping = _own_text(_site_text(rules), "draft.toml")
        return mapping, rules

    # -- tensors
    def _sources(self, mapping: Mapping, pairs: dict[str, _Pair]):
        module_partner: dict[str, str] = {}
        confidence: dict[str, float] = {}
        for pair in pairs.values():
            module_partner.setdefault(pair.port.module, pair.ref.module)
            confidence[pair.port.module] = min(confidence.get(pair.port.module, 1.0),
                                               pair.confidence)
        module_partner = {p: ("" if r == schema.ROOT_MODULE else r)
                          for p, r in module_partner.items() if p != schema.ROOT_MODULE}
        types = {f"ref:{c.module}": c.type for c in self.refs}
        types.update((f"port:{c.module}", c.type) for c in self.ports)
        port_order: dict[str, int] = {}
        for call in self.ports:
            port_order.setdefault(call.module, call.order)
        first = {("ref", c.module): c for c in reversed(self.refs)}
        first.update((("port", c.module), c) for c in reversed(self.ports))

        def layouts(side: str, tensor: str, shape: tuple[int, ...]) -> str | None:
            module = tensor.rpartition(".")[0] or schema.ROOT_MODULE
            dense = _reference_layout if side == "ref" else self.port.dense_layout
            return _layout(first.get((side, module)), shape, dense)

        return _find_sources(self.port, self.weights, mapping, module_partner,
                             self.ref_order, confidence, types, port_order, layouts)

    def _param_mapping(self, mapping: Mapping, sources: list[_Source]) -> Mapping:
        rules = {s.rule_key(): s for s in sources if s.rule}
        text = _site_text([]) + "".join(_param_text(list(key[0]), s.reference, s.transform,
                                                    s.axis) for key, s in rules.items())
        params = _own_text(text, "draft.toml")
        mapping.param_rules = params.param_rules
        return mapping

    # -- values: confirm pairs, find which argument is which
    def _check_values(self, pairs: dict[str, _Pair], mapping: Mapping,
                      sources: list[_Source]) -> dict[str, list[dict]]:
        """Loads the draft's weights, runs the port once and reads its values: pairs confirmed
        or made by equal outputs, and each call's argument decisions (by module and site)."""
        mapping = self._param_mapping(mapping, sources)
        for found in self.port.resolve(self.weights, mapping):
            if not found.problem and found.value is not None:
                self.port.set(found.port, found.value)
        try:
            _, values = self.run.run(keep_values=True)
        except CaseError:
            return {}
        decisions: dict[str, list[dict]] = defaultdict(list)  # module, and site -> maps
        step = int(self.ref.sites["step"].min())
        index = self.ref.records(step, pass_=Pass.FORWARD, kind="tensor")
        by_site = {site: rows for site, rows in index.groupby("site")}
        self._pair_by_value(pairs, values, by_site)
        calls = []
        for pair in pairs.values():
            if pair.port.site not in values or pair.ref.site not in by_site:
                continue
            port_in, port_out = values[pair.port.site]
            rows = by_site[pair.ref.site]
            ref_out = {r["arg"]: r for _, r in rows[rows["role"] == Role.OUTPUT].iterrows()}
            error = _output_error(self.ref, ref_out, port_out)
            if error is not None and error <= VALUE_RTOL and not any(
                    e.startswith("output equals") for e in pair.evidence):
                pair.confidence = max(pair.confidence, 0.95)
                pair.evidence.insert(0, _equal_output(error))
            pair.port.other_outputs = _other_outputs(self.ref, ref_out, port_out)
            ref_in = {r["arg"]: r for _, r in rows[rows["role"] == Role.INPUT].iterrows()}
            found = _argument_map(self.ref, ref_in, port_in, upstream=bool(pair.ref.parent))
            if found:
                decisions[pair.ref.site].append(found)
                decisions[pair.ref.module].append(found)
            calls.append((pair, ref_in, port_in))
        modules = {pair.ref.module for pair, _, _ in calls}
        agreed = {module: _agreed_args(decisions.get(module, []))[0] for module in modules}
        # an argument some call (of any block alike) paired by its value is never dropped
        voted: dict[str, set[str]] = defaultdict(set)
        for module in modules:
            voted[_glob(module)[0]].update(head for found in decisions.get(module, [])
                                           for head in found)
        for pair, ref_in, port_in in calls:  # with the argument renames the calls agree on
            renames = agreed[pair.ref.module]
            paired = voted[_glob(pair.ref.module)[0]]
            dropped = {head: drop for head, drop in self._left_none(
                pair, ref_in, port_in, renames).items() if head not in paired}
            if dropped:
                decisions[pair.ref.site].append(dropped)
                decisions[pair.ref.module].append(dropped)
                for head in dropped:
                    self.none_inputs.setdefault(pair.ref.module, {})[head] = pair.port.type
            need = self._needs_adapter(pair, ref_in, port_in, renames,
                                       by_value=not pair.ref.parent)
            if need:
                self.adapters.setdefault(pair.ref.module, (pair.port.module, need))
        return decisions

    def _left_none(self, pair: _Pair, ref_in: dict, port_in: dict[str, np.ndarray],
                   renames: dict[str, str]) -> dict[str, tuple[str, int]]:
        """Reference tensor arguments bound to a port parameter that the port's own run leaves
        None (or at its default): the port makes that itself (a causal mask), so passing the
        reference's (a 4-D additive one under the same name) would feed it something else.
        Drafted as dropped (``args = { attention_mask = "" }``)."""
        signature = pair.port.signature
        if signature is None or not ref_in:
            return {}
        values, seen = [], set()
        for arg, row in ref_in.items():
            mapped = map_argument(arg, renames)
            if mapped not in seen and mapped.partition(".")[0] != "":
                seen.add(mapped)
                values.append((mapped, np.zeros(schema.parse_shape(row["shape"]), dtype=bool)))
        try:
            bound = bind_call(values, signature, reference=self._ref_signature(pair.ref.type))
        except CannotCall:
            return {}
        given = {_parameter(path, signature).partition(".")[0] for path in port_in}
        back = {new: old for old, new in bound.renamed.items()}
        unrename = {new: old for old, new in renames.items()}
        dropped = {}
        for path, _ in bound.values:
            head = path.partition(".")[0]
            if _parameter(head, signature) in given:
                continue
            ref_head = back.get(head, head)
            ref_head = unrename.get(ref_head, ref_head)
            if ref_head in ref_in or any(arg.partition(".")[0] == ref_head for arg in ref_in):
                dropped[ref_head] = ("", 2)
        return dropped

    def _needs_adapter(self, pair: _Pair, ref_in: dict, port_in: dict[str, np.ndarray],
                       renames: dict[str, str], *, by_value: bool = False) -> str | None:
        """Why the port's call of this pair cannot be made from the reference's by renaming
        (None when it can): a port input whose shape and kind no reference argument has (an
        additive float mask where the port takes a boolean one, a rotary table in another
        layout), said with the reference argument that fills that parameter once renamed as
        the draft's args rule will, or with nothing. ``by_value`` (the root, whose arguments
        nothing upstream computes): also a port input whose value no reference argument has
        (the port's tokens, HF's labels shifted right)."""
        signature = pair.port.signature
        if signature is None:
            return None
        arrays = {arg: np.asarray(self.ref.read(row)) for arg, row in ref_in.items()}
        kinds = {(value.shape, value.dtype.kind) for value in arrays.values()}
        lacking = [(path, value) for path, value in port_in.items()
                   if (value.shape, value.dtype.kind) not in kinds or (by_value and not any(
                       _equal(given, value) for given in arrays.values()))]
        if not lacking:
            return None
        path, mine = lacking[0]
        name = _parameter(path, signature)
        gets = f"the port's {signature.describe()} gets {name} {describe_value(mine)}"
        values, seen = [], set()
        for arg, value in arrays.items():
            mapped = map_argument(arg, renames)
            if mapped not in seen:
                seen.add(mapped)
                values.append((mapped, value))
        try:
            bound = bind_call(values, signature, reference=self._ref_signature(pair.ref.type),
                              where=f"port layer {pair.port.module}")
        except CannotCall:
            bound = None
        filled = None if bound is None else next(
            ((head, value) for head, value in bound.values
             if _parameter(head, signature) == name), None)
        if filled is None:
            return f"{gets}, which no argument of the reference's call gives"
        head = filled[0].partition(".")[0]
        renamed = {new: old for old, new in bound.renamed.items()}
        ref_head = renamed.get(head, head)
        ref_head = {new: old for old, new in renames.items()}.get(ref_head, ref_head)
        reference = self._ref_signature(pair.ref.type)
        if ref_head.isdigit() and reference is not None and int(ref_head) < len(
                reference.positional):
            ref_head = reference.positional[int(ref_head)].name
        described = f"positional argument {ref_head}" if ref_head.isdigit() else ref_head
        return (f"{gets} where the reference passes {described}{filled[0][len(head):]} "
                f"{describe_value(filled[1])}, which no rename turns into it")

    def _ref_signature(self, type_name: str) -> Signature | None:
        signatures = self.ref.meta.get("signatures")
        data = signatures.get(type_name) if isinstance(signatures, dict) else None
        try:
            return None if data is None else Signature.from_json(data, "signatures")
        except Exception:  # an old or odd trace: bind without it
            return None

    def _pair_by_value(self, pairs: dict[str, _Pair], values: dict, by_site: dict) -> None:
        """An unpaired reference call pairs with the unpaired port call, between the partners
        of its neighbours in call order, whose output equals its recorded output."""
        taken = {p.port.site for p in pairs.values()}
        for ref in self.refs:
            if ref.site in pairs or ref.site not in by_site:
                continue
            before = [p for p in pairs.values() if p.ref.order < ref.order]
            after = [p for p in pairs.values() if p.ref.order > ref.order]
            lo = max(before, key=lambda p: p.ref.order).port.order if before else -1
            hi = min(after, key=lambda p: p.ref.order).port.order if after else 1 << 30
            rows = by_site[ref.site]
            ref_out = {r["arg"]: r for _, r in rows[rows["role"] == Role.OUTPUT].iterrows()}
            fits = []
            for port in self.ports:
                if port.site in taken or not lo < port.order < hi or port.site not in values:
                    continue
                if ref.kind in _LEAF_KINDS and port.kind in _LEAF_KINDS and ref.kind != port.kind:
                    continue
                error = _output_error(self.ref, ref_out, values[port.site][1])
                if error is not None and error <= VALUE_RTOL:
                    fits.append((port, error))
            if not fits:
                continue
            port, error = fits[0]
            evidence = [_equal_output(error),
                        "between the partners of its neighbours in call order"]
            found = _score(ref, port)
            if found is not None:
                evidence += found[1]
            if len(fits) > 1:
                evidence.append(f"UNSURE: {len(fits)} port calls give this output; the first "
                                "was taken")
            pairs[ref.site] = _Pair(ref, port, 0.8 if len(fits) == 1 else 0.4, evidence)
            taken.add(port.site)

    # -- text
    def _write(self, pairs, site_rules, sources, missing) -> tuple[str, list[Suggestion]]:
        lines = [
            "# A draft mapping by `layerdiff map-suggest`: check it (above all the rules it",
            "# marks as unsure), then run the map-check command it printed. Each rule's comment",
            "# is its evidence: type = module classes, shape = its own tensors' shapes, output =",
            "# its first output's shape, name a~b = similar names, output equals = the port's",
            "# value with these weights loaded.",
            "version = 1", ""]
        site_rules = self._adapter_rules(site_rules)
        renamed = self._output_renames(pairs)
        _attach_output_renames(site_rules, renamed)
        suggestions = list(site_rules)
        if site_rules:
            lines.append("# ---- sites: reference module -> port module")
        for rule in site_rules:
            lines += [*_comment(rule), *_site_lines(rule), ""]
        unmatched = self._unmatched(pairs, sources) + self._none_outputs(pairs, renamed)
        if unmatched:
            lines.append("# ---- calls with no partner")
        for entry in unmatched:
            side = "reference" if entry.kind != "unmatched-port" else "port"
            name = (entry.reference or entry.port)[0]
            record = [f"output = {_q(entry.args['output'])}"] if "output" in entry.args else []
            lines += [*_comment(entry)[1:], "[[unmatched]]", f"{side} = {_q(name)}", *record,
                      f"why = {_q('; '.join(entry.evidence))}", ""]
        suggestions += unmatched
        params = self._param_suggestions(sources)
        if params:
            lines.append("# ---- port tensors that do not simply follow their module")
        for entry in params:
            lines += _comment(entry)
            lines.append(_param_text(entry.port, entry.reference, entry.transform,
                                     entry.axis).strip())
            lines.append("")
        suggestions += params
        ties = self._ties()
        if ties:
            lines += ["# ---- tied tensors", *ties, ""]
        buffers = self.port.buffers()
        for name in missing:
            why = "no reference tensor of its shape is left over"
            suggestions.append(Suggestion("param", [], [name], 0.0, [why]))
            if name in buffers:  # a mask or table the port makes itself, most likely
                lines += [f"# UNSURE: port buffer {name} has no source ({why}): declared "
                          "the port's own", "[[unmatched]]", f"port = {_q(name)}",
                          "why = " + _q("a buffer the port makes itself: " + why), ""]
            else:
                lines.append(f"# UNSURE: nothing found for port parameter {name} ({why}): "
                             "add a [[param]] rule")
        return "\n".join(lines).rstrip() + "\n", suggestions

    def _adapter_rules(self, site_rules: list[Suggestion]) -> list[Suggestion]:
        """The site rules with each call that needs an adapter marked (UNSURE, the reason, and
        a ``call =`` line to fill in); a module paired by its own name gets a rule for it."""
        rules = list(site_rules)
        for rule in rules:
            heads = sorted(head for head, target in rule.args.items() if target == "" and any(
                head in found for module, found in self.none_inputs.items()
                if _glob_pattern(rule.reference[0]).match(module)
                or rule.reference[0].partition("#")[0] == module))
            if heads:
                named = ", ".join(f"positional argument {h}" if h.isdigit() else h
                                  for h in heads)
                rule.evidence.append(f"the port's run leaves {named} None (it makes that "
                                     "itself): the reference's is dropped")
        for module, (port_module, why) in self.adapters.items():
            rule = next((r for r in rules if r.kind == "site"
                         and _glob_pattern(r.reference[0]).match(module)), None)
            if rule is None:
                rule = Suggestion("site", [module], [port_module], 1.0, ["the same name"])
                rules.insert(0, rule)
            if rule.adapter:
                continue
            rule.adapter = why
            rule.confidence = min(rule.confidence, 0.3)
            rule.evidence.append("UNSURE: needs a call adapter: " + why)
        return rules

    def _reference_outputs(self) -> dict[str, dict[str, tuple[int, ...]]]:
        """Reference site -> its recorded tensor outputs' shapes, by output path."""
        step = int(self.ref.sites["step"].min())
        rows = self.ref.records(step, role=Role.OUTPUT, pass_=Pass.FORWARD, kind="tensor")
        found: dict[str, dict[str, tuple[int, ...]]] = defaultdict(dict)
        for site, arg, shape in zip(rows["site"], rows["arg"], rows["shape"], strict=True):
            found[site][arg] = schema.parse_shape(shape)
        return found

    def _output_renames(self, pairs: dict[str, _Pair]) -> dict[str, dict[str, str]]:
        """Reference module -> {reference output: port output} where the port returns None
        at a tensor output's path and exactly one other output of that tensor's shape, which
        nothing of the same name pairs with: a port returning (cache, x) where the reference
        returns x. Declaring x [[unmatched]] would leave the call's own output unjudged."""
        outputs = self._reference_outputs()
        found: dict[str, dict[str, str]] = {}
        for pair in pairs.values():
            ref, port = outputs.get(pair.ref.site, {}), pair.port.output_shapes
            for arg in set(pair.port.none_outputs) & set(ref):
                fits = [p for p, shape in port.items() if shape == ref[arg]
                        and ref.get(p) != shape]
                if len(fits) == 1:
                    found.setdefault(pair.ref.module, {})[arg] = fits[0]
        return found

    def _none_outputs(self, pairs: dict[str, _Pair],
                      renamed: dict[str, dict[str, str]]) -> list[Suggestion]:
        """[[unmatched]] outputs: a reference output whose partner the port's run returned as
        None (an attention's weights), or as another quantity while the first output equals
        the reference's (OpenAI's attention returns its scores before the softmax where Hugging
        Face's returns the weights), which the diff would otherwise pair and fail; and one
        whose same-named port output a rename gives another (its weights, where the port's
        output 1 is the reference's output 0)."""
        outputs = {site: set(found) for site, found in self._reference_outputs().items()}
        found: dict[tuple[str, str], set[str]] = defaultdict(set)   # (module, arg) -> types
        other: dict[tuple[str, str], list[float]] = defaultdict(list)  # -> relative errors
        for pair in pairs.values():
            renames = renamed.get(pair.ref.module, {})
            for arg in set(pair.port.none_outputs) & outputs.get(pair.ref.site, set()):
                if arg not in renames:
                    found[pair.ref.module, arg].add(f"{pair.port.type}")
            for arg in set(pair.port.other_outputs) & outputs.get(pair.ref.site, set()):
                other[pair.ref.module, arg].append(pair.port.other_outputs[arg])
                found[pair.ref.module, arg].add(f"{pair.port.type}")
            for arg in outputs.get(pair.ref.site, set()) & set(renames.values()):
                if arg not in renames:
                    found[pair.ref.module, arg].add(f"{pair.port.type}")
        out, done = [], set()
        modules = {c.module for c in self.refs}
        for (module, arg), types in found.items():
            name = module
            glob = _glob(module)[0]
            if glob != module and all((m, arg) in found for m in modules
                                      if _glob_pattern(glob).match(m)):
                name = glob
            if (name, arg) in done:
                continue
            done.add((name, arg))
            renames = renamed.get(module, {})
            why = (f"the port's {', '.join(sorted(types))} returns None as output {arg}, where "
                   "the reference returns a tensor")
            if arg in renames.values():
                why = (f"the port's {', '.join(sorted(types))} output {arg} is the reference's "
                       f"output {next(r for r, p in renames.items() if p == arg)}, and nothing "
                       "of the port's pairs with this one")
            elif (module, arg) in other:
                why = (f"the port's {', '.join(sorted(types))} returns another quantity as "
                       f"output {arg} (relative error {min(other[module, arg]):.1e} with these "
                       "weights) while its output 0 equals the reference's")
            out.append(Suggestion("unmatched-output", [name], [], 0.9, [why],
                                  args={"output": arg}))
        return out

    def _unmatched(self, pairs: dict[str, _Pair], sources: list[_Source]) -> list[Suggestion]:
        taken = {p.port.site for p in pairs.values()}
        feeds: dict[str, set[str]] = defaultdict(set)   # reference module -> port tensors
        for source in sources:
            for name in source.reference:
                feeds[name.rpartition(".")[0]].add(_glob(source.port)[0])
        out = []
        for side, calls, paired in (("reference", self.refs, set(pairs)),
                                    ("port", self.ports, taken)):
            loose = [c for c in calls if c.site not in paired]
            modules = {c.module for c in calls}
            loose_modules = {c.module for c in loose} - {
                c.module for c in calls if c.site in paired}
            done = set()
            for call in loose:
                name = call.module
                for keep in range(len(_NUMBER.findall(call.module)), 0, -1):
                    glob = _glob(call.module, keep)[0]
                    if {m for m in modules if _glob_pattern(glob).match(m)} <= loose_modules:
                        name = glob
                        break
                if call.module not in loose_modules:
                    name = call.site
                if name in done:
                    continue
                done.add(name)
                why = [f"type {call.type}", "no tensors" if not call.params else
                       "tensors " + ", ".join(_shape_text(s) for s in call.params.values()),
                       f"no {'port' if side == 'reference' else 'reference'} call fits it"]
                if side == "reference" and feeds.get(call.module):
                    why.append("its tensors feed port " + ", ".join(sorted(feeds[call.module])))
                out.append(Suggestion(f"unmatched-{side}", [name] if side == "reference" else [],
                                      [name] if side == "port" else [], 0.6, why))
        return out

    def _param_suggestions(self, sources: list[_Source]) -> list[Suggestion]:
        ruled = [s for s in sources if s.rule]
        universe = set(self.port.shapes())
        out = []
        by_transform = defaultdict(list)
        for source in {s.rule_key(): s for s in ruled}.values():  # a split once
            by_transform[source.transform, source.axis].append(source)
        for (transform, axis), group in by_transform.items():
            out += self._param_group(group, transform, axis, universe)
        return _leaf_renames(out, universe)

    def _param_group(self, ruled, transform, axis, universe) -> list[Suggestion]:
        out = []
        named = [(s.group or (s.port,)) for s in ruled]
        for key_glob, others, members in _generalise(
                [(ports[0], [*ports[1:], *s.reference])
                 for ports, s in zip(named, ruled, strict=True)],
                universe):
            found = [ruled[k] for k in members]
            parts = len(named[members[0]])
            ports, refs = [key_glob, *others[:parts - 1]], others[parts - 1:]
            evidence = list(dict.fromkeys(e for s in found for e in s.evidence))[:3]
            if len(members) > 1:
                evidence.append(f"{len(members)} blocks agree")
            out.append(Suggestion("param", refs, ports, min(s.confidence for s in found),
                                  evidence, transform, axis=axis))
        return out

    def _ties(self) -> list[str]:
        lines = []
        for shared in self.ref.meta.get("shared_parameters") or []:
            if isinstance(shared, dict) and len(shared.get("users") or []) > 1:
                lines.append(f"# the reference ties {', '.join(shared['users'])} (recorded once "
                             f"as {shared.get('name')}): any of these names gives it")
        for names in self.port.ties():
            lines.append(f"# the port ties {', '.join(names)}: loaded once, as {names[0]}")
        return lines

    def _tensor_sources(self, draft: Mapping) -> dict[str, list[str]]:
        return {found.port: ([] if found.problem else list(found.source.reference))
                for found in self.port.resolve(self.weights, draft)}


def _own_text(text: str, name: str) -> Mapping:
    """A mapping from text this module wrote itself, read as a file the user passes is (its
    only code is layerdiff's own conversions: a Flax convolution kernel's layout), not as a
    trace's recorded mapping, whose code is refused."""
    from pathlib import Path

    from layerdiff.config_file import ConfigFile
    from layerdiff.errors import MappingError
    from layerdiff.mapping.rules import _load

    return _load(ConfigFile.parse(Path(name), text, MappingError))


def _leaf_renames(rules: list[Suggestion], universe: set[str]) -> list[Suggestion]:
    """One glob rule (``*.kernel`` <- ``*.weight``, transposed) for tensors renamed within
    the same module the same way: a framework's own names (Flax's kernel, scale, embedding for
    torch's weight). Only where the glob takes every port tensor of that name and nothing
    else, and only for a rename (a tensor of the same name follows its module without one)."""
    groups: dict[tuple, list[Suggestion]] = defaultdict(list)
    for rule in rules:
        if len(rule.port) != 1 or len(rule.reference) != 1 or "*" in rule.port[0]:
            continue
        port_module, _, port_leaf = rule.port[0].rpartition(".")
        ref_module, _, ref_leaf = rule.reference[0].rpartition(".")
        if port_module and port_module == ref_module and port_leaf != ref_leaf:
            groups[port_leaf, ref_leaf, rule.transform, rule.axis].append(rule)
    out = list(rules)
    for (port_leaf, ref_leaf, transform, axis), members in groups.items():
        named = {name for name in universe if name.rpartition(".")[2] == port_leaf and "." in name}
        if len(members) < 2 or named != {rule.port[0] for rule in members}:
            continue
        first = out.index(members[0])
        evidence = [f"{len(members)} tensors: each {port_leaf} is its module's {ref_leaf}"
                    + (" transposed" if transform == ("transpose",) else "")]
        evidence += [e for rule in members for e in rule.evidence if e.startswith("UNSURE")][:1]
        merged = Suggestion("param", [f"*.{ref_leaf}"], [f"*.{port_leaf}"],
                            min(rule.confidence for rule in members), evidence, transform,
                            axis=axis)
        out = [rule for rule in out if rule not in members]
        out.insert(min(first, len(out)), merged)
    return out


def _parameter(path: str, signature: Signature) -> str:
    """A call's argument path with its head named by the parameter it fills (``1.0`` ->
    ``mask.0`` for ``f(x, mask)``)."""
    head, dot, rest = path.partition(".")
    if head.isdigit() and int(head) < len(signature.positional):
        head = signature.positional[int(head)].name
    return head + dot + rest


def _reference_layout(type_name: str) -> str | None:
    """The reference is torch: its Linear keeps its weight (out, in)."""
    return "out_in" if type_name == "Linear" else None


def _merged_evidence(pairs: list[_Pair]) -> list[str]:
    counted = Counter(e for p in pairs for e in dict.fromkeys(p.evidence))
    return [e for e, n in counted.items() if n == len(pairs)] or list(pairs[0].evidence)


def _comment(rule: Suggestion) -> list[str]:
    evidence = [e for e in rule.evidence if not e.startswith("UNSURE")]
    text = "# " + ", ".join(evidence)
    lines = [text]
    if rule.unsure:
        doubt = next((e for e in rule.evidence if e.startswith("UNSURE")), None)
        doubt = doubt or f"UNSURE: confidence {rule.confidence:.2f}; check it"
        # a long doubt (a call adapter's reason) wrapped to 100 columns, as the terminal's
        lines += textwrap.wrap(doubt, 98, initial_indent="# ", subsequent_indent="#   ",
                               break_on_hyphens=False) if len(doubt) > 98 else ["# " + doubt]
    return lines


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _site_text(rules: list[Suggestion]) -> str:
    lines = ["version = 1", ""]
    for rule in rules:
        lines += [*_site_lines(rule), ""]
    return "\n".join(lines)


def _site_lines(rule: Suggestion) -> list[str]:
    """A [[site]] (or [[pair]]) rule's TOML lines."""
    table = "site" if rule.kind == "site" else "pair"
    lines = [f"[[{table}]]", f"reference = {_q(rule.reference[0])}", f"port = {_q(rule.port[0])}"]
    if rule.adapter:  # commented out: the draft must load as it is, and the function is the
        # user's to write: f(*args, **kwargs) -> (args, kwargs), see docs/replay.md
        lines.append('# call = "your_module:adapter"   # write it, uncomment this line'
                     + (', drop args' if rule.args else ''))
    if rule.args:
        lines.append("args = { " + ", ".join(f"{_q(k)} = {_q(v)}"
                                              for k, v in rule.args.items()) + " }")
    if rule.outputs:
        lines.append("outputs = { " + ", ".join(f"{_q(k)} = {_q(v)}"
                                                 for k, v in rule.outputs.items()) + " }")
    return lines


def _attach_output_renames(rules: list[Suggestion], renamed: dict[str, dict[str, str]]) -> None:
    """Each site rule gets the output renames its modules agree on (with a line of evidence);
    a module no rule names (paired by its own name) gets one."""
    for module, renames in renamed.items():
        rule = next((r for r in rules if r.kind == "site"
                     and _glob_pattern(r.reference[0]).match(module)), None)
        if rule is None:
            rule = Suggestion("site", [module], [module], 1.0, ["the same name"])
            rules.insert(0, rule)
        if rule.outputs and rule.outputs != renames:
            continue   # the modules of one glob disagree: the first one's stands
        if not rule.outputs:
            named = ", ".join(f"output {p}" for p in renames.values())
            rule.evidence.append(f"the port returns None where the reference returns its "
                                 f"output, and the tensor of its shape as {named}")
        rule.outputs = dict(renames)


def _names_text(names: list[str] | tuple[str, ...]) -> str:
    return _q(names[0]) if len(names) == 1 else "[" + ", ".join(map(_q, names)) + "]"


def _param_text(port: list[str], reference: list[str], transform: tuple[str, ...],
                axis: int = 0) -> str:
    lines = ["[[param]]", f"port = {_names_text(port)}", f"reference = {_names_text(reference)}"]
    if transform != ("copy",):
        lines.append(f"transform = {_names_text(transform)}")
    if axis:
        lines.append(f"axis = {axis}")
    return "\n" + "\n".join(lines) + "\n"
