"""How a jitted step's records leave the compiled computation, cheaply: a host callback costs
about 0.2 ms a call on CPU, more than a whole millisecond-scale step's work per few of them,
so as few as the program's structure allows.

- An event traced at the step's own level (the forward under ``jax.vjp``, the backward, the
  loss) is no callback at all: its values become extra outputs of the jitted step (packed, one
  array per dtype), and the host hands them to the recorder after the step returns.
- A scan body (``jax.lax.scan``, which ``nnx.scan`` calls, wrapped while the step is traced:
  :meth:`Staging.scans`) returns the events traced at its own level as extra outputs, which the
  scan stacks over its iterations; after the scan they are one event of the enclosing trace,
  replayed per iteration on the host (:func:`_replay`).
- Its backward: each value tapped at the body's own level gets a *sink* (zeros stacked over the
  iterations, extra ``xs`` of the scan, differentiated by the step): the tap's backward hands
  its cotangent on as the sink's, the transposed scan stacks them and the step returns them as
  the sinks' gradients (:meth:`Staging.sink_zeros`). The sinks are sized by a first trace of
  the step (:class:`Restage`).
- Events traced inside another nested trace (an ``nnx.remat`` body) are buffered per trace and
  sent in one ordered ``jax.debug.callback``: the forward's at the end of the outermost
  recorded call in that trace, the backward's at the cotangent of that call's one
  differentiable input (the last a backward of the call computes); a cotangent traced before
  any such input in its trace is sent alone.
- Every event carries its place in trace order (its *slot*); the host merges the outputs'
  events with the callbacks' in that order: callbacks arrive in execution order (a remat body
  between the same two slots each time it runs), and each output event goes in before the
  first callback traced after it. So the records are the ones, in the order, that one
  callback per event gave.

Where that order cannot be kept (a callback inside a scan body whose own level records too,
cotangents of two scans in one transposed trace, a nested trace buffered inside another's),
the step is traced again with one callback per event (:class:`Unbatched`); a scan inside a
scan body sends its cotangents by callback (its sinks would be summed over the outer
iterations).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core

from layerdiff.errors import LayerdiffError


@dataclass(frozen=True, eq=False)
class Event:
    """One host event as traced: its place in trace order, the recorder's method and its
    static arguments, and how many array values follow them."""

    slot: int
    method: Callable[..., None]
    static: tuple
    count: int


class Restage(LayerdiffError):
    """Raised at the end of the step's first trace: scan bodies tapped values whose cotangents
    can leave as sinks' gradients (:meth:`Staging.sink_for`); traced again with the sinks."""


class Unbatched(LayerdiffError):
    """Raised while tracing the step: a nested trace's buffer cannot be sent in order; the
    step is traced again with one callback per event."""


def current_trace() -> Any:
    """The trace JAX is recording into now. Private in JAX (pyproject pins the minor version):
    its public kin, ``get_opaque_trace_state``, compares traces but cannot key a buffer."""
    return core.trace_ctx.trace


@dataclass
class _Buffer:
    trace: Any
    events: list[Event] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class _Frame:
    """A scan body being traced: its own events (not a nested trace's), and whether a
    callback was traced inside it."""

    trace: Any
    scan: int = 0  # which scan of the step's trace, in trace order
    sinks: list[Any] | None = None  # this iteration's slices of the scan's sinks, if given
    events: list[Event] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)
    taps: list[tuple[tuple[int, ...], Any]] = field(default_factory=list)  # shape, dtype
    mixed: bool = False
    layout: Packing | None = None


def _replay(events: list[Event], n: int, reverse: bool, layout: Packing | None,
            *stacked: Any) -> None:
    """A scan body's events, each of its ``n`` iterations' in trace order, the iterations in
    the order the scan ran them; ``stacked`` the events' values stacked over them (packed, an
    array per dtype an iteration, where ``layout``)."""
    for k in (range(n - 1, -1, -1) if reverse else range(n)):
        values = (_unpack([group[k] for group in stacked], layout) if layout is not None
                  else [v[k] for v in stacked])
        start = 0
        for event in events:
            event.method(*event.static, *values[start:start + event.count])
            start += event.count


