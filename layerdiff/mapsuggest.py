"""``suggest_mapping``: a first draft of a mapping file, from a reference trace and a port case.

``suggest_mapping("ref.h5", port_case)`` pairs the port's module calls and tensors with the
reference's and writes the pairs as a mapping (TOML that :meth:`Mapping.load` reads), every
rule commented with the evidence it stands on and the doubtful ones marked ``# UNSURE:``.

The evidence, strongest first:

1. **Values.** The draft's weights are loaded into the port (on a copy of its state, put back
   afterwards) and the port runs the case's forward once: a port call whose output equals the
   reference's recorded output at its paired site confirms the pair, and inputs that equal the
   reference's arguments by value say which argument is which (``args`` rules).
2. **Type and shapes.** A module's class name and kind (dense: ``nn.Linear`` and Hugging Face's
   ``Conv1D``, which stores its weight transposed; norms; embeddings; ...), the shapes of its own
   parameters (as they are, or transposed), and the shape of its output.
3. **Execution order.** Both call sequences (the reference's recorded sites; the port's, seen by
   wrapping every module's ``forward`` while its case runs once, so a module called as
   ``child.forward(...)`` is seen too) are aligned so that pairs keep their order.
4. **Call structure.** A call that holds no parameters pairs with the port call that holds the
   partners of its children; pairs inside repeated blocks become one glob rule only where every
   instance agrees.
5. **Names.** Tokens of the module names, with a small table of common naming conventions
   (:data:`SYNONYMS`: ``wq``~``q_proj``, ``w1``~``gate_proj``, ``attention_norm``~
   ``input_layernorm``, ``tok_embeddings``~``embed_tokens``, ``output``~``lm_head`` ...).

Port tensors that no module pair gives get a ``[[param]]`` rule: a reference tensor of the same
shape (or transposed) left over under the paired module, or several stacked along axis 0 in
call order (a fused projection: ``concat``).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import flatten
from layerdiff.case import Case, seed_everything
from layerdiff.errors import CaseError, TraceError
from layerdiff.mapping import Mapping
from layerdiff.replay.torch_replay import restored
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.weights import SHAPE_MISMATCH, port_tensors, resolve_weights, trace_weights

UNSURE_BELOW = 0.5      # a guess with less confidence than this is marked UNSURE
PAIR_SCORE = 3.0        # the least score a call pair needs from type, shapes, output and name
VALUE_RTOL = 1e-3       # a port value this close (relative Frobenius) to the reference's is it

# Common naming conventions: each line is one meaning; a name token (or a whole name segment)
# on it counts as the same word as any other on it. Add conventions here, never model names.
SYNONYMS: tuple[tuple[str, ...], ...] = (
    ("query", "q", "wq", "q_proj", "to_q", "q_lin"),
    ("key", "k", "wk", "k_proj", "to_k", "k_lin"),
    ("value", "v", "wv", "v_proj", "to_v", "v_lin"),
    ("out", "o", "wo", "o_proj", "out_proj", "to_out", "out_lin", "dense"),
    ("attention", "attn", "self_attn", "selfattention", "att", "self_attention"),
    ("mlp", "ffn", "feed_forward", "feedforward", "ff", "ffwd"),
    ("gate", "w1", "gate_proj", "wi_0", "c_fc"),
    ("up", "w3", "up_proj", "wi_1"),
    ("down", "w2", "down_proj", "c_proj"),
    ("attn_norm", "attention_norm", "input_layernorm", "ln_1", "ln1", "norm1", "attn_ln"),
    ("ffn_norm", "post_attention_layernorm", "ln_2", "ln2", "norm2", "mlp_ln", "ffn_ln"),
    ("final_norm", "ln_f", "norm", "final_layernorm", "final_norm", "norm_f"),
    ("embed", "tok_embeddings", "embed_tokens", "wte", "embedding", "embeddings", "lut",
     "word_embeddings", "tok_emb", "token_embedding"),
    ("position", "wpe", "pos", "position_embeddings", "pos_embed", "pos_emb"),
    ("head", "output", "lm_head", "generator", "unembed"),
    ("layers", "h", "blocks", "layer", "block"),
    ("act", "activation", "act_fn", "gelu", "relu", "silu", "nonlinearity"),
)
_CANON = {word: words[0] for words in SYNONYMS for word in words}

# Module kinds by class name: two calls of different known kinds never pair.
_KINDS = (("dense", r"^(Linear|Conv1D|Dense|.*Linear)$"), ("embedding", r"Embedding"),
          ("norm", r"Norm"), ("dropout", r"Dropout"), ("conv", r"^Conv[123]d$|Conv"),
          ("act", r"GELU|ReLU|SiLU|Tanh|Sigmoid|Activation|Swish|Mish|Softmax"),
          ("attention", r"Attention|Attn"), ("mlp", r"MLP|FeedForward|FFN"),
          ("rotary", r"Rotary|RoPE"))
_LEAF_KINDS = {"dense", "embedding", "norm", "dropout", "conv", "act"}


def module_kind(type_name: str) -> str:
    """What a module class computes, from its name: dense, norm, embedding, ... or other."""
    for kind, pattern in _KINDS:
        if re.search(pattern, type_name):
            return kind
    return "other"


# ---- the result

@dataclass
class Suggestion:
    """One drafted rule: what it pairs, how sure, and the evidence."""

    kind: str                  # site | pair | param | unmatched-reference | unmatched-port
    reference: list[str]
    port: list[str]
    confidence: float
    evidence: list[str]
    transform: tuple[str, ...] = ("copy",)
    args: dict[str, str] = field(default_factory=dict)
    axis: int = 0

    @property
    def unsure(self) -> bool:
        return self.confidence < UNSURE_BELOW

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "reference": list(self.reference), "port": list(self.port),
                "confidence": round(self.confidence, 3), "unsure": self.unsure,
                "evidence": list(self.evidence), "transform": list(self.transform),
                "axis": self.axis, "args": dict(self.args)}


@dataclass
class MapSuggestion:
    """The draft: its TOML text and the rules with their evidence. True when every port
    tensor got a source."""

    reference: str
    port: str
    text: str
    suggestions: list[Suggestion]
    tensor_sources: dict[str, list[str]]     # port tensor -> reference tensors the draft gives
    without_source: list[str]                # port tensors nothing in the draft gives

    def __bool__(self) -> bool:
        return not self.without_source

    @property
    def unsure(self) -> list[Suggestion]:
        return [s for s in self.suggestions if s.unsure]

    def as_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "port": self.port, "text": self.text,
                "suggestions": [s.as_json() for s in self.suggestions],
                "tensor_sources": self.tensor_sources, "without_source": self.without_source}

    def format(self) -> str:
        return self.text

    def next_command(self, mapping_path: str, port_spec: str) -> str:
        return f"layerdiff map-check {self.reference} {port_spec} --map {mapping_path}"


# ---- what each side did

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
    rows = trace.records(int(sites["step"].min()), pass_="forward", kind="tensor")
    for site, role, shape in zip(rows["site"], rows["role"], rows["shape"], strict=True):
        if role in ("input", "output"):
            (inputs if role == "input" else outputs).setdefault(site, schema.parse_shape(shape))
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
        self.paths = {module: name or schema.ROOT_MODULE
                      for name, module in case.model.named_modules()}

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
                ins = [v for _, v in _arguments(args, kwargs) if torch.is_tensor(v)]
                call.input = tuple(ins[0].shape) if ins else None
                if keep_values:
                    values[site] = (_tensors(_arguments(args, kwargs)),
                                    _tensors(flatten(out, "")))
                return out
            return forward

        for module, path in self.paths.items():
            saved.append((module, module.__dict__.get("forward")))
            module.forward = wrap(module, path)
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


def _arguments(args: tuple, kwargs: dict):
    for i, value in enumerate(args):
        yield from flatten(value, str(i))
    for key, value in kwargs.items():
        yield from flatten(value, key)


def _tensors(pairs) -> dict[str, np.ndarray]:
    return {arg: value.detach().cpu().float().numpy() if value.is_floating_point()
            else value.detach().cpu().numpy()
            for arg, value in pairs if torch.is_tensor(value)}


# ---- names

def _tokens(segment: str) -> set[str]:
    if segment in _CANON:
        return {_CANON[segment]}
    words = re.split(r"[_\W]+|(?<=[a-z])(?=[A-Z])", segment)
    return {_CANON.get(w.lower(), w.lower()) for w in words if w and not w.isdigit()}


def name_similarity(reference: str, port: str) -> float:
    """0..1: how alike two module paths' last segments are (with :data:`SYNONYMS`), a little
    for their parents' and for equal block numbers."""
    ref_parts, port_parts = reference.split("."), port.split(".")
    score = _segment_similarity(ref_parts[-1], port_parts[-1])
    if len(ref_parts) > 1 and len(port_parts) > 1:
        score += 0.25 * _segment_similarity(ref_parts[-2], port_parts[-2])
    ref_numbers = [p for p in ref_parts if p.isdigit()]
    if ref_numbers and ref_numbers == [p for p in port_parts if p.isdigit()]:
        score += 0.25
    return min(score, 1.0)


