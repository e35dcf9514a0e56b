"""Calling a port layer with the reference's recorded arguments, adapted to its own signature.

A reference layer is often called with more than its port takes: a Hugging Face attention gets
``attn(h, past_key_values=None, attention_mask=m, output_attentions=False)`` where the port's
``forward(self, x)`` takes ``x`` alone. ``bind_call`` fits the recorded arguments (after the
mapping file's renames) to the port's parameters. An argument is named by its *head*, the first
part of its recorded path: a digit for a positional argument (``0``, ``1`` of ``1.0``), else
a keyword name (``mask`` of ``mask``, ``cache`` of ``cache.k``). The rules, in order:

a. A head the mapping drops (``args = { past_key_values = "" }``) is left out.
b. When the port's signature is unknown, everything else is passed as recorded.
c. A keyword whose name is one of the port's parameters binds to it.
d. Positional arguments, in order, fill the port's positional parameters that (c) left free;
   when none is left they go into the port's ``*args``, if it has one.
e. Any other keyword goes into the port's ``**kwargs``, if it has one; else, when the
   reference's signature (recorded by capture) puts it first, it fills the port's first
   positional parameter if that is free (the reference's ``hidden_states=h`` feeds the port's
   ``x``: the layer's input) -- unless it holds None or the reference's default, which (f)
   leaves out rather than pass into a parameter of another name. Later positions are not
   guessed: there names say what an argument means, and the same place in two signatures
   often holds different things (HF's ``position_embeddings=(cos, sin)`` is second, where a
   port's ``freqs_cos`` is; its ``attention_mask`` third, where ``freqs_sin`` is).
f. An argument left without a parameter is **not taken by the port**: left out of the call
   (and of the input check), and listed with what it held -- ``None``, the reference's own
   default (``output_attentions=False``), or the value (``float32 (4,1,16,16)``). The port
   layer computed its output from what it took, so an error there is its own.
g. A port parameter without a default that nothing fills makes the call impossible: one
   sentence names every such parameter, the reference's arguments with their shapes, and the
   call adapter (``call = "your_module:adapter"`` on the mapping's site rule) to write.
h. The call is built in the port's parameter order: positional parameters are passed by
   position up to the first one left unfilled or that the reference passed by its own name
   (kept a keyword: HF's decorated forwards take ``use_cache`` from the keywords and pass it on
   by name, "got multiple values" when it came by position too), and by keyword after it (a
   positional-only one after such a gap refuses the call); ``*args`` extras follow the last
   positional argument, and then every filled parameter before them goes by position.

An argument capture kept only as a repr (:class:`~layerdiff.trace.arguments.NotPlainData`,
a ``DynamicCache``) can be left out (f), never passed: bound to a parameter it refuses the
call. What was left out, and why, is kept with the bound call, so replay can report it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from layerdiff.errors import DiffError
from layerdiff.mapping.code import CodeRef
from layerdiff.signature import Parameter, Signature, json_text
from layerdiff.trace.arguments import NotPlainData, describe_value, rebuild_call

__all__ = ["BoundCall", "CannotCall", "Parameter", "Signature", "adapted_call", "bind_call"]

MAPPING_DROPS = "the mapping drops it"


class CannotCall(DiffError):
    """A port layer that cannot be called with the reference's recorded arguments."""