class Staging:
    """The traced side (see the module's docstring). :meth:`begin_trace` at each trace of the
    step; the step returns :meth:`outputs`; after it ran, :meth:`merge` hands the host every
    event in trace order."""

    def __init__(self) -> None:
        self.batched = True
        self.plans: dict[int, list[Event]] = {}
        self._ids = itertools.count()
        self.arrivals: list[tuple[list[Event], tuple]] = []
        self.error: BaseException | None = None
        # each scan's tapped values' (shape, dtype), in trace order: known after one trace
        self.sink_shapes: list[list[tuple[tuple[int, ...], Any]]] | None = None
        self.begin_trace()

    def begin_trace(self) -> None:
        self.slot = 0
        self.top: list[Any] = []
        self.deferred: list[Event] = []
        self.values: list[Any] = []
        self.buffers: dict[int, _Buffer] = {}
        # nested traces with a flushing input tap traced (kept: an id is reused once freed)
        self.flushing: list[Any] = []
        self.callbacks = 0  # ordered callbacks traced so far in this trace of the step
        self.frames: list[_Frame] = []  # the scan bodies being traced, innermost last
        self.scanned: list[tuple[list[tuple[tuple[int, ...], Any]], int, bool]] = []
        self.sinks: list[list[Any]] = []
        self.sunk: list[tuple[Any, list[tuple[Event, tuple[int, int]]]]] = []
        self.called: list[Any] = []  # the nested traces that sent a callback

    # ---- trace time
    def top_level(self) -> None:
        """The trace now current is the step's own (the jit's, the vjp's forward)."""
        self.top.append(current_trace())

    def mark_flushing(self) -> None:
        self.flushing.append(current_trace())

    def has_flushing(self) -> bool:
        trace = current_trace()
        return any(trace is other for other in self.flushing)

    def send(self, method: Callable[..., None], static: tuple, values: list[Any], *,
             flush: bool, callback: bool = False) -> None:
        """One event: an output of the step at the top level; else buffered for its trace,
        sent with what is buffered when ``flush`` (or whenever unbatched)."""
        event = Event(self.slot, method, static, len(values))
        self.slot += 1
        trace = current_trace()
        if not callback and any(trace is top for top in self.top):
            self.deferred.append(event)
            self.values.extend(values)
            return
        if not callback and self.frames and self.frames[-1].trace is trace:
            self.frames[-1].events.append(event)  # a scan output (see scanned)
            self.frames[-1].values.extend(values)
            return
        buffer = self.buffers.get(id(trace))
        if buffer is None:
            if any(other.events for other in self.buffers.values()):
                self._unbatch()  # another trace's buffer still waits: this one nests in it
            buffer = self.buffers[id(trace)] = _Buffer(trace)
        buffer.events.append(event)
        buffer.values.extend(values)
        if flush or callback or not self.batched:
            self.flush(trace)

    def flush(self, trace: Any = None) -> None:
        """Send what the current (or given) trace buffered, in one ordered callback."""
        trace = current_trace() if trace is None else trace
        buffer = self.buffers.pop(id(trace), None)
        if buffer is None or not buffer.events:
            return
        self.callbacks += 1
        self.called.append(trace)
        for frame in self.frames:
            frame.mixed = True  # a callback inside a scan body: its outputs would come late
        jax.debug.callback(functools.partial(self._arrive, buffer.events), *buffer.values,
                           ordered=True)

    def send_loss(self, method: Callable[..., None], value: Any) -> None:
        """The loss: an output of the step, unless a nested trace sent the forward's records by
        callback; then a callback too, after which whatever a callback sends is the
        backward's (a remat body run again there is recorded once, by the host)."""
        nested = self.callbacks > 0
        self.send(method, (), [value], flush=False, callback=nested)

    # ---- a scan's body: its events as extra scan outputs
    @contextlib.contextmanager
    def scans(self) -> Iterator[None]:
        """While the step is traced: ``jax.lax.scan`` (which ``nnx.scan`` calls) runs its body
        with the events traced at the body's own level returned as extra outputs, stacked
        over the iterations by the scan itself; after it, they are one event of the
        enclosing trace that replays them iteration by iteration on the host (:func:`_replay`).
        A scan costs no callback then. Not once the step is traced unbatched."""
        original = jax.lax.scan
        if not self.batched:
            yield
            return

        @functools.wraps(original)
        def scan(f: Callable[..., Any], init: Any, xs: Any = None, length: Any = None,
                 reverse: bool = False, **kwargs: Any) -> Any:
            traced: list[_Frame] = []
            scan_index = len(self.scanned)
            self.scanned.append(([], 0, reverse))  # its place, filled in below
            sinks = self.sinks[scan_index] if scan_index < len(self.sinks) else []

            def body(carry: Any, x: Any) -> Any:
                x, sliced = x
                frame = _Frame(current_trace(), scan_index, list(sliced) if sinks else None)
                self.frames.append(frame)
                try:
                    carry, y = f(carry, x)
                finally:
                    self.frames.remove(frame)
                if frame.events and frame.mixed:
                    self._unbatch()  # its outputs would arrive after callbacks run inside
                if frame.sinks is not None and len(frame.taps) != len(frame.sinks):
                    self._unbatch()  # traced otherwise than the first time
                traced.append(frame)
                values = [jnp.asarray(v) for v in frame.values]
                frame.layout = _layout(values)  # packed: a scan output per dtype, not a value
                return carry, (y, _pack(values, frame.layout) if frame.layout else values)

            carry, (ys, stacked) = original(body, init, (xs, sinks), length, reverse,
                                            **kwargs)
            frame = traced[-1]  # the body as the scan runs it (it may trace it again)
            n = length if length is not None else len(jax.tree.leaves(xs)[0])
            self.scanned[scan_index] = (frame.taps, n, reverse)
            if frame.events:
                self.send(_replay, (frame.events, n, reverse, frame.layout), list(stacked),
                          flush=False)
            return carry, ys

        jax.lax.scan = scan
        try:
            yield
        finally:
            jax.lax.scan = original

    # ---- a scan body's cotangents as the gradients of sinks
    def sink_zeros(self) -> list[list[Any]]:
        """The step's sinks: per scan, per value tapped in its body, zeros stacked over its
        iterations; the step differentiates its loss by them too. A tap there hands its
        cotangent on as its sink's (:meth:`sink_for`), so the transposed scan stacks the
        cotangents as it stacks any xs' and the step returns them: no callback either. The
        shapes are known after one trace of the step (:class:`Restage`)."""
        if self.sink_shapes is None or not self.batched:
            return []
        return [[jnp.zeros((n, *shape), dtype) for shape, dtype in taps]
                for taps, n in self.sink_shapes]

    def take_sinks(self, sinks: list[list[Any]]) -> None:
        self.sinks = sinks

    def sink_for(self, value: Any) -> tuple[Any, tuple[int, int]] | None:
        """For a value tapped at a scan body's own level: its sink's slice and its place
        (scan, tap), when the step was given sinks; None otherwise (its cotangent is sent)."""
        frame = self.frames[-1] if len(self.frames) == 1 else None  # not a scan in a scan:
        if frame is None or frame.trace is not current_trace():  # its sinks would be summed
            return None
        place = (frame.scan, len(frame.taps))
        frame.taps.append((tuple(value.shape), value.dtype))
        if frame.sinks is None:
            return None
        if place[1] >= len(frame.sinks) or frame.sinks[place[1]].shape != value.shape:
            self._unbatch()
        return frame.sinks[place[1]], place

    def send_sunk(self, method: Callable[..., None], static: tuple,
                  place: tuple[int, int]) -> None:
        """A cotangent that leaves as its sink's gradient: its event, kept with the others of
        the (transposed) trace it is traced in, to be replayed per iteration in order."""
        event = Event(self.slot, method, static, 1)
        self.slot += 1
        trace = current_trace()
        for other, events in self.sunk:
            if other is trace:
                events.append((event, place))
                return
        self.sunk.append((trace, [(event, place)]))

    def end_trace(self) -> None:
        """After the step's backward was traced: everything buffered was sent (else traced
        unbatched); after the first trace, traced again if scan bodies tapped values."""
        if self.unsent():
            self._unbatch()
        for trace, _ in self.sunk:
            if any(trace is other for other in self.called):
                self._unbatch()  # a callback among the sunk events: the order is lost
        if self.sink_shapes is None and self.batched:
            self.sink_shapes = [(taps, n) for taps, n, _ in self.scanned]
            if any(taps for taps, _ in self.sink_shapes):
                raise Restage("scan bodies tap values: traced again with their sinks")

    def unsent(self) -> bool:
        return any(buffer.events for buffer in self.buffers.values())

    def check_sent(self) -> None:
        """At the end of a trace: everything buffered was sent, else trace unbatched."""
        if self.unsent():
            self._unbatch()

    def _unbatch(self) -> None:
        if not self.batched:
            raise AssertionError("an unbatched step buffered an event")  # send flushes each
        self.batched = False
        raise Unbatched("a nested trace's records could not be sent in one callback")

    def outputs(self, sink_grads: list[list[Any]] | None = None) -> tuple[int, Any]:
        """What the step returns for the host: its plan's number and the top-level values,
        packed into one byte array where their dtypes allow (one transfer, not one each);
        ``sink_grads`` the sinks' gradients, the cotangents sent by :meth:`send_sunk`."""
        plan = next(self._ids)
        pairs, at = [], 0
        for event in self.deferred:
            pairs.append((event, self.values[at:at + event.count]))
            at += event.count
        for _, events in self.sunk:
            events.sort(key=lambda item: item[0].slot)
            scans = {place[0] for _, place in events}
            if len(scans) != 1:
                self._unbatch()  # one transposed trace, cotangents of several scans
            (scan,) = scans
            _, n, reverse = self.scanned[scan]
            group = Event(events[0][0].slot, _replay,
                          ([event for event, _ in events], n, not reverse, None), len(events))
            pairs.append((group, [sink_grads[s][i] for _, (s, i) in events]))
        pairs.sort(key=lambda pair: pair[0].slot)
        self.deferred = [event for event, _ in pairs]
        values = [jnp.asarray(value) for _, group in pairs for value in group]
        layout = _layout(values)
        self.plans[plan] = (self.deferred, layout)
        return plan, (_pack(values, layout) if layout is not None else values)

    # ---- host
    def _arrive(self, events: list[Event], *values: Any) -> None:
        self.arrivals.append((events, values))

    def merge(self, plan: int, values: list[Any]) -> None:
        """Every event of the step just run, in trace order (see the module's docstring)."""
        deferred, layout = self.plans[plan]
        values = _unpack(values, layout) if layout is not None else jax.device_get(
            values)
        arrivals, self.arrivals = self.arrivals, []
        at = 0  # into values
        pending = iter(deferred)
        next_event = next(pending, None)
        for events, sent in arrivals:
            first = events[0].slot
            while next_event is not None and next_event.slot < first:
                next_event.method(*next_event.static, *values[at:at + next_event.count])
                at += next_event.count
                next_event = next(pending, None)
            start = 0
            for event in events:
                event.method(*event.static, *sent[start:start + event.count])
                start += event.count
        while next_event is not None:
            next_event.method(*next_event.static, *values[at:at + next_event.count])
            at += next_event.count
            next_event = next(pending, None)


