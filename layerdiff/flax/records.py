"""The host side of a Flax capture: the events the traced side emits (a call begun with its
inputs, ended with its outputs, a cotangent reaching a tap, the loss) turned into the writer's
sites and records, in the order they arrive.

Events arrive either directly (eager code, concrete values) or from compiled code through
ordered ``jax.debug.callback`` (inside a transform such as ``nnx.scan`` that traces its body
once and runs it N times), or, under ``jax.jit``, after the step, in trace order
(:mod:`layerdiff.flax.staging`). What the traced side cannot know, the host
resolves here: the call number (the writer counts), the layer of a stack an iteration is, and
which site a cotangent belongs to: the k-th cotangent of one traced call's tap belongs to its
k-th occurrence counted from the last, since the backward runs the forward's calls in reverse.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerdiff.flax.graph import Owned
from layerdiff.flax.stacks import Stack
from layerdiff.trace import schema
from layerdiff.trace.schema import Pass, Role
from layerdiff.trace.writer import TraceWriter


@dataclass(eq=False)
class Call:
    """One traced call of a module: its path in the model (a stack's module without its layer
    number: ``layers.fc``), its class name, and the stack it is a layer of."""

    path: str
    type_name: str
    stack: Stack | None = None


# one leaf of a call's arguments or outputs: (argument path, index into the values sent, or
# -1 with the plain value itself)
Leaf = tuple[str, int, Any]


@dataclass
class _Open:
    call: Call
    site: str
    k: int | None


@dataclass
class HostRecords:
    """Turns events into records (see the module's docstring); one per capture, reset each
    step by :meth:`begin_step`."""

    writer: TraceWriter
    owned: dict[str, list[Owned]]
    below: dict[str, list[tuple[str, str]]]
    values: dict[tuple, Any] = field(default_factory=dict)
    recorded: set[str] = field(default_factory=set)
    weight_sites: list[tuple[str, str, list[Owned], Stack | None, int | None]] = field(
        default_factory=list)
    open: list[_Open] = field(default_factory=list)
    sites_of: dict[Call, list[str]] = field(default_factory=dict)
    grads_seen: Counter = field(default_factory=Counter)
    layers: dict[str, list[Any]] = field(default_factory=dict)
    backward: bool = False
    error: BaseException | None = None

    def begin_step(self, values: dict[tuple, Any]) -> None:
        self.values = values
        self.recorded.clear()
        self.weight_sites.clear()
        self.open.clear()
        self.sites_of.clear()
        self.grads_seen.clear()
        self.layers.clear()
        self.backward = False

    def staged(self, event: Callable[..., None], *args: Any) -> None:
        """An event from compiled code: what it raises is kept for the step to raise (an
        exception inside a callback would reach the user as the runtime's, not ours)."""
        if self.error is not None:
            return
        try:
            event(*args)
        except BaseException as exc:  # raised by the step, see above
            self.error = exc

    # ---- the events
    def begin(self, call: Call, leaves: list[Leaf], *values: Any) -> None:
        if self.backward:
            return  # a forward recomputed in the backward (nnx.remat): recorded once already
        k = self._layer(call) if call.stack is not None else None
        path = call.stack.name(call.path, k) if call.stack is not None else call.path
        site = self.writer.enter(path, call.type_name)
        self.open.append(_Open(call, site, k))
        self.sites_of.setdefault(call, []).append(site)
        self._leaves(site, Role.INPUT, leaves, values)
        if schema.split_site(site)[1] == 0 and call.path in self.owned and (
                path not in self.recorded):
            self._record_weights(site, "", call.path, path, call.stack, k)

    def end(self, call: Call, leaves: list[Leaf], *values: Any) -> None:
        if self.backward:
            return
        frame = self.open.pop()
        site, k = frame.site, frame.k
        if schema.split_site(site)[1] == 0:
            for owner, prefix in self.below.get(call.path, ()):
                name = self._name(owner, call.stack, k)
                # never called yet: recorded here (a stack's, layer by layer, in its layers)
                stacked = name == owner and any(under(owner, root) for root in self.layers)
                if name not in self.recorded and not stacked:
                    self._record_weights(site, prefix, owner, name, call.stack, k)
        self._leaves(site, Role.OUTPUT, leaves, values)
        self.writer.exit(site)

    def grad(self, call: Call, role: str, arg: str, value: Any) -> None:
        sites = self.sites_of.get(call)
        if not sites:
            return
        seen = self.grads_seen[(call, role, arg)]
        self.grads_seen[(call, role, arg)] = seen + 1
        site = sites[-1 - seen % len(sites)]
        self.writer.record(site, role, np.asarray(value), arg=arg, pass_=Pass.BACKWARD)

    def loss(self, value: Any) -> None:
        with self.writer.site("<loss>", "loss") as site:
            self.writer.record(site, Role.OUTPUT, np.asarray(value))
        self.backward = True

    # ---- weights
    def _record_weights(self, site: str, prefix: str, owner: str, name: str,
                        stack: Stack | None, k: int | None) -> None:
        self.recorded.add(name)
        owned = self.owned[owner]
        layer = stack if stack is not None and under(owner, stack.root) else None
        for variable in owned:
            value = self.values[variable.state_path]
            value = layer.take(value, k) if layer is not None else np.asarray(value)
            self.writer.record(site, Role.WEIGHT, value, arg=prefix + variable.name,
                               pass_=Pass.FORWARD)
        self.weight_sites.append((site, prefix, owned, layer, k))

    def record_weight_grads(self, grads: dict[tuple, Any]) -> None:
        """Each parameter's gradient at the site that recorded it, in reverse order."""
        for site, prefix, owned, layer, k in reversed(self.weight_sites):
            for variable in owned:
                grad = grads.get(variable.state_path) if variable.param else None
                if grad is None:
                    continue
                grad = layer.take(grad, k) if layer is not None else np.asarray(grad)
                self.writer.record(site, Role.WEIGHT_GRAD, grad, arg=prefix + variable.name,
                                   pass_=Pass.BACKWARD)

    # ---- helpers
    def _leaves(self, site: str, role: str, leaves: list[Leaf], values: tuple) -> None:
        for arg, index, plain in leaves:
            value = np.asarray(values[index]) if index >= 0 else plain
            self.writer.record(site, role, value, arg=arg)

    def _name(self, path: str, stack: Stack | None, k: int | None) -> str:
        if stack is not None and k is not None and under(path, stack.root):
            return stack.name(path, k)
        return path

    def _layer(self, call: Call) -> int:
        """Which layer of its stack this occurrence of ``call`` is: an open call of the same
        stack's (its block, for the block's submodules), or the next layer when this module
        was already called in the current one (the scan's next iteration)."""
        stack = call.stack
        for frame in reversed(self.open):
            if frame.call.stack is not None and frame.call.stack.root == stack.root:
                return frame.k
        state = self.layers.setdefault(stack.root, [-1, set()])
        if state[0] < 0 or call.path in state[1]:
            state[0] = (state[0] + 1) % stack.n
            state[1] = {call.path}
        else:
            state[1].add(call.path)
        return state[0]


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")
