"""What the mapping tools (``map-check``, ``map-suggest``) and replay need of a Flax NNX port,
beside what :mod:`layerdiff.flax.weights` gives (names, shapes and a variable set): its module
paths and their classes, its state that is not a parameter (torch's buffers), its tied
variables, its variables saved and put back, its case's forward run with every submodule call
seen, and any array a port function returns (numpy, JAX or torch) as the JAX array an NNX
module takes. :mod:`layerdiff.replay.ports` chooses these or torch's from the case.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.case import Case, seed_everything
from layerdiff.flax.graph import ModelGraph
from layerdiff.flax.intercept import intercepted
from layerdiff.flax.weights import _aliases, nnx_variables

# hook(module path, class name, run, args, kwargs) -> what run(*args, **kwargs) returns
Hook = Callable[[str, str, Callable[..., Any], tuple, dict], Any]


def module_paths(model: nnx.Module) -> dict[str, str]:
    """Module path (``block.fc1``, ``<root>``) -> its class name, in torch's order."""
    return {path: type(module).__name__ for path, module in ModelGraph.of(model).modules}


def state_names(model: nnx.Module) -> set[str]:
    """The variables that are state, not parameters (a BatchNorm's ``mean``): the port's
    buffers."""
    return {name for name, variable in nnx_variables(model).items()
            if not isinstance(variable, nnx.Param)}


def tied_names(model: nnx.Module) -> list[list[str]]:
    """Each tied variable's names, the one the state lists first."""
    variables = nnx_variables(model)
    return [[first, *(n for n in names if n != first)]
            for first, names in _aliases(ModelGraph.of(model), variables).items()]


@contextlib.contextmanager
def restored(model: nnx.Module) -> Iterator[None]:
    """Every variable of ``model`` put back as it was when the block ends (JAX arrays are
    immutable: keeping them is the copy)."""
    saved = {name: variable.get_value() for name, variable in nnx_variables(model).items()}
    try:
        yield
    finally:
        variables = nnx_variables(model)
        for name, value in saved.items():
            variables[name].set_value(value)


class _Watcher:
    def __init__(self, names: dict[int, str], hook: Hook) -> None:
        self.names, self.hook = names, hook

    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any:
        path = self.names.get(id(module))
        if path is None:
            return original(module, *args, **kwargs)
        return self.hook(path, type(module).__name__, types.MethodType(original, module),
                         args, kwargs)


def watched_forward(case: Case, hook: Hook) -> Any:
    """The case's forward run once on the model itself (seeded as capture seeds it; matmuls
    at full float32), every submodule call (the model's too) going through ``hook``. The
    model's variables are put back afterwards (a BatchNorm in training mode moves its
    statistics)."""
    graph = ModelGraph.of(case.model)
    names = {id(module): path for path, module in graph.modules}
    inputs = jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v,
                          case.inputs)
    seed_everything(case.seed)
    with restored(case.model), jax.default_matmul_precision("float32"), intercepted(
            [module for _, module in graph.modules], _Watcher(names, hook)):
        return case.model(**inputs) if isinstance(inputs, dict) else case.model(*inputs)


def is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def to_numpy(value: Any) -> np.ndarray:
    """A JAX or numpy array as numpy (bfloat16 widened to float32, which numpy stores)."""
    array = np.asarray(value)
    return array.astype(np.float32) if array.dtype == jnp.bfloat16 else array


def as_jax(value: Any) -> Any:
    """What a port function returns (a call adapter's ``(args, kwargs)``), its arrays as JAX
    arrays whatever made them: numpy, JAX (kept, traced ones too) or torch (detached, through
    the CPU). Tuples, lists and dicts keep their structure; other values stay as they are."""
    if isinstance(value, jax.Array):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, np.str_):
        return jnp.asarray(value)
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        tensor = value.detach().cpu()
        if str(tensor.dtype) == "torch.bfloat16":
            return jnp.asarray(tensor.float().numpy(), dtype=jnp.bfloat16)
        return jnp.asarray(tensor.numpy())
    if isinstance(value, (tuple, list)):
        items = [as_jax(item) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: as_jax(item) for key, item in value.items()}
    return value
