"""Where a Flax NNX port reads each parameter outside every module call whose replay makes
its gradient: the counterpart of :mod:`layerdiff.replay.uses` for NNX ports.

The reference records a parameter's gradient once a step, as a total over every use. Replay
sums, for each variable, what the replayed calls make of it (``flax/replay.py``): a
module's call makes the gradient of a variable it reaches unless the variable lies under a
submodule that call called (:func:`layerdiff.flax.graph.under_called`: then that submodule's
calls make it). A tied head ``self.tok.attend(x)`` in the root's own code reads ``tok``'s
embedding in no call of ``tok``, and in a root call that called ``tok``: no replayed call
makes that part of the total. (A head module holding the same ``nnx.Embed`` and calling
``attend`` from its own ``__call__`` does make it: it is a site, as torch's tied ``lm_head``.)

Found from one forward of the case, every module call seen (:func:`watched_forward`) and
every read of a variable's value seen (:func:`layerdiff.flax.intercept.reads_seen`) with the
stack of calls it happens in; a read that no call on that stack makes is used outside, at the
innermost call's module (the code that reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flax import nnx

from layerdiff.case import Case
from layerdiff.flax.graph import ModelGraph, under_called
from layerdiff.flax.intercept import reads_seen
from layerdiff.flax.port import watched_forward


@dataclass
class _Frame:
    """One module call in progress: the module, its name, the modules it has called."""

    module: nnx.Module
    name: str
    called: set[int] = field(default_factory=set)


class _Watch:
    def __init__(self, model: nnx.Module) -> None:
        self.modules = {path: module for path, module in ModelGraph.of(model).modules}
        self.params = {id(node) for _, node in nnx.iter_graph(model)
                       if isinstance(node, nnx.Param)}
        self.stack: list[_Frame] = []
        self.reads: list[tuple[int, tuple[_Frame, ...]]] = []
        self._paths: dict[int, tuple[dict[int, tuple], dict[int, tuple]]] = {}

    def hook(self, path: str, _type: str, run: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        module = self.modules[path]
        for frame in self.stack:
            frame.called.add(id(module))
        self.stack.append(_Frame(module, path))
        try:
            return run(*args, **kwargs)
        finally:
            self.stack.pop()

    def read(self, variable: nnx.Variable) -> None:
        if self.stack and id(variable) in self.params:
            self.reads.append((id(variable), tuple(self.stack)))

    def makes(self, frame: _Frame, variable: int) -> bool:
        """Whether replaying ``frame``'s call makes the gradient of a read of ``variable``
        within it (flax_replay's rule: reached, and not under a submodule it called)."""
        key = id(frame.module)
        if key not in self._paths:
            nodes = list(nnx.iter_graph(frame.module))
            self._paths[key] = ({id(node): tuple(path) for path, node in nodes
                                 if isinstance(node, nnx.Variable)},
                                {id(node): tuple(path) for path, node in nodes
                                 if isinstance(node, nnx.Module)})
        variables, modules = self._paths[key]
        path = variables.get(variable)
        if path is None:
            return False
        return not under_called(path, {modules[m] for m in frame.called if m in modules})

    def outside(self) -> dict[int, list[str]]:
        found: dict[int, list[str]] = {}
        for variable, frames in self.reads:
            if any(self.makes(frame, variable) for frame in frames):
                continue
            where = found.setdefault(variable, [])
            if frames[-1].name not in where:
                where.append(frames[-1].name)
        return found


def outside_reads(case: Case) -> dict[int, list[str]]:
    """Parameter of ``case.model`` (by ``id`` of its ``nnx.Param``) -> the module paths whose
    own code reads it where no call on the stack makes its gradient, from one forward of the
    case (seeded; the model's variables put back)."""
    watch = _Watch(case.model)
    with reads_seen(watch):
        watched_forward(case, watch.hook)
    return watch.outside()
