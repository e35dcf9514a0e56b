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
    shared: list[dict[str, Any]]

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
        return cls(modules, owned, [])

    def full_name(self, owner: str, name: str) -> str:
        return schema.param_name(schema.site_name(owner, 0), name)
