"""A Flax NNX model's structure as layerdiff names it: module paths like torch's
(``blocks.0.attn``, ``<root>`` for the model), and the variables each module records as its
own (``kernel`` at ``blocks.0.attn.qkv``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flax import nnx

from layerdiff.trace import schema


def path_name(path: tuple[Any, ...]) -> str:
    """``("blocks", 0, "attn")`` -> ``"blocks.0.attn"``; the model itself is ``<root>``."""
    return ".".join(str(key) for key in path) or schema.ROOT_MODULE


def registration_paths(model: nnx.Module) -> dict[int, tuple[Any, ...]]:
    """Each module's and variable's path as torch's ``named_modules`` would name it: depth
    first, parents before children, children in the order the code set them (NNX's own
    traversal sorts attribute names), a node reachable by several paths (a tied embedding)
    under the first; keyed by ``id``, in that order."""
    paths: dict[int, tuple[Any, ...]] = {}

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        paths[id(node)] = path
        if isinstance(node, nnx.Variable):
            return
        children = list(nnx.graph.iter_children(node))
        keys = list(vars(node)) if hasattr(node, "__dict__") else []
        children.sort(key=lambda item: keys.index(item[0]) if item[0] in keys else len(keys))
        for key, child in children:
            if id(child) not in paths:
                walk(child, (*path, key))

    walk(model, ())
    return paths


def under_called(path: tuple[Any, ...], called: set[tuple[Any, ...]]) -> bool:
    """Whether a variable at ``path`` in a module's state (``nnx.iter_graph``'s) lies under a
    submodule whose ``__call__`` ran during the module's call (``called``: their paths there).
    Then that submodule's calls make the variable's gradient, not the module's own code: the
    one rule by which replay sums a variable's gradient (``flax/replay.py``) and by
    which a read of it is found outside every call that makes it (``flax/reads.py``)."""
    return any(path[:depth] in called for depth in range(1, len(path)))


@dataclass(frozen=True)
class Owned:
    """One variable a module records: its name under the module (``kernel``, ``rngs.key``
    never: random state is not a weight), its path in the model's state, and whether it is a
    parameter (a weight gradient is recorded) or state (BatchNorm's ``mean``: a buffer)."""

    name: str
    state_path: tuple[Any, ...]
    param: bool


@dataclass
class ModelGraph:
    """The modules of one NNX model (path, module) in torch's order, and each module's own
    variables. A variable reachable by several paths (tied) belongs to the first module."""

    modules: list[tuple[str, nnx.Module]]
    owned: dict[str, list[Owned]]
    # variables reachable by several paths (tied): (the path recorded, every full name)
    shared: list[tuple[tuple[Any, ...], list[str]]]
    # each module's name by its path in NNX's own traversal, which a copy of the model
    # (nnx.merge) shares while the copy's attribute order, hence registration_paths, is lost
    names: dict[tuple[Any, ...], str]

    @classmethod
    def of(cls, model: nnx.Module) -> ModelGraph:
        named = registration_paths(model)
        order = {key: i for i, key in enumerate(named)}
        # iter_graph's path of a variable is its key in nnx.state; its name is torch's
        nodes = sorted(nnx.iter_graph(model), key=lambda item: order.get(id(item[1]), -1))
        modules = [(path_name(named[id(node)]), node) for _, node in nodes
                   if isinstance(node, nnx.Module)]
        module_paths = {name for name, _ in modules}
        owned: dict[str, list[Owned]] = {}
        for state_path, node in nodes:
            if not isinstance(node, nnx.Variable) or isinstance(node, nnx.RngState):
                continue
            path = named[id(node)]
            # the nearest module above it owns it; the rest of the path is its name there
            for depth in range(len(path) - 1, -1, -1):
                owner = path_name(path[:depth])
                if owner in module_paths:
                    break
            name = ".".join(str(key) for key in path[depth:])
            owned.setdefault(owner, []).append(
                Owned(name, tuple(state_path), isinstance(node, nnx.Param)))
        # each module's variables in the order its code set them (Linear: kernel, then bias),
        # as torch records a module's parameters in registration order
        by_path = dict(modules)
        for owner, variables in owned.items():
            keys = list(vars(by_path[owner]))
            variables.sort(key=lambda v: keys.index(v.name.split(".")[0])
                           if v.name.split(".")[0] in keys else len(keys))
        names = {tuple(path): path_name(named[id(node)]) for path, node in nodes
                 if isinstance(node, nnx.Module)}
        return cls(modules, owned, _tied(model, nodes), names)

    def module_names(self, copy: nnx.Module) -> dict[int, str]:
        """``id`` -> name of each module of a copy of the model (nnx.merge of its split)."""
        return {id(node): self.names[tuple(path)] for path, node in nnx.iter_graph(copy)
                if isinstance(node, nnx.Module) and tuple(path) in self.names}

    def shared_parameters(self, selected: set[str]) -> list[dict[str, Any]]:
        """The trace meta's ``shared_parameters``: each tied variable's recorded full name
        (None when no selected module records it) and every name it goes by."""
        recorded = {variable.state_path: schema.param_name(schema.site_name(owner, 0),
                                                           variable.name)
                    for owner, variables in self.owned.items() if owner in selected
                    for variable in variables}
        return [{"name": recorded.get(path), "users": users} for path, users in self.shared]


def _tied(model: nnx.Module, nodes: list[tuple[tuple[Any, ...], Any]]) -> list[
        tuple[tuple[Any, ...], list[str]]]:
    """Variables that several paths reach (``head.kernel = embed.embedding``): iter_graph
    gives each once, at its first path; a walk of every edge finds the others."""
    first = {id(node): tuple(path) for path, node in nodes if isinstance(node, nnx.Variable)}
    users: dict[int, list[str]] = {}
    walking: set[int] = set()

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        walking.add(id(node))
        for key, child in nnx.graph.iter_children(node):
            if isinstance(child, nnx.Variable):
                users.setdefault(id(child), []).append(path_name((*path, key)))
            elif id(child) not in walking:  # a cycle of references is walked once
                walk(child, (*path, key))
        walking.discard(id(node))

    walk(model, ())
    return [(first[key], sorted(set(names))) for key, names in users.items()
            if len(set(names)) > 1 and key in first]
