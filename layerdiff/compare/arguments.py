"""Which port argument a reference argument is compared with, by the recorded signatures.

A reference layer is often called another way than its port: Hugging Face calls
``attn(hidden_states=h, attention_mask=m)`` (recorded arguments ``hidden_states`` and
``attention_mask``), a port ``attn(x)`` (recorded argument ``0``). Capture writes each module
type's ``forward`` signature into the trace's meta (``signatures``), so each recorded argument's
*head* (the first part of its path: ``0`` of ``0.1``, ``mask`` of ``mask``) names a parameter
on its side. The pairing follows replay's binding (:mod:`layerdiff.replay.calling`):

1. a reference argument whose parameter has the name of a port parameter pairs with what the
   port recorded for that parameter;
2. the reference's positional arguments left, in order, pair with the port's positional
   parameters left, in order;
3. a keyword argument left pairs with the port's positional parameter at the place the
   reference's signature gives it (``hidden_states=h`` feeds the port's first parameter ``x``),
   unless it holds None or the reference's default;
4. what is left pairs by the same head, when the port recorded one (``*args``/``**kwargs``).

A reference argument for which the port's ``forward`` has no parameter at all is *not taken by
the port*: the port layer computed its output from what it took, so it is left out of the
input check (listed, never a reason not to judge). Without a port signature (traces written
before capture recorded them, ports in other frameworks) arguments pair by the same head.
Pure data: no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from layerdiff.compare.shapes import same_elements
from layerdiff.errors import DiffError
from layerdiff.signature import Parameter, Signature
from layerdiff.trace import schema


@dataclass
class ArgumentPairing:
    """One site pair's inputs: reference head -> port head, and the heads the port does not
    take (head -> why, one sentence part)."""

    partner: dict[str, str] = field(default_factory=dict)
    not_taken: dict[str, str] = field(default_factory=dict)


class CallSignatures:
    """Both traces' recorded signatures, looked up by site through the site's module type."""

    def __init__(self, ref_meta: dict, port_meta: dict, ref_sites: pd.DataFrame,
                 port_sites: pd.DataFrame, ref_name: str = "reference",
                 port_name: str = "port") -> None:
        self._sides = {
            "reference": (_types(ref_sites), _signatures(ref_meta, ref_name)),
            "port": (_types(port_sites), _signatures(port_meta, port_name)),
        }

    @classmethod
    def of(cls, ref, port) -> CallSignatures:
        """From two open traces."""
        return cls(ref.meta, port.meta, ref.sites, port.sites, str(ref.path), str(port.path))

    def signature(self, side: str, site: str) -> Signature | None:
        types, signatures = self._sides[side]
        kind = types.get(site)
        return None if kind is None else signatures.get(kind)


def _types(sites: pd.DataFrame) -> dict[str, str]:
    if "type" not in sites:
        return {}
    return dict(zip(sites["site"], sites["type"], strict=True))


def _signatures(meta: dict, where: str) -> dict[str, Signature]:
    found = meta.get("signatures") or {}
    if not isinstance(found, dict):
        raise DiffError(f"{where} meta 'signatures' must be an object of module type name -> "
                        f"signature, got {type(found).__name__}; capture it again")
    return {name: Signature.from_json(data, f"{where} meta 'signatures' {name}")
            for name, data in found.items()}


def head_of(path: str) -> tuple[str, str]:
    """``'1.0'`` -> ``('1', '.0')``; ``'mask'`` -> ``('mask', '')``."""
    head, dot, rest = path.partition(".")
    return head, dot + rest


Leaves = dict[str, str]  # rest of the path -> "tensor <shape>", or the value's JSON text


def pair_arguments(ref_heads: dict[str, Leaves], port_heads: dict[str, Leaves],
                   ref_sig: Signature | None, port_sig: Signature | None) -> ArgumentPairing:
    """Pair reference heads with port heads (each with its leaves) by the rules in the module
    docstring. Rules 2 and 3 pair arguments of other names by their place alone, so they
    also ask for the same structure (leaf paths, tensor shapes): a causal mask at the place
    of a port's rotary table is not its partner."""
    if port_sig is None:
        return _by_same_head(ref_heads, port_heads, ref_sig)
    port_param = {head: name for head in port_heads
                  if (name := _param_name(head, port_sig)) is not None}
    by_param = {name: head for head, name in port_param.items()}
    bound: dict[str, str] = {}        # port parameter name -> reference head
    left: list[str] = []
    for head in ref_heads:            # 1. by parameter name
        name = _param_name(head, ref_sig)
        if name is not None and port_sig.named(name) is not None and name not in bound:
            bound[name] = head
        else:
            left.append(head)
    free = [p for p in port_sig.positional if p.name not in bound]
    unlike: dict[str, str] = {}       # head -> the port parameter at its place, unlike it
    for head in sorted((h for h in left if h.isdigit()), key=int):  # 2. by position
        if free:
            param = free.pop(0).name
            if _alike(ref_heads[head], port_heads.get(by_param.get(param, ""))):
                bound[param] = head
            else:
                unlike[head] = param
    placed = set(bound.values())
    for head in left:                 # 3. a keyword by the reference's position
        if head in placed or head.isdigit() or _holds_nothing(ref_heads[head], head, ref_sig):
            continue
        target = _by_reference_position(head, ref_sig, port_sig, bound)
        if target is not None and _alike(ref_heads[head], port_heads.get(by_param.get(target,
                                                                                      ""))):
            bound[target] = head
        elif target is not None:
            unlike[head] = target
    pairing = ArgumentPairing()
    for name, head in bound.items():
        if name in by_param:
            pairing.partner[head] = by_param[name]
    placed = set(bound.values())
    for head in ref_heads:
        if head in placed:
            continue
        named = _param_name(head, ref_sig) if head.isdigit() else None
        which = f"the reference's '{named}'; " if named else ""
        if head in port_heads and head not in pairing.partner.values() and _alike(
                ref_heads[head], port_heads[head]):  # 4. *args, **kwargs
            pairing.partner[head] = head
        elif head in unlike:
            pairing.not_taken[head] = (
                f"{which}the port's {port_sig.describe()} has no parameter for it: "
                f"'{unlike[head]}', at its place, holds something of another structure or shape")
        elif not _has_room(head, port_sig):
            pairing.not_taken[head] = (f"{which}the port's {port_sig.describe()} has no "
                                       "parameter for it")
    return pairing


