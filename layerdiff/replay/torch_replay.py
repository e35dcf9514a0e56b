"""Replaying calls into a torch port's modules.

Each call gets the reference's recorded inputs (fresh leaf tensors, cloned before the call so
an in-place layer cannot touch them) and, for its backward, the reference's recorded output
gradients, through ``torch.autograd.grad`` so nothing accumulates into ``.grad``: a container's
replay does not add to its children's weight gradients. Buffers (batch-norm statistics) are
put back after each call. The recorded arguments are fitted to the port layer's own signature
(``calling.bind_call``: arguments it has no parameter for are not taken, left out and listed),
or, where the mapping names a call adapter for the site, handed to the adapter as the
reference passed them, whose ``(args, kwargs)`` make the port's call (gradients flow through
it to the reference's arguments). The inputs are recorded under the reference's names (mapped
by the site's ``args``), as the diff pairs them, and so are the input gradients. A call is run
twice from different random seeds: a layer whose output changes draws random numbers (dropout)
and cannot be replayed exactly, so it is skipped, saying why. NaN at the same places in both
runs is no change, and an output with a NaN or an Inf is never taken for randomness: it is
judged (a non-finite value where the reference's is finite fails).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

import layerdiff.rng as rng
from layerdiff.capture.hooks import flatten
from layerdiff.capture.modules import named_modules
from layerdiff.capture.routes import Forced, RouteForcer
from layerdiff.capture.stage import unsupported_tensor
from layerdiff.compare.shapes import as_shape
from layerdiff.errors import DiffError
from layerdiff.mapping.code import CodeRef
from layerdiff.replay.alone import ReferenceAlone, as_like, split_outside
from layerdiff.replay.calling import BoundCall, Signature, adapted_call, bind_call
from layerdiff.replay.recorded import (
    RecordedCall,
    grad_outputs_at_port,
    read_array,
    read_value,
)
from layerdiff.replay.uses import outside_uses
from layerdiff.trace import Trace, TraceWriter, schema
from layerdiff.trace.arguments import (
    NotPlainData,
    dropped_arguments,
    map_argument,
    rebuild_call,
    recorded_value,
)
from layerdiff.trace.routers import Route
from layerdiff.trace.schema import Pass, Role

TORCH_DTYPES = {"bfloat16": torch.bfloat16}

Caller = Callable[[list[tuple[str, Any]]], tuple[tuple, dict[str, Any]]]  # values -> the call


class NotReplayable(Exception):
    """A call that cannot be replayed exactly (it draws random numbers)."""


class TorchPort:
    """A torch port's modules, replayed one recorded call at a time."""

    def __init__(self, model: nn.Module, ref: Trace) -> None:
        self.modules = dict(named_modules(model))
        self.ref = ref
        self.device = next(model.parameters(), torch.empty(0)).device
        # the CUDA generator its layers draw from, seeded and restored around each call
        self._devices = [self.device.index or 0] if self.device.type == "cuda" else []
        self._weights_recorded: set[str] = set()
        # weight gradients summed per parameter over every call of every module holding it
        # (a tied embedding and head: one parameter, one gradient, as the reference records)
        self._holders: dict[int, list[tuple[str, str]]] = {}  # parameter -> (module, name)
        for name, held in self.modules.items():
            for local, param in held._parameters.items():
                if param is not None:
                    self._holders.setdefault(id(param), []).append((name, local))
        self._grad_sums: dict[int, torch.Tensor] = {}
        # parameter -> port modules whose own code uses it outside the calls of the modules
        # holding it (a tied head ``x @ self.tok.weight.T`` in the root): :meth:`watch_uses`
        self._outside: dict[int, list[str]] = {}
        self.set_aside: list[tuple[str, str]] = []  # (weight_grad, why): not compared
        # the reference case's modules replayed alone, to split such a recorded gradient
        self.reference_alone: ReferenceAlone | None = None
        # port parameter's full name -> the mapping's [[param]] source for it, if any
        self.param_source: Callable[[str], Any] = lambda name: None
        self._partner: dict[str, str] = {}  # port module -> the reference module it replayed
        self.notes: list[str] = []
        self._first_site: dict[str, str] = {}  # module -> its first replayed site
        self._port_signatures: dict[str, Signature | None] = {}
        self._ref_signatures: dict[str, Signature | None] = {}
        # a trace made before grad_output meant "from outside the call" holds everything that
        # reached each output, the layer's own later use of it included (docs/trace-format.md)
        self._grad_output_whole = ref.meta.get("grad_output") != "outside"
        # reference site -> (its output conversion, the function): the port layer's outputs
        # get the reference's gradient pulled back through it (compare/outconv.py)
        self.output_conversions: dict[str, tuple[Any, Callable[..., Any]]] = {}
        # reference site -> the mapping's outputs renames (reference output -> port output)
        self.output_renames: dict[str, dict[str, str]] = {}
        # replay --force-routing: the reference's routes of step 0 with their router calls'
        # (enter_seq, exit_seq); a replayed call takes those of the routers it holds
        self.routes: list[tuple[int, int, Route]] | None = None
        self.forced: list[Forced] = []

    def type_of(self, module: str) -> str:
        return type(self.modules[module]).__name__

    def watch_uses(self, model: nn.Module, call: Callable[[], Any]) -> None:
        """Find the parameters the port's code uses outside their own modules' calls, from
        one forward ``call()`` of the whole ``model`` (``uses.outside_uses``): a module's
        replay alone does not make that part of the reference's recorded gradient."""
        try:
            self._outside = outside_uses(model, self.modules, call, self._devices, restored)
        except Exception as exc:  # the replay goes on; the one thing unknown is said
            self.notes.append(f"could not look for parameters used outside their modules' "
                              f"calls (the port's forward raised {type(exc).__name__}: {exc}); "
                              "a weight gradient with such a use would differ from the "
                              "reference's recorded total")

    def replay(self, call: RecordedCall, site: str, args_map: dict[str, str],
               writer: TraceWriter, adapter: tuple[CodeRef, Callable[..., Any]] | None = None
               ) -> list[tuple[str, str]]:
        """Replay one call; returns the reference arguments left out of the port's call, and
        why (``calling.BoundCall.dropped``). ``adapter`` (the mapping's call adapter for the
        site and its function) makes the port's call from the reference's arguments."""
        module_name = schema.split_site(site)[0]
        module = self.modules[module_name]
        self._partner.setdefault(module_name, call.module)
        args_map = {} if adapter else args_map  # the adapter makes the whole call
        drop = dropped_arguments(args_map)
        values = self._inputs(call, args_map, drop)
        if adapter is None:
            bind = self._binder(call, module_name, drop)
            dropped = bind(values).dropped  # refuses a call the port cannot take, before work
            caller: Caller = lambda fresh: bind(fresh).call()  # noqa: E731
        else:
            caller = self._adapter_caller(adapter, module_name)
            dropped = [(arg, f"recorded as {value.type_name}, not plain data: the call adapter "
                             "gets None") for arg, value in values
                       if isinstance(value, NotPlainData)]
        left_out = {head for head, _ in dropped}
        for arg, value in values:
            if arg.partition(".")[0] not in left_out:  # the port took no such argument
                writer.record(site, Role.INPUT, _numpy(value), arg=arg)
        if module_name not in self._weights_recorded:
            self._weights_recorded.add(module_name)
            for tensors in (module._parameters, module._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None:
                        writer.record(site, Role.WEIGHT, self._weight(call, module_name, name,
                                                                      tensor),
                                      arg=name, pass_=Pass.FORWARD)
        wanted = {map_argument(a, args_map) for a in call.grad_input_args} - left_out
        leaves = {arg: value.detach().requires_grad_() for arg, value in values
                  if torch.is_tensor(value) and arg in wanted and value.is_floating_point()}
        leaves |= _shared_leaves(call, args_map, values, leaves)
        outputs = self._run_twice(module, values, leaves, caller, self._routes_in(call))
        flat = list(flatten(outputs, ""))
        for arg, value in flat:
            writer.record(site, Role.OUTPUT, _numpy(value), arg=arg)
        self._backward(call, site, module_name, module, flat, leaves, writer)
        return dropped

    def _weight(self, call: RecordedCall, module_name: str, name: str,
                tensor: torch.Tensor) -> Any:
        """A parameter or buffer as the trace records it (:meth:`_stored`)."""
        return self._stored(tensor, schema.site_name(call.module, 0), Role.WEIGHT, name,
                            schema.param_name(schema.site_name(module_name, 0), name))

    def _stored(self, tensor: torch.Tensor, ref_site: str, role: str, name: str,
                full: str) -> Any:
        """A weight or weight gradient as the trace records it. A tensor of any dtype (complex
        and bool too) is its numpy array; one whose layout has no numpy form (sparse: a
        buffer, an ``nn.Embedding(sparse=True)``'s gradient) is made dense where the
        reference recorded values at ``ref_site`` (``role``, ``name``), else recorded as
        capture records it (its layout, shape and dtype: compared as those), saying so."""
        if tensor.layout is torch.strided and not tensor.is_quantized:
            return _numpy(tensor)
        rows = self.ref.records(0, ref_site, role)
        recorded = rows[rows["arg"] == name]
        if (not recorded.empty and recorded.iloc[0]["kind"] == "tensor"
                and tensor.layout is not torch.strided):
            return _numpy(tensor.to_dense())
        kind = "quantized" if tensor.is_quantized else str(tensor.layout).removeprefix("torch.")
        what = "" if role == Role.WEIGHT else "'s gradient"
        self.notes.append(f"{full}{what} is {kind}: compared by layout, shape and dtype (all "
                          "the trace holds of it)")
        return unsupported_tensor(tensor)

    def inputs(self, call: RecordedCall, args_map: dict[str, str]) -> list[tuple[str, Any]]:
        """The reference's recorded inputs of ``call`` under the port's argument names."""
        return self._inputs(call, args_map, dropped_arguments(args_map))

    def outputs(self, call: RecordedCall, module_name: str, args_map: dict[str, str],
                values: list[tuple[str, Any]],
                adapter: tuple[CodeRef, Callable[..., Any]] | None = None) -> Any:
        """The port module's outputs on ``values`` (from :meth:`inputs`), called the way its
        own signature takes them, or through ``adapter`` (the site's call adapter and its
        function); what ``map-check`` measures."""
        if adapter is not None:
            caller = self._adapter_caller(adapter, module_name)
        else:
            bind = self._binder(call, module_name, dropped_arguments(args_map))
            caller = lambda fresh: bind(fresh).call()  # noqa: E731
        return self._run_twice(self.modules[module_name], values, {}, caller)

    def _binder(self, call: RecordedCall, module_name: str,
                drop: frozenset[str]) -> Callable[[list[tuple[str, Any]]], BoundCall]:
        """Fits (mapped argument, value) pairs to the port module's forward."""
        if module_name not in self._port_signatures:
            self._port_signatures[module_name] = Signature.of(self.modules[module_name].forward)
        port = self._port_signatures[module_name]
        reference = self._reference_signature(call.type)
        where = f"port layer {module_name}"
        return lambda values: bind_call(values, port, reference=reference, drop=drop,
                                        where=where)

    def _adapter_caller(self, adapter: tuple[CodeRef, Callable[..., Any]],
                        module_name: str) -> Caller:
        """The reference's arguments, rebuilt as they were passed (what capture could keep
        only as a repr is None), through the mapping's call adapter."""
        ref, function = adapter
        forward = self.modules[module_name].forward

        def caller(values: list[tuple[str, Any]]) -> tuple[tuple, dict[str, Any]]:
            args, kwargs = rebuild_call([(arg, None if isinstance(value, NotPlainData)
                                          else value) for arg, value in values])
            return adapted_call(ref, function, args, kwargs, forward,
                                where=f"port layer {module_name}")
        return caller

    def _reference_signature(self, type_name: str) -> Signature | None:
        """The reference module type's forward signature, as capture recorded it (traces
        written before capture recorded them have none)."""
        if type_name not in self._ref_signatures:
            where = f"{self.ref.path} meta 'signatures'"
            signatures = self.ref.meta.get("signatures", {})
            if not isinstance(signatures, dict):
                raise DiffError(f"{where} must be an object of module type name -> signature, "
                                f"got {type(signatures).__name__}; capture the reference again")
            data = signatures.get(type_name)
            self._ref_signatures[type_name] = None if data is None else Signature.from_json(
                data, f"{where} {type_name}")
        return self._ref_signatures[type_name]

    def _inputs(self, call: RecordedCall, args_map: dict[str, str],
                drop: frozenset[str]) -> list[tuple[str, Any]]:
        values, seen = [], set()
        for arg, row in call.inputs:
            port_arg = map_argument(arg, args_map)
            if port_arg in seen:  # attn(x, x, x) -> attn(x): one argument
                continue
            seen.add(port_arg)
            if port_arg.partition(".")[0] in drop:
                # not read: what the mapping drops may not be plain data (a cache object)
                values.append((port_arg, None))
                continue
            if row["kind"] == "tensor":
                value = torch.from_numpy(read_array(self.ref, row)).to(
                    self.device, TORCH_DTYPES.get(row["dtype"]))
            else:  # a cache object capture kept as a repr: it can be left out, not passed
                value = recorded_value(row["value"])
            values.append((port_arg, value))
        return values

    def _routes_in(self, call: RecordedCall) -> list[Route]:
        """The reference's routes of the router calls inside ``call`` (itself included)."""
        return [route for enter, leave, route in self.routes or ()
                if call.enter_seq <= enter and leave <= call.exit_seq]

    def _run_twice(self, module: nn.Module, values: list[tuple[str, Any]],
                   leaves: dict[str, torch.Tensor], caller: Caller,
                   routes: list[Route] = ()) -> Any:
        """The port layer's outputs (run again with another seed to refuse one that draws
        random numbers); ``routes`` are forced into its top-k calls, the first run's kept."""
        def call(seed: int) -> Any:
            fresh = [(a, leaves[a].clone() if a in leaves else (
                v.clone() if torch.is_tensor(v) else v)) for a, v in values]
            args, kwargs = caller(fresh)
            forcer = RouteForcer({0: list(routes)}) if routes else None
            with rng.seeded(seed, self._devices), restored(module.buffers()), \
                    forcer if forcer is not None else nullcontext():
                outputs = module(*args, **kwargs)
            if forcer is not None and seed == 1:
                self.forced += forcer.forced()
            return outputs

        outputs = call(1)
        with torch.no_grad():
            again = call(2)
        for (arg, a), (_, b) in zip(flatten(outputs, ""), flatten(again, ""), strict=True):
            # a NaN never equals itself: NaN at the same places is the same output, and an
            # output with NaN or Inf is judged whatever the second run gave (the judge fails
            # it where the reference is finite), never set aside as randomness
            if torch.is_tensor(a) and not _same(a.detach(), b) and _finite(a) and _finite(b):
                raise NotReplayable(f"output {arg} changes with the random seed (the layer "
                                    "draws random numbers, as dropout does)")
        return outputs

    def _backward(self, call: RecordedCall, site: str, module_name: str, module: nn.Module,
                  flat: list[tuple[str, Any]], leaves: dict[str, torch.Tensor],
                  writer: TraceWriter) -> None:
        converted, taken = self._converted_grads(call, site, flat)
        recorded = grad_outputs_at_port(call, flat, self.output_renames.get(call.site, {}))
        pairs = [(arg, value) for arg, value in flat if torch.is_tensor(value)
                 and value.requires_grad
                 and (arg in converted if arg in taken else arg in recorded)]
        if not pairs:
            return
        grads = []
        for arg, value in pairs:
            if arg in converted:  # the reference's gradient, in the port's layout
                grad = torch.from_numpy(converted[arg]).to(value.device, value.dtype)
                writer.record(site, Role.GRAD_OUTPUT, _numpy(grad), arg=arg)
            else:
                grad = read_value(self.ref, recorded[arg])
                writer.record(site, Role.GRAD_OUTPUT, grad, arg=arg)
                # a port output that holds the reference's elements in another shape ((T, D)
                # against (1, T, D)): the diff's rule (compare/shapes.py)
                grad = torch.from_numpy(as_shape(grad, value.shape)).to(value.device,
                                                                        value.dtype)
            grads.append(grad)
            # The recorded gradient is what arrived from outside the call: autograd adds the
            # layer's own later use of the output (an LSTM cell's c feeds its h). An older
            # trace's holds that use already: it replaces what arrives, not to count it twice.
            if self._grad_output_whole:
                value.register_hook(lambda _arrived, grad=grad: grad)
        params = [(n, p) for n, p in module._parameters.items()
                  if p is not None and p.requires_grad]
        targets = list(leaves.values()) + [p for _, p in params]
        if not targets:
            return
        results = torch.autograd.grad([v for _, v in pairs], targets, grads, allow_unused=True)
        for (arg, leaf), grad in zip(leaves.items(), results[:len(leaves)], strict=True):
            # an argument sharing an earlier one's leaf (attn(x, x, x)) has its gradient there
            if grad is not None and _first_with(leaves, leaf) == arg:
                writer.record(site, Role.GRAD_INPUT, _numpy(grad), arg=arg)
        self._first_site.setdefault(module_name, site)
        for (_, param), grad in zip(params, results[len(leaves):], strict=True):
            if grad is not None:
                key = id(param)
                self._grad_sums[key] = grad if key not in self._grad_sums else (
                    self._grad_sums[key] + grad)

    def _converted_grads(self, call: RecordedCall, site: str, flat: list[tuple[str, Any]]
                         ) -> tuple[dict[str, Any], set[str]]:
        """Where the site has an output conversion: the gradients its port outputs get (the
        reference's at the output the conversion gives, pulled back through it: numpy arrays
        by the port's output path), and the outputs it takes (fed nothing else)."""
        conversion = self.output_conversions.get(call.site)
        if conversion is None:
            return {}, set()
        conv, function = conversion
        values = dict(flat)
        taken = set(conv.takes)
        if conv.gives not in call.grad_outputs or any(t not in values for t in conv.takes):
            return {}, taken
        from layerdiff.compare.outconv import pull_back

        inputs = dict(call.inputs)
        constants = [read_value(self.ref, inputs[path])
                     for path in getattr(conv, "reference_inputs", ()) if path in inputs]
        pulled = pull_back(conv, function, [values[t] for t in conv.takes],
                           read_value(self.ref, call.grad_outputs[conv.gives]), where=site,
                           reference_inputs=constants)
        return {take: grad for take, grad in zip(conv.takes, pulled, strict=True)
                if grad is not None}, taken

    def finish(self, writer: TraceWriter, complete: set[str]) -> None:
        """Weight gradients, summed over the calls of every module holding the parameter as
        the reference records them, under the first of those modules; only where every such
        module is in ``complete`` (every call replayed), or the sums would differ."""
        for key, grad in self._grad_sums.items():
            holders = [(m, n) for m, n in self._holders[key] if m in self._first_site]
            if all(module in complete for module, _ in holders):
                module, name = holders[0]
                outside = self._outside.get(key)
                if outside:  # the recorded total holds a use that no replayed call makes
                    grad = self._split(grad, holders, outside)
                    if grad is None:
                        continue
                site = self._first_site[module]
                ref_site = schema.site_name(self._partner.get(module, module), 0)
                writer.record(site, Role.WEIGHT_GRAD, self._stored(
                    grad, ref_site, Role.WEIGHT_GRAD, name, schema.param_name(site, name)),
                    arg=name)

    def _split(self, grad: torch.Tensor, holders: list[tuple[str, str]],
               outside: list[str]) -> torch.Tensor | None:
        """The port's module-alone gradient of a parameter also used at ``outside`` (port
        modules' own code), made comparable with the reference's recorded total: plus the
        part of that total the reference's partner modules' calls alone do not make. None,
        set aside with its reason, where the reference case is not given or cannot split
        (:func:`layerdiff.replay.alone.split_outside`, the decision Flax replay shares)."""
        module, name = holders[0]
        site = self._first_site[module]
        full = schema.param_name(site, name)
        split = split_outside(full, sorted({m for m, _ in holders}), outside,
                              [self._partner[m] for m, _ in holders if m in self._partner],
                              tuple(grad.shape), self.reference_alone, self.param_source(full))
        if split.rest is None:
            self.set_aside.append((f"{site} weight_grad {name}", split.line))
            return None
        if grad.layout is not torch.strided:  # a sparse gradient: added densely
            grad = grad.to_dense()
        self.notes.append(split.line)
        return grad + as_like(split.rest, grad)

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """A parameter's weight gradient summed over the calls replayed so far."""
        return self._grad_sums.get(id(param))


def _shared_leaves(call: RecordedCall, args_map: dict[str, str],
                   values: list[tuple[str, Any]], leaves: dict[str, torch.Tensor]
                   ) -> dict[str, torch.Tensor]:
    """Arguments that were one tensor in the reference's call (``attn(x, x, x)``): the capture
    records that tensor's whole gradient once, under the first of them, and the same bytes again
    as the others' inputs with no gradient of their own. Those get the first one's leaf, so the
    replayed gradient sums over every use, as the recorded one does."""
    rows = {map_argument(arg, args_map): row for arg, row in call.inputs}
    shared = {}
    for arg, value in values:
        row = rows.get(arg)
        if arg in leaves or not torch.is_tensor(value) or row is None or not row["digest"]:
            continue
        first = next((other for other in leaves if rows.get(other) is not None
                      and rows[other]["digest"] == row["digest"]
                      and rows[other]["shape"] == row["shape"]
                      and rows[other]["dtype"] == row["dtype"]), None)
        if first is not None:
            shared[arg] = leaves[first]
    return shared


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN at the same places counting as equal."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        return False
    return torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)


def _finite(value: torch.Tensor) -> bool:
    return not (value.is_floating_point() or value.is_complex()) or bool(
        torch.isfinite(value).all())


def _first_with(leaves: dict[str, torch.Tensor], leaf: torch.Tensor) -> str:
    return next(arg for arg, other in leaves.items() if other is leaf)


def _numpy(value: Any) -> Any:
    if not torch.is_tensor(value):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()  # TraceWriter stores numpy dtypes; compared at bfloat16's tolerance
    return value.numpy()


@contextmanager
def restored(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """Put ``tensors`` back as they were, whatever happens in between (a call's batch-norm
    running statistics; map-check's trial loads)."""
    saved = [(tensor, tensor._version, tensor.detach().clone()) for tensor in tensors]
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, version, value in saved:
                # only what changed: a write bumps the version counter, and a buffer that
                # autograd saved for backward (a causal mask a masked_fill took) must keep it
                if tensor._version != version:
                    tensor.copy_(value)
