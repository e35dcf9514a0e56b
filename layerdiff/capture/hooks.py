"""Torch hooks that turn every module call into trace records, forward and backward.

How the backward records are taken without perturbing the run (nothing is inserted into the
graph, unlike ``register_full_backward_hook``, so in-place layers and views work and the order of
gradient accumulation is untouched). Autograd numbers its nodes in creation order (sequence
numbers), so the nodes a call created are those numbered from the counter read when it began to
the counter read when it returned; the nodes numbered after are outside it.
- grad_output: the gradient arriving at an output value *from outside the call*, what torch's
  full backward hooks report: the sum of what the nodes created after the call returned send to
  that value. Those consumers exist only once the forward is over: when the loss is recorded,
  one walk of the graph from the loss finds them for every output of the step and hooks them
  (:meth:`ModuleRecorder.record_loss`). A gradient of the module's own use of a tensor it also
  returns (attention weights it multiplied with the values) is left out, and an output nothing
  outside uses gets no record. A later in-place op on the output consumes the value too: its
  gradient is what arrives (on an output that is a view, autograd sends it to the view's base:
  the view's part is cut out of it there).
- grad_input: the nodes created during the call that consume the call's input tensors are found
  by walking the graph from the outputs; a hook on each of those nodes sees this call's own
  gradient contribution to the input, not the sum over every consumer. An input returned
  unchanged adds what arrives at it from outside, as its grad_output does. A call's walk steps
  over the interior of each call that finished inside it: what that call's walk found leaving
  its interior from each of its outputs (its *frontier*) is where the graph goes on, so each
  node is walked about once per step, not once per enclosing call (see :func:`_walk`).
- Each graph node gets at most one hook per step, whatever number of records it feeds (the
  first op of a block feeds the grad_input of the block, of its first child, of the layer
  stack...): the hook runs the records' slots in the order they were added, which is the order
  separate hooks ran in.

Weights: a parameter or buffer object is recorded once per step however many modules hold it
(a tied embedding and output head), as ``weight`` and ``weight_grad`` of the first selected
module that holds it in registration order (``model.named_modules()``), its *owner*, see
:func:`owned_tensors`. Tied weights are registered with the embedding first in the common
models, so that module is also the first user in forward and the last in backward, where the
gradient is complete: an error upstream in the backward is not blamed on the head.

An owner that is never called (``nn.MultiheadAttention`` hands ``out_proj.weight`` to
``F.multi_head_attention_forward`` without calling ``out_proj``) has no site of its own: its
tensors are recorded at the end of the first call of its nearest selected ancestor that was
called, under their names relative to that ancestor (``blocks.0.mha#0``, ``out_proj.weight``),
so that site + argument still spell the full name. Which owners those are is learnt once, in the
first recorded step (an owner not yet called when its ancestor's first call returns), and kept
for every later step: the hot path of a model without them only checks an empty tuple.
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn

from layerdiff.capture.direct import DirectCalls
from layerdiff.capture.modules import ModuleHooks, module_paths, named_modules
from layerdiff.capture.sharded import module_type_name
from layerdiff.capture.stage import Stager
from layerdiff.case import nothing_selected
from layerdiff.errors import CaptureError
from layerdiff.trace import arguments, schema
from layerdiff.trace.schema import Pass, Role


def _next_sequence_nr() -> int:
    return torch._C._autograd._get_sequence_nr()


@dataclass(slots=True)
class _OpenCall:
    site: str
    module: str
    call: int
    type: str
    parent: str
    enter_seq: int
    first_node: int                       # autograd sequence number when the call began
    # inputs needing grad: (argument path, autograd identity taken before the call ran, so
    # that an in-place op inside the call does not hide it, and the node to keep it alive)
    inputs: list[tuple[str, tuple, Any]] = field(default_factory=list)
    # calls that finished inside this one: id(output node) -> (that node, its frontier); the
    # walk of this call's graph steps over their interiors
    inner: dict[int, tuple[Any, list]] | None = None


def flatten(value: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """(argument path, leaf) pairs of nested tuples, lists and dicts (a ``torch.Size`` is one
    value): the trace's argument paths, :func:`layerdiff.trace.arguments.flatten`."""
    return arguments.flatten(value, prefix, is_leaf=lambda v: isinstance(v, torch.Size))