# ---- the top-level values as one array per dtype: each value raveled, concatenated (XLA
# fuses the concatenation with the ravels: one operation, where bytes took one a value)
Layout = list[tuple[int, int, int, tuple[int, ...]]]  # (group, offset, size, shape)
Packing = tuple[list[Any], Layout]  # the groups' dtypes, each value's place


def _layout(values: list[Any]) -> Packing | None:
    """The dtypes of the groups, and each value's group, offset and shape in it; None where a
    dtype is not one numpy holds as it is (sent one by one)."""
    groups: list[Any] = []
    sizes: list[int] = []
    layout: Layout = []
    for value in values:
        dtype = value.dtype
        if np.dtype(dtype).kind not in "biuf" and dtype != jnp.bfloat16:
            return None
        if dtype not in groups:
            groups.append(dtype)
            sizes.append(0)
        group = groups.index(dtype)
        layout.append((group, sizes[group], int(value.size), tuple(value.shape)))
        sizes[group] += int(value.size)
    return groups, layout


def _pack(values: list[Any], packing: Packing) -> list[Any]:
    groups, layout = packing
    pieces: list[list[Any]] = [[] for _ in groups]
    for value, (group, _, _, _) in zip(values, layout, strict=True):
        pieces[group].append(jnp.ravel(value))
    return [jnp.concatenate(group) for group in pieces]


def _unpack(packed: list[Any], packing: Packing) -> list[np.ndarray]:
    arrays = [np.asarray(group) for group in packed]
    return [arrays[group][offset:offset + size].reshape(shape)
            for group, offset, size, shape in packing[1]]
