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


def _order(path: tuple[Any, ...]) -> tuple:
    # depth first, parents before children, list items by number: torch's named_modules order
    return tuple((0, key, "") if isinstance(key, int) else (1, 0, str(key)) for key in path)


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

    @classmethod
    def of(cls, model: nnx.Module) -> ModelGraph:
        nodes = sorted(nnx.iter_graph(model), key=lambda item: _order(item[0]))
        modules = [(path_name(path), node) for path, node in nodes
                   if isinstance(node, nnx.Module)]
        module_paths = {name for name, _ in modules}
        owned: dict[str, list[Owned]] = {}
        for path, node in nodes:
            if not isinstance(node, nnx.Variable) or isinstance(node, nnx.RngState):
                continue
            # the nearest module above it owns it; the rest of the path is its name there
            for depth in range(len(path) - 1, -1, -1):
                owner = path_name(path[:depth])
                if owner in module_paths:
                    break
            name = ".".join(str(key) for key in path[depth:])
            owned.setdefault(owner, []).append(
                Owned(name, tuple(path), isinstance(node, nnx.Param)))
        # each module's variables in the order its code set them (Linear: kernel, then bias),
        # as torch records a module's parameters in registration order
        by_path = dict(modules)
        for owner, variables in owned.items():
            keys = list(vars(by_path[owner]))
            depth = 0 if owner == schema.ROOT_MODULE else owner.count(".") + 1
            variables.sort(key=lambda v: keys.index(v.state_path[depth])
                           if v.state_path[depth] in keys else len(keys))
        return cls(modules, owned, _tied(model, nodes))

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