_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # the node of a leaf tensor
# the node an in-place op on a view puts on the view's base: it sends the base its gradient,
# the view's region holding what the op sends back to the view's values before it ran
_COPY_SLICES = torch._C._functions.CopySlices


@dataclass(frozen=True, slots=True)
class _ViewGeometry:
    """Where an output that is a view lies in its base, to cut its part out of the base's
    gradient (as autograd's CopySlices does)."""

    base_size: tuple[int, ...]
    base_stride: tuple[int, ...]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int

    def cut(self, base_grad: torch.Tensor) -> torch.Tensor:
        laid = base_grad.new_empty_strided(self.base_size, self.base_stride)
        laid.copy_(base_grad)
        return laid.as_strided(self.size, self.stride, self.offset)


def _tensor_key(tensor: torch.Tensor) -> tuple:
    if tensor.grad_fn is None:
        return ("leaf", id(tensor))
    return (id(tensor.grad_fn), tensor.output_nr)


class _SumBuffers:
    """Memory reused across steps for the sums of a gradient record's contributions (an input
    used three times, q/k/v, gets three): ``a + b`` put each sum in fresh memory, 148 MiB a
    step on the d=256 transformer. A sum is the same elementwise ``add`` into a buffer this
    object lends, and back once the record is staged. Bit for bit the same: ``(a + b) + c``
    whichever memory holds it. CPU tensors only, and only with a stager that is done with a
    tensor's memory when ``tensor()`` returns (copied to the ring or reduced, as
    :class:`Stager` and find-nan's checker are): a GPU copy or reduction queued on a stream
    could still be reading it."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lent: dict[int, torch.Tensor] = {}

    def add(self, total: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if id(total) in self._lent:   # a sum already in our memory: the next one goes in place
            return total.add_(grad)
        if (type(total) is not torch.Tensor or type(grad) is not torch.Tensor   # a DTensor
                or not total.is_cpu or total.shape != grad.shape or total.dtype != grad.dtype
                or total.device != grad.device or total.layout is not torch.strided
                or grad.layout is not torch.strided or total.requires_grad
                or grad.requires_grad):   # broadcasting, promotion, a double backward: as is
            return total + grad
        key = (total.shape, total.dtype, total.device)
        free = self._free.get(key)
        buffer = free.pop() if free else torch.empty(total.shape, dtype=total.dtype,
                                                     device=total.device)
        torch.add(total, grad, out=buffer)
        self._lent[id(buffer)] = buffer
        return buffer

    def give_back(self, tensor: torch.Tensor) -> None:
        """``tensor`` has been staged: its memory may take the next sum."""
        if self._lent.pop(id(tensor), None) is not None:
            self._free.setdefault((tensor.shape, tensor.dtype, tensor.device),
                                  []).append(tensor)

    def reclaim(self) -> None:
        for tensor in list(self._lent.values()):
            self.give_back(tensor)


@dataclass(frozen=True, slots=True)
class _Owned:
    """The tensors a module records as its own (fixed at attach): the hot path only loops."""

    tensors: tuple[tuple[dict, str], ...]    # (module._parameters or _buffers, name)
    params: tuple[tuple[dict, str], ...]     # the parameters among them: their .grad is recorded


@dataclass(slots=True)
class _Slot:
    """What one hooked module records of the weights. Mutable: the first recorded step settles
    which owners are never called, and moves their tensors to an ancestor's slot."""

    owned: _Owned | None                             # its own tensors (None: none, or adopted)
    adopted: tuple[tuple[str, _Owned], ...] = ()     # (name prefix, tensors) of uncalled owners
    below: tuple[tuple[str, str], ...] = ()          # (owner path, name prefix): owners under it


def owned_tensors(modules: Sequence[tuple[str, nn.Module]]) -> dict[str, _Owned]:
    """For each module path, the parameters and buffers it records: its own (recurse=False),
    less those an earlier module in ``modules`` holds too. Each tensor object is recorded once,
    under the first module (in the order given, registration order) that holds it."""
    seen: set[int] = set()
    owned: dict[str, _Owned] = {}
    for path, module in modules:
        tensors: list[tuple[dict, str]] = []
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    tensors.append((store, name))
        if tensors:
            params = tuple(t for t in tensors if t[0] is module._parameters)
            owned[path] = _Owned(tuple(tensors), params)
    return owned