@dataclass
class BoundCall:
    """The reference's arguments as the port layer is called with them."""

    values: list[tuple[str, Any]]                                     # paths in the port's call
    # reference heads left out of the call, and why: what they held, or the mapping's drop
    dropped: list[tuple[str, str]] = field(default_factory=list)
    renamed: dict[str, str] = field(default_factory=dict)             # head -> head in the call

    def call(self) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` for calling the port layer."""
        return rebuild_call(self.values)


def bind_call(values: list[tuple[str, Any]], port: Signature | None, *,
              reference: Signature | None = None,
              drop: frozenset[str] | set[str] = frozenset(), where: str = "") -> BoundCall:
    """Fit ``values`` ((argument path, value) pairs as capture flattens them) to ``port``'s
    parameters by the rules in this module's docstring. ``where`` names the layer in errors.

    Raises :class:`CannotCall` when a port parameter gets nothing, or would get a value that
    is not plain data.
    """
    heads = _group(values)
    dropped = [(head, MAPPING_DROPS) for head in heads if head in drop]
    kept = {head: items for head, items in heads.items() if head not in drop}
    if port is None:
        return _unchanged(kept, dropped)
    binder = _Binder(port, reference, where or "the port layer")
    binder.bind(kept)
    dropped += binder.leave_out_unplaced(kept)
    binder.check_required(kept)
    binder.check_plain(kept)
    renamed = binder.call_heads()
    call_values = [(renamed[head] + rest, value) for head, items in kept.items()
                   if head in renamed for rest, value in items]
    return BoundCall(call_values, dropped,
                     {head: new for head, new in renamed.items() if head != new})


# ---- the argument tree by head
Items = list[tuple[str, Any]]   # (rest of the path, with its leading dot or "", value)


def _group(values: list[tuple[str, Any]]) -> dict[str, Items]:
    """Values by head, in recording order; each keeps the rest of its path."""
    heads: dict[str, Items] = {}
    for path, value in values:
        head, dot, rest = path.partition(".")
        heads.setdefault(head, []).append((dot + rest, value))
    return heads


def _unchanged(kept: dict[str, Items], dropped: list[tuple[str, str]]) -> BoundCall:
    """Rule (b): passed as recorded, positional heads renumbered to close what (a) left out
    (``f(x, cache, y)`` with ``cache`` dropped is ``f(x, y)``)."""
    for head, items in kept.items():
        if any(isinstance(v, NotPlainData) for _, v in items):
            raise CannotCall(f"the reference's argument {_argument_name(head)} was recorded as "
                             "not plain data and the port layer's signature is unknown, so it "
                             f'cannot be passed; drop it in the mapping file (args = {{ '
                             f'{_toml_key(head)} = "" }}) or write a call adapter for the layer')
    positional = sorted((h for h in kept if h.isdigit()), key=int)
    renamed = {head: str(number) for number, head in enumerate(positional)}
    renamed |= {head: head for head in kept if not head.isdigit()}
    values = [(renamed[head] + rest, value) for head, items in kept.items()
              for rest, value in items]
    return BoundCall(values, dropped, {h: n for h, n in renamed.items() if h != n})


def _value(items: Items) -> Any:
    """The head's whole value, rebuilt from its leaves (a tuple, a dict, or the leaf)."""
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    _, kwargs = rebuild_call([("v" + rest, value) for rest, value in items])
    return kwargs["v"]


def _holds(items: Items) -> str:
    """What an argument holds, in a few words for a message."""
    return describe_value(_value(items))


def _equals_default(items: Items, param: Parameter | None) -> bool:
    """Whether the recorded value is the reference's default for ``param``: compared as JSON
    text, so ``True`` is not ``1``; a tensor is never plain data, so never a default."""
    if param is None or param.default is None:
        return False
    if any(hasattr(v, "shape") for _, v in items):
        return False
    return json_text(_value(items)) == param.default


def _argument_name(head: str) -> str:
    return f"positional argument {head}" if head.isdigit() else head


def _toml_key(head: str) -> str:
    return head if head.isidentifier() else f'"{head}"'


class _Binder:
    """Rules (c)-(h) for one call: which port parameter each head fills."""

    def __init__(self, port: Signature, reference: Signature | None, where: str) -> None:
        self.port, self.reference, self.where = port, reference, where
        self.bound: dict[str, str] = {}     # port parameter -> head
        self.extras: list[str] = []         # positional heads for the port's *args
        self.keywords: list[str] = []       # keyword heads for the port's **kwargs
        self.unplaced: list[str] = []       # heads without a parameter yet

    def bind(self, heads: dict[str, Items]) -> None:
        keywords = [h for h in heads if not h.isdigit()]
        for head in keywords:                                   # (c)
            if self.port.named(head) is not None:
                self.bound[head] = head
        free = [p for p in self.port.positional if p.name not in self.bound]
        for head in sorted((h for h in heads if h.isdigit()), key=int):  # (d)
            if free:
                self.bound[free.pop(0).name] = head
            elif self.port.var_positional:
                self.extras.append(head)
            else:
                self.unplaced.append(head)
        for head in keywords:                                   # (e)
            if head not in self.bound.values():
                self._bind_keyword(head, heads[head])

    def _bind_keyword(self, head: str, items: Items) -> None:
        if self.port.var_keyword and not any(isinstance(v, NotPlainData) for _, v in items):
            self.keywords.append(head)
            return
        # by position only what carries a value: a None or a default that happens to sit at
        # the position of a port parameter with another name (GPT-2's past_key_values=None
        # where the port takes a mask) would silently fill it
        droppable = all(value is None for _, value in items) or _equals_default(
            items, self._reference_param(head))
        target = None if droppable else self._by_reference_position(head)
        if target is not None:
            self.bound[target.name] = head
        else:
            self.unplaced.append(head)

    def _by_reference_position(self, head: str) -> Parameter | None:
        """The port's first positional parameter, when free and ``head`` is the reference's
        first (the layer's input under another name)."""
        if self.reference is None or not self.reference.positional:
            return None
        ports = self.port.positional
        if self.reference.positional[0].name == head and ports and \
                ports[0].name not in self.bound:
            return ports[0]
        return None

    def leave_out_unplaced(self, heads: dict[str, Items]) -> list[tuple[str, str]]:
        """Rule (f): heads with no parameter are not taken by the port, each listed with
        what it held (None, the reference's default, or a description of the value)."""
        left = []
        for head in self.unplaced:
            items = heads[head]
            param = self._reference_param(head)
            if all(value is None for _, value in items):
                left.append((head, "None"))
            elif _equals_default(items, param):
                left.append((head, f"its default {param.default}"))
            else:
                left.append((head, _holds(items)))
        return left

    def _reference_param(self, head: str) -> Parameter | None:
        if self.reference is None:
            return None
        if not head.isdigit():
            return self.reference.named(head)
        positional = self.reference.positional
        return positional[int(head)] if int(head) < len(positional) else None

    def check_required(self, heads: dict[str, Items]) -> None:
        """Rule (g): every port parameter without a default gets a value; one sentence names
        all that do not, the reference's arguments, and the call adapter to write."""
        missing = [p.name for p in self.port.params
                   if not (p.variadic or p.has_default or p.name in self.bound)]
        if not missing:
            return
        names = " and ".join(repr(name) for name in missing)
        given = ", ".join(f"{_argument_name(head)} {_holds(items)}"
                          for head, items in heads.items()) or "nothing"
        raise CannotCall(f"{self.where}: the port's {self.port.describe()} needs {names}, "
                         f"which the reference's call does not give (it passes {given}); "
                         "write a call adapter, a function that takes the reference's "
                         "arguments and returns (args, kwargs) for the port layer, and name it "
                         "on the mapping's [[site]] rule for this layer: "
                         'call = "your_module:adapter"')

    def check_plain(self, heads: dict[str, Items]) -> None:
        """A value capture kept only as a repr cannot be passed: it can only be left out."""
        for param, head in self.bound.items():
            found = [v for _, v in heads[head] if isinstance(v, NotPlainData)]
            if found:
                raise CannotCall(f"{self.where}: the reference's argument "
                                 f"{_argument_name(head)} was recorded as {found[0].type_name}, "
                                 "not plain data, so it cannot be passed to the port's "
                                 f"'{param}'; drop it in the mapping file "
                                 f'(args = {{ {_toml_key(head)} = "" }}) or write a call '
                                 'adapter for the layer (call = "your_module:adapter")')

    def call_heads(self) -> dict[str, str]:
        """Rule (h): each kept head -> its head in the port's call."""
        renamed: dict[str, str] = {}
        position, gap = 0, False
        for param in self.port.positional:
            head = self.bound.get(param.name)
            if head is None:
                gap = True   # later ones can no longer go by position
            elif head == param.name and param.kind != "positional_only" and not self.extras:
                # the reference passed it by this name: so does the port's call (HF's
                # decorated forwards read use_cache from the keywords and pass it on by name,
                # "got multiple values" when it also came by position); later ones follow
                renamed[head] = param.name
                gap = True
            elif not gap:
                renamed[head] = str(position)
                position += 1
            elif param.kind == "positional_only":
                raise CannotCall(f"{self.where}: the port's {self.port.describe()} takes "
                                 f"'{param.name}' by position only, but the parameter before "
                                 "it gets no value from the reference's call; map a reference "
                                 "argument to that parameter in the mapping file")
            else:
                renamed[head] = param.name
        # (d) sends heads to *args only when every positional parameter is filled: no gap
        for head in self.extras:
            renamed[head] = str(position)
            position += 1
        for param in self.port.params:
            if param.kind == "keyword_only" and param.name in self.bound:
                renamed[self.bound[param.name]] = param.name
        renamed |= {head: head for head in self.keywords}
        return renamed


# ---- call adapters: the mapping's function makes the port's call
def adapted_call(adapter: CodeRef, function: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any], port: Callable[..., Any], *, where: str
                 ) -> tuple[tuple, dict[str, Any]]:
    """``function(*args, **kwargs)`` (the mapping's ``call = ...``, ``adapter``) turns the
    reference's call into ``(args, kwargs)`` for ``port`` (the port layer's forward). An adapter
    that raises, returns anything but ``(tuple, dict)``, or a call the port's signature does
    not take refuses the call in one sentence naming the mapping line."""
    named = f"the call adapter {adapter.spec!r} ({adapter.where})"
    try:
        result = function(*args, **kwargs)
    except Exception as exc:  # the user's code: its failure is this layer's cannot-judge
        raise CannotCall(f"{where}: {named} raised {type(exc).__name__}: {one_line(exc)}; "
                         "fix the function, or the mapping's call line") from exc
    if not (isinstance(result, (tuple, list)) and len(result) == 2
            and isinstance(result[0], (tuple, list)) and isinstance(result[1], dict)):
        raise CannotCall(f"{where}: {named} returned {describe_value(result)}, not (args, "
                         "kwargs): it must return a tuple of the port layer's positional "
                         "arguments and a dict of its keyword arguments")
    call_args, call_kwargs = tuple(result[0]), dict(result[1])
    try:
        inspect.signature(port).bind(*call_args, **call_kwargs)
    except TypeError as exc:
        described = Signature.of(port)
        raise CannotCall(f"{where}: {named} returned a call that the port's "
                         f"{described.describe() if described else 'forward'} does not take "
                         f"({exc}); make the adapter return (args, kwargs) for it") from exc
    except ValueError:  # no signature to check against (a builtin): the call itself tells
        pass
    return call_args, call_kwargs


def one_line(exc: BaseException) -> str:
    """An exception's message on one line, clipped to 200 characters."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 200 else text[:197] + "..."