def _by_same_head(ref_heads: dict[str, Leaves], port_heads: dict[str, Leaves],
                  ref_sig: Signature | None) -> ArgumentPairing:
    """No port signature (a port in another framework, an older trace): the same head; a
    reference keyword the port did not record by name pairs with the port's positional
    argument at the place the reference's signature gives it, when alike."""
    partner = {head: head for head in ref_heads if head in port_heads}
    taken = set(partner.values())
    names = [] if ref_sig is None else [p.name for p in ref_sig.positional]
    for head, leaves in ref_heads.items():
        if head in partner or head not in names:
            continue
        place = str(names.index(head))
        if place in port_heads and place not in taken and place not in ref_heads \
                and _alike(leaves, port_heads[place]):
            partner[head] = place
            taken.add(place)
    return ArgumentPairing(partner)


def _param_name(head: str, signature: Signature | None) -> str | None:
    """The parameter a recorded head fills on its side (a keyword is its own name)."""
    if not head.isdigit():
        return head  # a keyword's name is its parameter's, be it bound or in **kwargs
    if signature is None:
        return None
    positional = signature.positional
    return positional[int(head)].name if int(head) < len(positional) else None


def _has_room(head: str, port: Signature) -> bool:
    """Whether the port's forward could have taken the argument (``*args``/``**kwargs``)."""
    return port.var_positional if head.isdigit() else port.var_keyword


def _alike(ref: Leaves, port: Leaves | None) -> bool:
    """The same leaves, and tensors where tensors are, holding the same elements in the same
    order (the diff's shape rule, :mod:`layerdiff.compare.shapes`: position ids (1, T) and (T),
    heads (B, T, N*H) and (B, T, N, H)); a port that did not record the argument has nothing to
    tell them apart by."""
    if port is None:
        return True
    if set(ref) != set(port):
        return False
    return all(_same_tensor(ref[k], port[k])
               or not (ref[k].startswith(_TENSOR) or port[k].startswith(_TENSOR)) for k in ref)


def _same_tensor(ref_leaf: str, port_leaf: str) -> bool:
    """Whether two tensor leaves could hold the same tensor by their shapes (the diff's rule)."""
    if not (ref_leaf.startswith(_TENSOR) and port_leaf.startswith(_TENSOR)):
        return False
    return same_elements(schema.parse_shape(ref_leaf[len(_TENSOR):]),
                         schema.parse_shape(port_leaf[len(_TENSOR):]))


_TENSOR = "tensor "


def _holds_nothing(leaves: Leaves, head: str, signature: Signature | None) -> bool:
    """None, or the reference's own default: nothing to pass into a parameter of another name
    (replay's rule: GPT-2's ``past_key_values=None`` must not fill a port's mask)."""
    values = list(leaves.values())
    if any(value.startswith(_TENSOR) for value in values):
        return False  # a tensor is never a default
    parsed = [_json(value) for value in values]
    if all(value is None for value in parsed):
        return True
    param: Parameter | None = None if signature is None else signature.named(head)
    if param is None or param.default is None or len(values) != 1:
        return False
    return _same(parsed[0], _json(param.default))


def leaf(kind: str, shape: str, value: str) -> str:
    """A recorded leaf as :func:`pair_arguments` compares it."""
    return f"{_TENSOR}{shape}" if kind == "tensor" else (value or "null")


def _json(text: str) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


def _same(a: Any, b: Any) -> bool:
    return type(a) is type(b) and a == b


def _by_reference_position(head: str, ref_sig: Signature | None, port_sig: Signature,
                           bound: dict[str, str]) -> str | None:
    """The port's first positional parameter, when free and ``head`` is the reference's first
    (the layer's input under another name: HF's ``hidden_states=`` for a port's ``x``). Later
    places are not guessed, as replay binds (replay/calling.py): the same place in two
    signatures often holds different things (``position_ids`` against a scale)."""
    if ref_sig is None or not ref_sig.positional:
        return None
    ports = port_sig.positional
    if ref_sig.positional[0].name == head and ports and ports[0].name not in bound:
        return ports[0].name
    return None