def shared_parameters(model: nn.Module, include: Sequence[str] = (),
                      exclude: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Parameters and buffers that several names refer to (tied weights), for the trace meta.

    Each is ``{"name": the full name its records carry, or None when no selected module holds
    it, "users": every full name that refers to it}``; ``name`` comes from
    :func:`owned_tensors` over the same selection the capture records, so the two agree.
    """
    users: dict[int, list[str]] = {}
    named = chain(model.named_parameters(remove_duplicate=False),
                  model.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        users.setdefault(id(tensor), []).append(name)
    recorded: dict[int, str] = {}
    for path, owned in owned_tensors(select_modules(model, include, exclude)).items():
        for store, name in owned.tensors:
            full = name if path == schema.ROOT_MODULE else f"{path}.{name}"
            recorded[id(store[name])] = full
    return [{"name": recorded.get(key), "users": names}
            for key, names in users.items() if len(names) > 1]


def around_modules(model: nn.Module, around: Sequence[str], radius: int) -> set[str]:
    """The module paths a ``--full-around`` capture keeps tensor data for: each named module
    (a path or glob, or a site ``module#call``, or an op site), every module inside it, and its
    ``radius`` nearest siblings on each side (in the parent's order) with everything inside
    them: the layer where a summary diff found the origin, and the layers before and after."""
    if radius < 0:
        raise CaptureError(f"--radius must be 0 or more (got {radius})")
    named = module_paths(model)
    children: dict[str, list[str]] = {}
    for path in named:
        if path != schema.ROOT_MODULE:
            parent = path.rpartition(".")[0] or schema.ROOT_MODULE
            children.setdefault(parent, []).append(path)
    kept: set[str] = set()
    for entry in around:
        op = schema.split_op_site(entry)
        module = op[0] if op else entry
        module = module.rpartition("#")[0] if "#" in module else module
        matched = [path for path in named if fnmatch.fnmatchcase(path, module)]
        if not matched:
            raise CaptureError(f"--full-around {entry!r} names no module of "
                               f"{type(model).__name__}; module paths look like: "
                               f"{', '.join(named[:8])}")
        for path in matched:
            if path == schema.ROOT_MODULE:
                kept.update(named)
                continue
            siblings = children[path.rpartition(".")[0] or schema.ROOT_MODULE]
            at = siblings.index(path)
            for near in siblings[max(0, at - radius):at + radius + 1]:
                kept.add(near)
                kept.update(p for p in named if p.startswith(near + "."))
    return kept


def select_modules(model: nn.Module, include: Sequence[str],
                   exclude: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """The (path, module) pairs to record; an include glob that matches nothing is an error."""
    named = named_modules(model)
    for pattern in include:
        if not any(fnmatch.fnmatchcase(path, pattern) for path, _ in named):
            sample = ", ".join(path for path, _ in named[:8])
            raise CaptureError(f"--include {pattern!r} matches no module of "
                               f"{type(model).__name__}; module paths look like: {sample}")
    selected = [(path, module) for path, module in named
                if (not include or any(fnmatch.fnmatchcase(path, p) for p in include))
                and not any(fnmatch.fnmatchcase(path, p) for p in exclude)]
    if not selected:
        raise CaptureError(nothing_selected(include, exclude, type(model).__name__,
                                            [path for path, _ in named]))
    return selected


class ModuleRecorder:
    """Hooks on the selected modules of one model, recording into one Stager.

    ``record_steps``, when given, are the only steps recorded: in the others the hooks return
    at once (``layerdiff.debug.diverge`` runs up to a step and records that one alone).
    """

    # False walks every finished inner call's interior again (the records are the same: tests
    # compare the two ways)
    skip_finished_calls = True

    def __init__(self, modules: list[tuple[str, nn.Module]], stager: Stager, *,
                 weights: bool = True, record_steps: Collection[int] | None = None) -> None:
        self.modules = modules
        self.stager = stager
        self.weights = weights
        self.record_steps = None if record_steps is None else frozenset(record_steps)
        self.recording = True
        self.step = 0
        self.open: list[_OpenCall] = []           # calls whose forward has not returned
        self._calls: Counter[str] = Counter()
        # (site, name prefix, tensors) in recording order: their gradients follow the backward
        self._weight_sites: list[tuple[str, str, _Owned]] = []
        # (site, role, arg) -> [contributions still to come, their sum so far]
        self._partial_grads: dict[tuple[str, str, str], list] = {}
        # output values of this step's calls whose consumers outside the call are hooked when
        # the loss is recorded: (node, output_nr, first sequence number outside, site, role,
        # arg, None; or for the base of an output that is a view, the view's geometry)
        self._watched: list[tuple[Any, int, int, str, str, str, _ViewGeometry | None]] = []
        # this step's hooked nodes: id(node) -> (node, the slots its one hook runs)
        self._node_slots: dict[int, tuple[Any, list]] = {}
        self._sums = _SumBuffers()
        # ``child.forward(...)`` called directly runs these hooks too (OpRecorder adds its own)
        self.direct = DirectCalls()
        self._hooks = ModuleHooks(self.direct)
        self._slots: dict[str, _Slot] = {}
        # until the first recorded step has run: which owners are never called is being learnt
        self._learning = False
        self._recorded: set[str] = set()           # owners recorded in the learning step
        self._adoptions: list[tuple[str, str, str]] = []  # (ancestor, prefix, owner) learnt

    # ---- lifecycle ----
    def attach(self) -> None:
        self._slots = _slots(self.modules, owned_tensors(self.modules) if self.weights else {})
        self._learning = any(slot.below for slot in self._slots.values())
        hooks = self._hooks
        try:
            for path, module in self.modules:
                slot = self._slots[path]
                hooks.before(module, partial(self._before, path, slot,
                                             module_type_name(module)), with_kwargs=True)
                # first among the module's forward hooks: it records the module's own output,
                # before a hook the model put in changes it (tensor parallelism's turns a
                # sharded DTensor into a plain local tensor) or FSDP reshards the weights
                hooks.after(module, partial(self._after, path, slot), with_kwargs=True,
                            prepend=True)
                hooks.wrap_forward(module)
        except BaseException:   # no hook outlives a failed attach
            hooks.remove()
            raise

    def detach(self) -> None:
        self._hooks.remove()
        self._node_slots.clear()
        self._sums = _SumBuffers()

    def begin_step(self, step: int) -> None:
        if self._learning and self._calls:  # the first recorded step ran: what it learnt holds
            self._settle()
        self.step = step
        self.recording = self.record_steps is None or step in self.record_steps
        self._calls.clear()
        self._weight_sites.clear()
        self._watched.clear()
        self._partial_grads.clear()
        self._node_slots.clear()
        self._sums.reclaim()   # a step that raised mid-backward left sums lent out
        self.open.clear()

    def record_loss(self, loss: torch.Tensor) -> None:
        """Record the loss, and hook the gradients that will arrive at the step's outputs from
        outside their calls: the graph is complete now, before the backward runs."""
        if not self.recording:
            self._watched.clear()
            return
        seq = self.stager.recorder.seq
        self.stager.tensor(self.step, Pass.FORWARD, schema.LOSS_SITE, Role.OUTPUT, "0", loss)
        self._site_row(schema.LOSS_SITE, "<loss>", 0, "loss", "", seq)
        watched, self._watched = self._watched, []
        if watched and isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
            self._hook_outside_consumers(loss.grad_fn, watched)

    def after_backward(self) -> None:
        """Emit grad_input sums still waiting for a contribution, then weight gradients."""
        if not self.recording:
            return
        self._node_slots.clear()   # the backward has run: the graph's nodes are not held
        for (site, role, arg), (_, total) in self._partial_grads.items():
            if total is not None:
                self.stager.tensor(self.step, Pass.BACKWARD, site, role, arg, total)
                self._sums.give_back(total)
        self._partial_grads.clear()
        for site, prefix, owned in reversed(self._weight_sites):
            for store, name in owned.params:
                param = store.get(name)
                grad = param.grad if param is not None else None
                if grad is not None:
                    self.stager.tensor(self.step, Pass.BACKWARD, site, Role.WEIGHT_GRAD,
                                       prefix + name, grad)

    def weight_records(self) -> list[tuple[str, str, torch.Tensor]]:
        """``(site, arg, tensor)`` of every parameter and buffer the current (or last) recorded
        step recorded, in recording order; empty before one has run. Each tensor is the object
        the module holds now (read it after the optimizer step to see the updated weights)."""
        found = []
        for site, prefix, owned in self._weight_sites:
            for store, name in owned.tensors:
                tensor = store.get(name)
                if tensor is not None:
                    found.append((site, prefix + name, tensor))
        return found

    # ---- forward hooks ----
    def _before(self, path: str, slot: _Slot, type_name: str, module: nn.Module, args: tuple,
                kwargs: dict) -> None:
        if not self.recording:
            return
        call = self._calls[path]
        self._calls[path] = call + 1
        site = schema.site_name(path, call)
        opened = self.open_call(site, path, call, type_name,
                                self.open[-1].site if self.open else "")
        self.open.append(opened)
        self.record_inputs(opened, call_arguments(args, kwargs))
        owned = slot.owned
        if owned is not None and call == 0:
            if not self._learning:
                self._record_weights(site, "", owned)
            elif path not in self._recorded:  # else called after an ancestor took its tensors
                self._recorded.add(path)
                self._record_weights(site, "", owned)

    def _record_weights(self, site: str, prefix: str, owned: _Owned) -> None:
        # read from the module's dicts now: a tensor replaced since attach is recorded as is
        stager, step = self.stager, self.step
        for store, name in owned.tensors:
            tensor = store.get(name)
            if tensor is not None:
                stager.tensor(step, Pass.FORWARD, site, Role.WEIGHT, prefix + name, tensor)
        self._weight_sites.append((site, prefix, owned))

    def _after(self, path: str, slot: _Slot, module: nn.Module, args: tuple, kwargs: dict,
               output: Any) -> None:
        if not self.recording:
            return
        opened = self.open.pop()
        if opened.call == 0:
            if self._learning:
                self._adopt_uncalled(path, opened.site, slot)
            else:
                for prefix, owned in slot.adopted:
                    self._record_weights(opened.site, prefix, owned)
        self.finish_call(opened, list(flatten(output, "")))

    # ---- one call's records: shared by module calls and the op calls inside them ----
    def open_call(self, site: str, module: str, call: int, type_name: str,
                  parent: str) -> _OpenCall:
        """A call about to run: what its records will be keyed by, and where the autograd
        graph stood before it (its backward nodes are the ones created from here on)."""
        return _OpenCall(site, module, call, type_name, parent, self.stager.recorder.seq,
                         _next_sequence_nr())

    def record_inputs(self, opened: _OpenCall, arguments: Iterable[tuple[str, Any]]) -> None:
        stager, step, site = self.stager, self.step, opened.site
        for arg, value in arguments:
            stager.any(step, Pass.FORWARD, site, Role.INPUT, arg, value)
            if isinstance(value, torch.Tensor) and value.requires_grad:
                opened.inputs.append((arg, _tensor_key(value), value.grad_fn))

    def finish_call(self, opened: _OpenCall, outputs: list[tuple[str, Any]]) -> None:
        """Record a call's outputs and its site row, and hook its backward."""
        stager, step, site = self.stager, self.step, opened.site
        for arg, value in outputs:
            stager.any(step, Pass.FORWARD, site, Role.OUTPUT, arg, value)
        self._site_row(site, opened.module, opened.call, opened.type, opened.parent,
                       opened.enter_seq)
        inner = opened.inner
        if torch.is_grad_enabled():
            grads = [(arg, t) for arg, t in outputs
                     if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            if grads:
                outside = _next_sequence_nr()   # nodes numbered from here on are outside
                watched = self._watched
                for arg, tensor in grads:
                    watched.append((tensor.grad_fn, tensor.output_nr, outside, site,
                                    Role.GRAD_OUTPUT, arg, None))
                    if tensor._is_view():   # changed in place later: its gradient goes to the base
                        self._watch_base(tensor, outside, site, Role.GRAD_OUTPUT, arg)
                if opened.inputs:
                    inner = self._hook_grad_inputs(opened, grads, outside)
        # what the enclosing call's walk may step over: this call's frontiers, or where it
        # walked nothing, those of the calls inside it
        if inner and self.open:
            parent = self.open[-1]
            if parent.inner is None:
                parent.inner = inner
            else:
                parent.inner.update(inner)

    # ---- owners that are never called: learnt in the first recorded step ----
    def _adopt_uncalled(self, path: str, site: str, slot: _Slot) -> None:
        """At the end of a module's first call, the tensors of the owners under it that have
        not been called yet: the innermost ancestor's call ends first, so it takes them."""
        for owner, prefix in slot.below:
            if owner not in self._recorded:
                self._recorded.add(owner)
                self._adoptions.append((path, prefix, owner))
                self._record_weights(site, prefix, self._slots[owner].owned)

    def _settle(self) -> None:
        """Keep what the first recorded step learnt: an adopted owner records nothing at its own
        calls, and its ancestor records its tensors at every step."""
        adopted: dict[str, list[tuple[str, _Owned]]] = {}
        for ancestor, prefix, owner in self._adoptions:
            adopted.setdefault(ancestor, []).append((prefix, self._slots[owner].owned))
        for _, _, owner in self._adoptions:
            self._slots[owner].owned = None
        for ancestor, tensors in adopted.items():
            self._slots[ancestor].adopted = tuple(tensors)
        for slot in self._slots.values():
            slot.below = ()
        self._learning = False
        self._recorded.clear()

    def _site_row(self, site: str, module: str, call: int, type_name: str, parent: str,
                  enter_seq: int) -> None:
        self.stager.recorder.submit_site({
            "step": self.step, "site": site, "module": module, "call": call, "type": type_name,
            "parent": parent, "enter_seq": enter_seq, "exit_seq": self.stager.recorder.seq})

    # ---- backward hooks ----
    def _watch_base(self, view: torch.Tensor, outside: int, site: str, role: str,
                    arg: str) -> None:
        """An output that is a view and that the caller changes in place (``y += x`` on a
        Linear's 3-D output) has its gradient sent to its base by a CopySlices node: watch the
        base for those, to cut the view's part out."""
        base = view._base
        if base is None or base.grad_fn is None:
            return
        geometry = _ViewGeometry(tuple(base.shape), base.stride(), tuple(view.shape),
                                 view.stride(), view.storage_offset() - base.storage_offset())
        self._watched.append((base.grad_fn, base.output_nr, outside, site, role, arg, geometry))

    def _hook_outside_consumers(self, root: Any, watched: list[tuple[
            Any, int, int, str, str, str, _ViewGeometry | None]]) -> None:
        """Hook every node that consumes a watched output value and was created after that
        value's call returned: what those nodes send to the value is the gradient arriving from
        outside the call. One walk of the step's graph from the loss serves every call."""
        by_value: dict[tuple[int, int], list[tuple[int, tuple[str, str, str],
                                                   _ViewGeometry | None]]] = {}
        partials = self._partial_grads
        for node, output_nr, outside, site, role, arg, geometry in watched:
            key = (site, role, arg)
            partials.setdefault(key, [0, None])
            by_value.setdefault((id(node), output_nr), []).append((outside, key, geometry))
        # a node older than every call's end consumes nothing from outside a call, and neither
        # do the nodes it leads to (they are older still): the walk stops there
        earliest = min(entry[2] for entry in watched)
        seen: dict[int, Any] = {}   # held until the walk ends: ids stay unique (see below)
        todo = [root]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen[id(node)] = node
            number = node._sequence_nr()
            slots: list[tuple[int, tuple[str, str, str], _ViewGeometry | None]] = []
            for slot, (child, output_nr) in enumerate(node.next_functions):
                if child is None or type(child) is _ACCUMULATE_GRAD:
                    continue
                watchers = by_value.get((id(child), output_nr))
                if watchers is not None:
                    for outside, key, geometry in watchers:
                        # a view's base is watched for in-place changes of the view alone
                        if number >= outside and (geometry is None or (
                                slot == 0 and type(node) is _COPY_SLICES)):
                            slots.append((slot, key, geometry))
                            partials[key][0] += 1
                if id(child) not in seen and child._sequence_nr() >= earliest:
                    todo.append(child)
            if slots:
                self._hook_node(node, slots)
        # an output that nothing outside its call consumes gets no record at all
        for key, (left, _) in list(partials.items()):
            if left == 0 and key[1] == Role.GRAD_OUTPUT:
                del partials[key]

    def _hook_grad_inputs(self, opened: _OpenCall, outputs: list[tuple[str, torch.Tensor]],
                          outside: int) -> dict[int, tuple[Any, list]] | None:
        """Hook the nodes that carry this call's own gradient to its inputs; return its
        frontiers (for the enclosing call's walk), when there is an enclosing call."""
        # An input passed under several argument paths (attn(x, x, x)) is one value with one
        # gradient: it is recorded under its first path.
        targets: dict[tuple, str] = {}
        for arg, key, _ in opened.inputs:
            targets.setdefault(key, arg)
        roots: dict[int, Any] = {}
        passed_through: list[str] = []
        for _, tensor in outputs:
            arg = targets.get(_tensor_key(tensor))
            if arg is not None:  # returned its input unchanged: what arrives from outside
                if arg not in passed_through:   # passes through to the input
                    passed_through.append(arg)
                    self._watched.append((tensor.grad_fn, tensor.output_nr, outside,
                                          opened.site, Role.GRAD_INPUT, arg, None))
                    if tensor._is_view():
                        self._watch_base(tensor, outside, opened.site, Role.GRAD_INPUT, arg)
            elif tensor.grad_fn._sequence_nr() >= opened.first_node:  # else made before the call
                roots.setdefault(id(tensor.grad_fn), tensor.grad_fn)
        keys = {arg: (opened.site, Role.GRAD_INPUT, arg) for arg in targets.values()}
        leaf_inputs = any(key[0] == "leaf" for key in targets)
        inner = opened.inner if self.skip_finished_calls else None
        boundary: dict[int, tuple[Any, list]] = {}
        summaries: dict[int, tuple[Any, list]] | None = None
        # frontiers serve an enclosing call that walks (one with inputs needing grad): a
        # Linear in a Sequential whose input needs none has no use for them
        wanted = self.skip_finished_calls and any(call.inputs for call in self.open)
        if not wanted or len(roots) < 2:   # one walk; with one root it is that root's
            frontier: list | None = [] if wanted else None
            _walk(list(roots.values()), opened.first_node, targets, keys, leaf_inputs, inner,
                  boundary, frontier)
            if frontier is not None and roots:
                root = next(iter(roots.values()))
                summaries = {id(root): (root, frontier)}
        else:   # each output's frontier apart: the enclosing call may reach only some of them
            summaries = {}
            for key, root in roots.items():
                frontier = []
                _walk([root], opened.first_node, targets, keys, leaf_inputs, inner, boundary,
                      frontier)
                summaries[key] = (root, frontier)
        expected = Counter(key for _, slots in boundary.values() for _, key, _ in slots)
        partials = self._partial_grads
        for arg in passed_through:   # its outside consumers are counted in when hooked
            partials[keys[arg]] = [0, None]
        for key in keys.values():    # in the order of the call's arguments
            count = expected.get(key)
            if count:
                partials[key] = [count, None]
        for node, slots in boundary.values():
            self._hook_node(node, slots)
        return summaries

    def _hook_node(self, node: Any, slots: list) -> None:
        """Run ``slots`` when ``node`` has run in the backward: one hook per node and step."""
        entry = self._node_slots.get(id(node))
        if entry is None:
            slots = list(slots)
            self._node_slots[id(node)] = (node, slots)   # held: its id stays its own
            node.register_hook(partial(self._on_gradients, slots))
        else:
            entry[1].extend(slots)

    def _on_gradients(self, slots: list[tuple[int, tuple[str, str, str], _ViewGeometry | None]],
                      grad_inputs: tuple, grad_outputs: tuple) -> None:
        """A hooked node ran: add what it sent along each hooked edge to that record's sum, and
        record the sum once its last contribution has come (in the order autograd adds them)."""
        partials = self._partial_grads
        for slot, key, geometry in slots:
            entry = partials.get(key)
            if entry is None:
                continue
            grad = grad_inputs[slot]
            if grad is not None and geometry is not None:
                grad = geometry.cut(grad)
            entry[0] -= 1
            if grad is not None:
                entry[1] = grad if entry[1] is None else self._sums.add(entry[1], grad)
            if entry[0] == 0:
                del partials[key]
                if entry[1] is not None:
                    site, role, arg = key
                    self.stager.tensor(self.step, Pass.BACKWARD, site, role, arg, entry[1])
                    self._sums.give_back(entry[1])


def _walk(roots: list, first: int, targets: dict[tuple, str], keys: dict[str, tuple],
          leaf_inputs: bool, inner: dict[int, tuple[Any, list]] | None,
          boundary: dict[int, tuple[Any, list]], frontier: list | None) -> None:
    """Walk a call's graph from ``roots`` (its output nodes) through the nodes it created
    (numbered from ``first``), adding to ``boundary`` each node that sends a gradient straight
    to an input (``targets``: input key -> argument path), with its slots.

    A node in ``inner`` is an output of a call that finished inside this one: instead of its
    interior, the walk takes that call's frontier for it, the nodes of its interior with the
    edges that leave it (to a leaf, an input of that call, or a node made before it). Those
    are the only edges out of the interior reachable from that output, so this walk examines
    the same edges as one that went through: each either leads to a node this call made (walked
    on), or is a boundary edge of this call, or leaves it (added to ``frontier``, this walk's
    own, when one is asked for). A frontier node is marked seen: whatever it leads to inside
    the inner call is covered by the same frontier. A node reached by another way (a tensor the
    inner call kept and this call used later) is walked as any other.

    Nodes are keyed by id(), so every node visited is held until the walk ends (``seen``, the
    frontiers): a Python wrapper of an autograd node may be freed once unreferenced and its id
    given to the wrapper of another node (torch 2.11 does; the walk then skipped branches).
    The inner loop is kept to dictionary lookups: a leaf (AccumulateGrad, never made during
    the call) is looked at only when an input is one, and a node made before the call is never
    queued.
    """
    seen: dict[int, Any] = {}
    todo = roots
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen[id(node)] = node
        found = inner.get(id(node)) if inner else None
        groups = ((node, enumerate(node.next_functions)),) if found is None else found[1]
        for owner, edges in groups:
            if owner is not node:
                if id(owner) in seen:   # its edges were examined: all it leads to is covered
                    continue
                seen[id(owner)] = owner
            slots: list | None = None
            exits: list | None = None
            for edge in edges:
                slot, (child, output_nr) = edge
                if child is None:
                    continue
                if type(child) is _ACCUMULATE_GRAD:  # a leaf: it has no inputs to walk into
                    arg = targets.get(("leaf", id(child.variable))) if leaf_inputs else None
                else:
                    arg = targets.get((id(child), output_nr))
                    if arg is None and child._sequence_nr() >= first:
                        todo.append(child)
                        continue
                if frontier is not None:
                    if exits is None:
                        exits = []
                    exits.append(edge)
                if arg is not None:
                    if slots is None:
                        slots = []
                    slots.append((slot, keys[arg], None))
            if exits is not None:
                frontier.append((owner, exits))
            if slots is not None and id(owner) not in boundary:
                boundary[id(owner)] = (owner, slots)


def _slots(modules: Sequence[tuple[str, nn.Module]], owned: dict[str, _Owned]) -> dict[str, _Slot]:
    """Each hooked module's slot: its own tensors, and the owners under it with their names
    relative to it (whichever called ancestor's first call ends first takes them)."""
    slots = {path: _Slot(owned.get(path)) for path, _ in modules}
    below: dict[str, list[tuple[str, str]]] = {}
    for owner in owned:
        if owner == schema.ROOT_MODULE:
            continue
        parts = owner.split(".")
        for depth in range(len(parts) - 1, -1, -1):  # its ancestors, nearest first
            ancestor = ".".join(parts[:depth]) or schema.ROOT_MODULE
            if ancestor in slots:
                below.setdefault(ancestor, []).append((owner, ".".join(parts[depth:]) + "."))
    for ancestor, owners in below.items():
        slots[ancestor].below = tuple(owners)
    return slots


def call_arguments(args: tuple, kwargs: dict) -> Iterator[tuple[str, Any]]:
    """(argument path, leaf) pairs of a call's arguments, as capture records them: ``0``,
    ``1.0``, ``1.1``, ``mask`` for ``layer(x, (h, c), mask=m)``."""
    for i, value in enumerate(args):
        yield from flatten(value, str(i))
    for key, value in kwargs.items():
        yield from flatten(value, key)