def _segment_similarity(a: str, b: str) -> float:
    if a == b:
        return 1.0
    if a.isdigit() or b.isdigit():
        return 0.0
    ta, tb = _tokens(a), _tokens(b)
    if not ta or not tb:
        return 0.0
    return len(ta & tb) / len(ta | tb)


def _similar_words(reference: str, port: str) -> str:
    return f"name {reference.rsplit('.', 1)[-1]}~{port.rsplit('.', 1)[-1]}"


# ---- pairing calls

def _shape_text(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _score(ref: _Call, port: _Call) -> tuple[float, list[str]] | None:
    """How well two calls fit, with the evidence; None where they cannot be one layer."""
    score, evidence = 0.0, []
    if ref.kind == port.kind and ref.kind != "other":
        score += 2 + (ref.type == port.type)
        evidence.append(f"type {ref.type}" if ref.type == port.type else
                        f"type {ref.type}~{port.type} ({ref.kind})")
    elif ref.kind in _LEAF_KINDS and port.kind in _LEAF_KINDS:
        return None
    elif ref.type == port.type:
        score += 2
        evidence.append(f"type {ref.type}")
    ref_shapes = sorted(ref.params.values())
    port_shapes = sorted(port.params.values())
    if ref_shapes and port_shapes:
        if ref_shapes == port_shapes:
            score += 4
            evidence.append("shape " + ", ".join(_shape_text(s) for s in ref_shapes))
        elif sorted(tuple(reversed(s)) for s in ref_shapes) == port_shapes:
            score += 3
            evidence.append("shapes transposed")
        else:
            return None
    elif ref_shapes or port_shapes:
        score -= 1
    if ref.output is not None and port.output is not None:
        if ref.output == port.output:
            score += 1
            evidence.append(f"output {_shape_text(ref.output)}")
        else:
            score -= 1
    if ref.parent and port.parent and (ref.nth, ref.siblings) == (port.nth, port.siblings):
        score += 0.5
        evidence.append(f"{_ordinal(ref.nth + 1)} of {ref.siblings} calls in its caller")
    similarity = name_similarity(ref.module, port.module)
    if similarity > 0:
        score += 3 * similarity
        evidence.append(_similar_words(ref.module, port.module))
    return score, evidence


@dataclass
class _Pair:
    ref: _Call
    port: _Call
    confidence: float
    evidence: list[str]


def _align(refs: list[_Call], ports: list[_Call]) -> dict[str, _Pair]:
    """The order-keeping pairing of the two call sequences with the largest total score."""
    n, m = len(refs), len(ports)
    scores: dict[tuple[int, int], tuple[float, list[str]]] = {}
    for i, ref in enumerate(refs):
        for j, port in enumerate(ports):
            found = _score(ref, port)
            if found is not None and found[0] >= PAIR_SCORE:
                scores[i, j] = found
    best = np.zeros((n + 1, m + 1))
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            value = max(best[i - 1, j], best[i, j - 1])
            if (i - 1, j - 1) in scores:
                value = max(value, best[i - 1, j - 1] + scores[i - 1, j - 1][0])
            best[i, j] = value
    pairs: dict[str, _Pair] = {}
    i, j = n, m
    while i and j:
        here = scores.get((i - 1, j - 1))
        if here is not None and best[i, j] == best[i - 1, j - 1] + here[0]:
            ref, port = refs[i - 1], ports[j - 1]
            pairs[ref.site] = _Pair(ref, port, min(1.0, here[0] / 10), list(here[1]))
            i, j = i - 1, j - 1
        elif best[i, j] == best[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return pairs


def _pair_by_structure(refs: list[_Call], ports: list[_Call], pairs: dict[str, _Pair]) -> None:
    """A call left unpaired pairs with the port call that holds the partners of its children
    (their lowest common caller), when that call is unpaired too."""
    port_by_site = {c.site: c for c in ports}
    taken = {p.port.site for p in pairs.values()}
    children: dict[str, list[str]] = defaultdict(list)
    for call in refs:
        children[call.parent].append(call.site)
    for ref in reversed(refs):
        if ref.site in pairs:
            continue
        images = [pairs[c].port.site for c in _descendants(ref.site, children) if c in pairs]
        if not images:
            continue
        common = _common_caller(images, port_by_site)
        if common is None or common in taken:
            continue
        port = port_by_site[common]
        if ref.kind in _LEAF_KINDS and port.kind in _LEAF_KINDS and ref.kind != port.kind:
            continue
        evidence = [f"calls the partners of {len(images)} of its calls"]
        found = _score(ref, port)
        if found is not None:
            evidence += found[1]
        pairs[ref.site] = _Pair(ref, port, 0.6, evidence)
        taken.add(common)


def _confirm_by_structure(refs: list[_Call], ports: list[_Call],
                          pairs: dict[str, _Pair]) -> None:
    """A pair of callers whose callees' partners all lie inside the port caller is sure of
    itself; one where some lie elsewhere is not."""
    port_by_site = {c.site: c for c in ports}
    children: dict[str, list[str]] = defaultdict(list)
    for call in refs:
        children[call.parent].append(call.site)
    for pair in pairs.values():
        inner = [pairs[c].port.site for c in _descendants(pair.ref.site, children) if c in pairs]
        if not inner or not pair.ref.parent:
            continue
        inside = sum(pair.port.site in _callers(site, port_by_site) for site in inner)
        if inside == len(inner):
            if pair.confidence < 0.7:
                pair.evidence.append(f"holds the partners of its {len(inner)} paired calls")
            pair.confidence = max(pair.confidence, 0.7)
        else:
            pair.confidence = min(pair.confidence, 0.4)
            pair.evidence.append(f"UNSURE: {len(inner) - inside} of the partners of its "
                                 f"{len(inner)} paired calls lie outside {pair.port.site}")


def _callers(site: str, calls: dict[str, _Call]) -> set[str]:
    out = set()
    while site in calls and calls[site].parent:
        site = calls[site].parent
        out.add(site)
    return out


def _descendants(site: str, children: dict[str, list[str]]) -> list[str]:
    out, todo = [], list(children.get(site, []))
    while todo:
        site = todo.pop()
        out.append(site)
        todo += children.get(site, [])
    return out


def _common_caller(sites: list[str], calls: dict[str, _Call]) -> str | None:
    def chain(site: str) -> list[str]:
        out = []
        while site:
            out.append(site)
            site = calls[site].parent if site in calls else ""
        return out[::-1]

    chains = [chain(s) for s in sites]
    common = None
    for level in zip(*chains):
        if len(set(level)) != 1:
            break
        common = level[0]
    return common


def _fill_out_of_order(refs: list[_Call], ports: list[_Call], pairs: dict[str, _Pair]) -> None:
    """Calls the order-keeping alignment left out (a port that computes k before q) pair with
    the one unpaired port call under the same paired caller that fits best."""
    taken = {p.port.site for p in pairs.values()}
    for ref in refs:
        if ref.site in pairs or ref.parent not in pairs:
            continue
        caller = pairs[ref.parent].port.site
        found = [(s, port) for port in ports if port.parent == caller
                 and port.site not in taken
                 and (s := _score(ref, port)) is not None and s[0] >= PAIR_SCORE]
        if not found:
            continue
        found.sort(key=lambda f: -f[0][0])
        (score, evidence), port = found[0]
        close = len(found) > 1 and found[1][0][0] >= score - 0.5
        pairs[ref.site] = _Pair(ref, port, 0.3 if close else 0.55,
                                [*evidence, "out of call order"])
        taken.add(port.site)


# ---- globs over repeated blocks

_NUMBER = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def _glob(name: str, keep: int | None = None) -> tuple[str, tuple[str, ...]]:
    """A name with its first ``keep`` block numbers (all by default) made '*', and those
    numbers."""
    numbers = _NUMBER.findall(name)
    keep = len(numbers) if keep is None else min(keep, len(numbers))
    return _NUMBER.sub("*", name, count=keep) if keep else name, tuple(numbers[:keep])


def _shared_numbers(key: str, others: list[str]) -> int:
    """How many leading block numbers ``key`` shares with every other name (layer 3's q with
    block 3's wq: one; a Sequential's own index after it is not a block number)."""
    key_numbers = _NUMBER.findall(key)
    shared = len(key_numbers)
    for other in others:
        numbers = _NUMBER.findall(other)
        n = 0
        while n < min(shared, len(numbers)) and numbers[n] == key_numbers[n]:
            n += 1
        shared = n
    return shared


def _generalise(pairs: list[tuple[str, list[str]]],
                universe: set[str]) -> list[tuple[str, list[str], list[int]]]:
    """(key glob, other globs, indexes of the pairs it covers) for pairs of a key name (the
    side a rule's pattern matches) and the names it gives: a glob over the block numbers both
    sides share, where every name in ``universe`` the key glob matches is one of the pairs."""
    groups: dict[tuple[str, tuple[str, ...]], list[int]] = defaultdict(list)
    single = []
    for k, (key, others) in enumerate(pairs):
        shared = _shared_numbers(key, others)
        if shared:
            groups[_glob(key, shared)[0], tuple(_glob(o, shared)[0] for o in others)].append(k)
        else:
            single.append(k)
    out = []
    for (key_glob, globs), members in groups.items():
        pattern = _glob_pattern(key_glob)
        instances = {name for name in universe if pattern.match(name)}
        if len(members) > 1 and instances == {pairs[k][0] for k in members}:
            out.append((key_glob, list(globs), members))
        else:
            single += members
    out += [(pairs[k][0], list(pairs[k][1]), [k]) for k in sorted(single)]
    return out


def _glob_pattern_first(glob: str, modules) -> str:
    """The first module a glob names (for ordering rules by call order)."""
    pattern = _glob_pattern(glob)
    return next((m for m in modules if pattern.match(m)), glob)


def _glob_pattern(glob: str) -> re.Pattern:
    return re.compile(re.escape(glob).replace(r"\*", r"\d+") + "$")


# ---- parameters

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


def _find_sources(model: nn.Module, weights: dict[str, np.ndarray], mapping: Mapping,
                  module_partner: dict[str, str], ref_order: dict[str, int],
                  module_confidence: dict[str, float], types: dict[str, str],
                  port_order: dict[str, int],
                  layouts) -> tuple[list[_Source], list[str]]:
    """Each port tensor's source: its module's partner's tensor, transposed where the shapes
    say so, else a leftover reference tensor of its shape, or several stacked."""
    assignments = resolve_weights(model, weights, mapping)
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
    free = {name for name in weights if name not in used}
    _pick_singles(open_, shapes, free, module_partner, sources, unique_only=True)
    _pick_stacks(open_, shapes, free, module_partner, ref_order, sources)
    _pick_splits(open_, shapes, free, module_partner, port_order, sources, layouts)
    _pick_singles(open_, shapes, free, module_partner, sources, unique_only=False)
    order = list(port_tensors(model))
    missing = [name for name, _, _ in open_ if name not in sources]
    return [sources[name] for name in order if name in sources], missing


def _layout(call: _Call | None, shape: tuple[int, ...]) -> str | None:
    """How a dense layer keeps a 2-D weight: "out_in" (torch's Linear) or "in_out" (Hugging
    Face's Conv1D, Flax), from its call's input and output widths, else from the class name
    Linear; None when neither tells."""
    if call is None or len(shape) != 2 or call.kind != "dense":
        return None
    if call.input and call.output:
        widths = (call.output[-1], call.input[-1])
        if shape == widths and shape != widths[::-1]:
            return "out_in"
        if shape == widths[::-1] and shape != widths:
            return "in_out"
    return "out_in" if call.type == "Linear" else None


def _layout_text(layout: str) -> str:
    return "(" + layout.replace("_", ", ") + ")"


def _transpose_square(sources: dict[str, _Source], shapes: dict[str, tuple[int, ...]],
                      types: dict[str, str], layouts) -> None:
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
        if len(source.reference) != 1 or len(shape) != 2 or shape[0] != shape[1]:
            continue
        key = classes(source)
        seen = votes.get(key, [])
        sides = (layouts("ref", source.reference[0], shape), layouts("port", source.port, shape))
        if None not in sides:
            if sides[0] != sides[1] and source.transform == ("copy",):
                source.transform, source.rule = ("transpose",), True
                source.evidence = [f"square {_shape_text(shape)}: {key[0]} keeps it "
                                   f"{_layout_text(sides[0])}, {key[1]} "
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


def _pick_singles(open_, shapes, free, module_partner, sources, *, unique_only: bool) -> None:
    for port, shape, _ in open_:
        if port in sources:
            continue
        pool = _under(_anchor(port, module_partner), free)
        where = "under the partner module"
        if not pool:
            pool, where = sorted(free), "in the reference (nothing under the partner module)"
        fits = [(ref, "copy") for ref in pool if shapes[ref] == shape]
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
                    + (" transposed" if how == "transpose" else "")]
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
                        + ", ".join(n.rsplit(".", 2)[-2] for n in names) + ", in call order"]
            if want is not None:
                evidence.append(f"the reference keeps it {_layout_text(sides[0])}, the "
                                f"port {_layout_text(sides[1])}")
            elif other:
                evidence.append("UNSURE: the parts fit with and without a transpose, and "
                                "nothing says which layout each side keeps")
            for port in names:
                sources[port] = _Source(port, [ref], chain, 0.3 if other and want is None
                                        else 0.6, list(evidence), True, names, axis)


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


# ---- the draft

def suggest_mapping(ref_trace: str | os.PathLike, port_case: Case) -> MapSuggestion:
    """Draft a mapping between the reference trace (captured with weights) and a torch port
    case; see the module docstring. Changes nothing in the port for good."""
    if not isinstance(port_case, Case):
        name = getattr(port_case, "name", "") or type(port_case).__name__
        raise CaseError(f"case {name}: map-suggest needs a layerdiff.Case with a torch model "
                        f"(it runs it to see its calls), got {type(port_case).__name__}")
    with open_trace(ref_trace) as ref:
        if ref.summary:
            raise TraceError(f"{ref.path} is a summary trace: map-suggest needs the "
                             "reference's weights and recorded values; capture the reference "
                             "without --summary")
        weights = trace_weights(ref)
        refs = _reference_calls(ref, weights)
        model = port_case.model
        with restored([*model.parameters(), *model.buffers()]):
            return _Drafter(ref, str(ref_trace), port_case, weights, refs).draft()


class _Drafter:
    def __init__(self, ref: Trace, ref_path: str, case: Case, weights: dict[str, np.ndarray],
                 refs: list[_Call]) -> None:
        self.ref, self.ref_path, self.case, self.weights, self.refs = (ref, ref_path, case,
                                                                       weights, refs)
        self.run = _PortRun(case)
        self.ports, _ = self.run.run(keep_values=False)
        self.port_modules = {path for path in self.run.paths.values()}
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
        draft = Mapping.from_text(text, "draft.toml")  # the draft must read back
        tensor_sources = self._tensor_sources(draft)
        return MapSuggestion(self.ref_path, self.case.name or type(self.case.model).__name__,
                             text, suggestions, tensor_sources,
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
        mapping = Mapping.from_text(_site_text(rules), "draft.toml")
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
            return _layout(first.get((side, module)), shape)

        return _find_sources(self.case.model, self.weights, mapping, module_partner,
                             self.ref_order, confidence, types, port_order, layouts)

    def _param_mapping(self, mapping: Mapping, sources: list[_Source]) -> Mapping:
        rules = {s.rule_key(): s for s in sources if s.rule}
        text = _site_text([]) + "".join(_param_text(list(key[0]), s.reference, s.transform,
                                                    s.axis) for key, s in rules.items())
        params = Mapping.from_text(text, "draft.toml")
        mapping.param_rules = params.param_rules
        return mapping

    # -- values: confirm pairs, find which argument is which
    def _check_values(self, pairs: dict[str, _Pair], mapping: Mapping,
                      sources: list[_Source]) -> dict[str, dict[str, str]]:
        model = self.case.model
        mapping = self._param_mapping(mapping, sources)
        targets = port_tensors(model)
        with torch.no_grad():
            for found in resolve_weights(model, self.weights, mapping):
                if not found.problem and found.value is not None:
                    target = targets[found.port]
                    target.copy_(torch.from_numpy(np.array(found.value)).to(target.dtype))
        try:
            _, values = self.run.run(keep_values=True)
        except CaseError:
            return {}
        decisions: dict[str, list[dict]] = defaultdict(list)  # module, and site -> maps
        step = int(self.ref.sites["step"].min())
        index = self.ref.records(step, pass_="forward", kind="tensor")
        by_site = {site: rows for site, rows in index.groupby("site")}
        self._pair_by_value(pairs, values, by_site)
        for pair in pairs.values():
            if pair.port.site not in values or pair.ref.site not in by_site:
                continue
            port_in, port_out = values[pair.port.site]
            rows = by_site[pair.ref.site]
            ref_out = {r["arg"]: r for _, r in rows[rows["role"] == "output"].iterrows()}
            error = _output_error(self.ref, ref_out, port_out)
            if error is not None and error <= VALUE_RTOL and not any(
                    e.startswith("output equals") for e in pair.evidence):
                pair.confidence = max(pair.confidence, 0.95)
                pair.evidence.insert(0, _equal_output(error))
            ref_in = {r["arg"]: r for _, r in rows[rows["role"] == "input"].iterrows()}
            found = _argument_map(self.ref, ref_in, port_in)
            if found:
                decisions[pair.ref.site].append(found)
                decisions[pair.ref.module].append(found)
        return decisions

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
            ref_out = {r["arg"]: r for _, r in rows[rows["role"] == "output"].iterrows()}
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
        suggestions = list(site_rules)
        if site_rules:
            lines.append("# ---- sites: reference module -> port module")
        for rule in site_rules:
            lines += _comment(rule)
            table = "site" if rule.kind == "site" else "pair"
            lines += [f"[[{table}]]", f"reference = {_q(rule.reference[0])}",
                      f"port = {_q(rule.port[0])}"]
            if rule.args:
                lines.append("args = { " + ", ".join(f"{_q(k)} = {_q(v)}"
                                                      for k, v in rule.args.items()) + " }")
            lines.append("")
        unmatched = self._unmatched(pairs, sources)
        if unmatched:
            lines.append("# ---- calls with no partner")
        for entry in unmatched:
            side = "reference" if entry.kind == "unmatched-reference" else "port"
            name = (entry.reference or entry.port)[0]
            lines += [*_comment(entry)[1:], "[[unmatched]]", f"{side} = {_q(name)}",
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
        buffers = {name for name, _ in self.case.model.named_buffers()}
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
        universe = set(port_tensors(self.case.model))
        out = []
        by_transform = defaultdict(list)
        for source in {s.rule_key(): s for s in ruled}.values():  # a split once
            by_transform[source.transform, source.axis].append(source)
        for (transform, axis), group in by_transform.items():
            out += self._param_group(group, transform, axis, universe)
        return out

    def _param_group(self, ruled, transform, axis, universe) -> list[Suggestion]:
        out = []
        named = [(s.group or (s.port,)) for s in ruled]
        for key_glob, others, members in _generalise(
                [(ports[0], [*ports[1:], *s.reference]) for ports, s in zip(named, ruled)],
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
        groups: dict[int, list[str]] = defaultdict(list)
        for name, tensor in self.case.model.named_parameters(remove_duplicate=False):
            groups[id(tensor)].append(name)
        for names in groups.values():
            if len(names) > 1:
                lines.append(f"# the port ties {', '.join(names)}: loaded once, as {names[0]}")
        return lines

    def _tensor_sources(self, draft: Mapping) -> dict[str, list[str]]:
        return {found.port: ([] if found.problem else list(found.source.reference))
                for found in resolve_weights(self.case.model, self.weights, draft)}


def _output_error(ref: Trace, ref_out: dict, port_out: dict[str, np.ndarray]) -> float | None:
    gap = norm = 0.0
    for arg, row in ref_out.items():
        if arg not in port_out or schema.parse_shape(row["shape"]) != port_out[arg].shape:
            return None
        if not np.issubdtype(port_out[arg].dtype, np.floating):
            continue
        expected = np.asarray(ref.read(row), dtype=np.float64)
        gap += float(np.sum((port_out[arg] - expected) ** 2))
        norm += float(np.sum(expected ** 2))
    if not norm:
        return None
    return float(np.sqrt(gap / norm))


def _equal_output(error: float) -> str:
    """Said by its power of ten, so that the blocks of a glob rule say it alike."""
    bound = 10.0 ** math.ceil(math.log10(max(error, 1e-12)))
    return f"output equals the reference's (relative error <= {bound:.0e})"


def _argument_map(ref: Trace, ref_in: dict,
                  port_in: dict[str, np.ndarray]) -> dict[str, tuple[str, int]]:
    """Reference argument -> (port argument, weight) for the top-level arguments this call
    decides: by equal value (weight 2), else, once some value agreed, by the one remaining
    port argument of the same shape and dtype (weight 1). Arguments it cannot decide (a port
    that computes something else upstream) are left out."""
    names = [a for a in ref_in if "." not in a]
    port_names = [a for a in port_in if "." not in a]
    decided: dict[str, tuple[str, int]] = {}
    expected = {name: np.asarray(ref.read(ref_in[name])) for name in names}
    for name in names:
        equal = [p for p in port_names if _equal(expected[name], port_in[p])]
        if equal:
            decided[name] = (name if name in equal else equal[0], 2)
    if not decided:
        return {}
    claimed = {target for target, _ in decided.values()}
    for name in names:
        if name in decided:
            continue
        fits = [p for p in port_names if p not in claimed
                and port_in[p].shape == expected[name].shape
                and port_in[p].dtype.kind == expected[name].dtype.kind]
        if len(fits) == 1:
            decided[name] = (fits[0], 1)
            claimed.add(fits[0])
    return decided


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(b.dtype, np.floating):
        a, b = a.astype(np.float64), b.astype(np.float64)
        scale = float(np.sqrt(np.sum(a ** 2))) or 1.0
        return float(np.sqrt(np.sum((a - b) ** 2))) <= VALUE_RTOL * scale
    return bool(np.array_equal(a, b))


def _agreed_args(maps: list[dict[str, tuple[str, int]]]) -> tuple[dict[str, str], str]:
    """The argument map the calls vote for (each argument on its own; a call that could not
    decide one abstains), with a doubt said where they disagree."""
    votes: dict[str, Counter] = defaultdict(Counter)
    for decided in maps:
        for name, (target, weight) in decided.items():
            votes[name][target] += weight
    agreed, doubts = {}, []
    for name, counted in votes.items():
        target = counted.most_common(1)[0][0]
        if target != name:
            agreed[name] = target
        if len(counted) > 1:
            doubts.append(f"argument {name}: " + ", ".join(
                f"{t} ({n})" for t, n in counted.most_common()))
    doubt = ("UNSURE: the calls disagree on " + "; ".join(doubts)) if doubts else ""
    return agreed, doubt


def _merged_evidence(pairs: list[_Pair]) -> list[str]:
    counted = Counter(e for p in pairs for e in dict.fromkeys(p.evidence))
    return [e for e, n in counted.items() if n == len(pairs)] or list(pairs[0].evidence)


def _comment(rule: Suggestion) -> list[str]:
    evidence = [e for e in rule.evidence if not e.startswith("UNSURE")]
    text = "# " + ", ".join(evidence)
    lines = [text]
    if rule.unsure:
        doubt = next((e for e in rule.evidence if e.startswith("UNSURE")), None)
        lines.append("# " + (doubt or f"UNSURE: confidence {rule.confidence:.2f}; check it"))
    return lines


def _q(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _site_text(rules: list[Suggestion]) -> str:
    lines = ["version = 1", ""]
    for rule in rules:
        table = "site" if rule.kind == "site" else "pair"
        lines += [f"[[{table}]]", f"reference = {_q(rule.reference[0])}",
                  f"port = {_q(rule.port[0])}"]
        if rule.args:
            lines.append("args = { " + ", ".join(f"{_q(k)} = {_q(v)}"
                                                  for k, v in rule.args.items()) + " }")
        lines.append("")
    return "\n".join(lines)


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


__all__ = ["MapSuggestion", "Suggestion", "SYNONYMS", "module_kind", "name_similarity",
           "suggest_mapping"]
