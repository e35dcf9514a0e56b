"""Trace format v1: the names and types that make the contract (see docs/trace-format.md).

No torch here: a writer in any framework, and a reader in CI, need h5py and numpy alone.
"""

from __future__ import annotations

import json
import math
import re
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.errors import TraceError
from layerdiff.trace.digest import DIGEST_NAME, LEGACY_DIGEST

FORMAT_NAME = "layerdiff-trace"
FORMAT_VERSION = 2  # 2: the digest column follows meta tensor_digest (v1: xxh3-64)

# Root attributes.
ATTR_FORMAT = "layerdiff_format"
ATTR_VERSION = "layerdiff_version"
ATTR_COMPLETE = "complete"
ATTR_SUMMARY = "summary"
ATTR_META = "meta"  # one JSON string: producer, case, versions, options
# xxh3-64 of each table's values (trace.stats.table_digest), set at close; optional: traces
# written before them, or by other writers, have none
ATTR_TABLE_DIGEST = "{table}_digest"
ATTR_META_DIGEST = "meta_digest"  # xxh3-64 of the meta attribute's UTF-8 text, set at close

INDEX_GROUP = "index"
SITES_GROUP = "sites"
TENSORS_GROUP = "tensors"

PARTIAL_SUFFIX = ".partial"

class Role(StrEnum):
    """What a tensor is to its site."""

    INPUT = "input"
    OUTPUT = "output"
    GRAD_OUTPUT = "grad_output"    # the gradient arriving at an output
    GRAD_INPUT = "grad_input"      # the gradient the site sends back to an input
    WEIGHT = "weight"
    WEIGHT_GRAD = "weight_grad"


class Pass(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"


ROLES = tuple(Role)
PASSES = tuple(Pass)
# The gradients: a trace captured with --loss-scale holds them multiplied by its loss scale.
GRAD_ROLES = (Role.GRAD_OUTPUT, Role.GRAD_INPUT, Role.WEIGHT_GRAD)
# A parameter and its gradient: recorded per parameter name, not per call argument.
PARAM_ROLES = (Role.WEIGHT, Role.WEIGHT_GRAD)
# What arrives at a site's arguments (its input, and the gradient it sends back to them).
ARGUMENT_ROLES = (Role.INPUT, Role.GRAD_INPUT)
# What a site computes from what came in, in each pass: its output, the gradient it sends back.
RESULT_ROLES = (Role.OUTPUT, Role.GRAD_INPUT)
# What a site computes itself: its results and its parameters' gradients.
COMPUTED_ROLES = (Role.OUTPUT, Role.GRAD_INPUT, Role.WEIGHT_GRAD)
# What a site computes in the backward pass: the gradients it sends back and its parameters'.
COMPUTED_GRAD_ROLES = (Role.GRAD_INPUT, Role.WEIGHT_GRAD)
# The forward pass's records: what comes into a site, what it computes, its parameters.
FORWARD_ROLES = (Role.INPUT, Role.OUTPUT, Role.WEIGHT)
# A forward call's own values, without its parameters: what goes in and what comes out.
CALL_ROLES = (Role.INPUT, Role.OUTPUT)
# The pass each role belongs to.
ROLE_PASS = {
    Role.INPUT: Pass.FORWARD,
    Role.OUTPUT: Pass.FORWARD,
    Role.WEIGHT: Pass.FORWARD,
    Role.GRAD_OUTPUT: Pass.BACKWARD,
    Role.GRAD_INPUT: Pass.BACKWARD,
    Role.WEIGHT_GRAD: Pass.BACKWARD,
}
KINDS = ("tensor", "value")

# Tensors in a segment start at multiples of this many bytes, so any dtype can be viewed in place.
ALIGN = 64

STR = "str"
# Index table: one row per stored tensor or non-tensor value, in order of recording.
INDEX_COLUMNS: dict[str, str | np.dtype] = {
    "seq": np.dtype(np.int64),       # order of recording (execution order, backward included)
    "step": np.dtype(np.int32),      # training step, from 0
    "pass": STR,                     # forward | backward
    "site": STR,                     # module path + '#' + call number within the step
    "role": STR,                     # one of ROLES
    "arg": STR,                      # argument path: '0', '1.0', 'mask', or a parameter name
    "kind": STR,                     # tensor | value
    "dtype": STR,                    # torch-style name: float32, bfloat16, int64, bool ...
    "shape": STR,                    # comma-separated sizes; '' for a 0-d tensor
    "numel": np.dtype(np.int64),
    "segment": np.dtype(np.int32),   # tensors/<segment>; -1 when no data is stored
    "offset": np.dtype(np.int64),    # byte offset inside the segment
    "nbytes": np.dtype(np.int64),
    "min": np.dtype(np.float64),
    "max": np.dtype(np.float64),
    "mean": np.dtype(np.float64),
    "std": np.dtype(np.float64),
    "l2": np.dtype(np.float64),
    "nan": np.dtype(np.int64),
    "inf": np.dtype(np.int64),
    "digest": STR,                   # the tensor digest (meta tensor_digest), 16 hex; '' if none
    "value": STR,                    # kind == value: JSON of the value (or its repr)
}

# Sites table: one row per module call per step.
SITES_COLUMNS: dict[str, str | np.dtype] = {
    "step": np.dtype(np.int32),
    "site": STR,
    "module": STR,                   # module path ('<root>' for the model itself)
    "call": np.dtype(np.int32),      # call number of this module within the step
    "type": STR,                     # class name of the module
    "parent": STR,                   # enclosing site at call time; '' for the outermost
    "enter_seq": np.dtype(np.int64),  # seq counter when the call began
    "exit_seq": np.dtype(np.int64),   # seq counter when its forward returned (-1 if it did not)
}

ROOT_MODULE = "<root>"
LOSS_SITE = "<loss>#0"

# Names for dtypes numpy lacks: stored as raw bits of the same width.
RAW_BITS_DTYPES = {"bfloat16": np.dtype(np.uint16)}
# float8 and other exotic dtypes are stored as raw bytes under their torch name.


def segment_name(number: int) -> str:
    """The dataset that holds tensor segment ``number``: ``tensors/000042``."""
    return f"{TENSORS_GROUP}/{number:06d}"


def site_name(module_path: str, call: int) -> str:
    return f"{module_path}#{call}"


def split_site(site: str) -> tuple[str, int]:
    module, _, call = site.rpartition("#")
    return module, int(call)


# An op site is one tensor operation inside a module call's own code: <module site>/<op>#<k>,
# the k-th call of that op name in that call (blocks.0.attn#0/softmax#0). Its sites-table row
# has the module site as parent and the op name as type.
_OP_SITE = re.compile(r"^(.+#[0-9]+)/([^/#]+)#([0-9]+)$")


def op_site_name(module_site: str, op: str, k: int) -> str:
    return f"{module_site}/{op}#{k}"


def split_op_site(site: str) -> tuple[str, str, int] | None:
    """(module site, op name, k) of an op site; None for a module site."""
    found = _OP_SITE.match(site)
    return None if found is None else (found[1], found[2], int(found[3]))


def is_op_site(site: str) -> bool:
    return _OP_SITE.match(site) is not None


# What a reader accepts before it trusts a table (see layerdiff.trace.verify): a site is
# ``module#call``, a shape is comma-separated sizes, and no tensor is larger than this.
SITE_PATTERN = r"^.+#[0-9]{1,9}$"
SHAPE_PATTERN = r"^([0-9]{1,15}(,[0-9]{1,15}){0,63})?$"
MAX_NUMEL = 1 << 48        # elements of one tensor (256 Ti): beyond, a shape is damage
# torch dtypes numpy lacks, stored as raw bytes of this width (float8 and kin)
RAW_BYTE_DTYPES = frozenset({"float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                             "float8_e5m2fnuz", "float8_e8m0fnu"})
_NUMPY_KINDS = "biufc"  # bool, signed, unsigned, float, complex: what a tensor can hold


def known_dtype(name: str) -> bool:
    """Whether ``name`` is a tensor dtype a trace may hold (numeric numpy names in their
    canonical spelling, bfloat16 and the float8 family)."""
    if name in RAW_BITS_DTYPES or name in RAW_BYTE_DTYPES:
        return True
    try:
        dtype = np.dtype(name)
    except (TypeError, ValueError):
        return False
    return dtype.kind in _NUMPY_KINDS and dtype.name == name


def param_name(site: str, arg: str) -> str:
    """Full parameter name of a weight record: module path + '.' + argument."""
    module = split_site(site)[0]
    return arg if module == ROOT_MODULE else f"{module}.{arg}"


def format_shape(shape: tuple[int, ...]) -> str:
    return ",".join(str(int(s)) for s in shape)


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",")) if text else ()


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype that holds a stored tensor's bytes (raw bits for bfloat16, raw bytes
    for dtypes numpy lacks). Readers check names with :func:`known_dtype` first."""
    if name in RAW_BITS_DTYPES:
        return RAW_BITS_DTYPES[name]
    try:
        return np.dtype(name)
    except (TypeError, ValueError):
        return np.dtype(np.uint8)


def bfloat16_to_float32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 numbers from their stored bits (uint16): the top half of a float32, exactly."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# meta is small (a few KiB): bounds that no writer reaches and that keep json.loads bounded
_META_BYTES = 1 << 20
_META_DEPTH = 32
# meta keys readers use, and the types they may have (other keys are free)
_META_TYPES: dict[str, tuple[type, ...]] = {
    "producer": (str,), "case": (str,), "device": (str,), "created": (str,), "host": (str,),
    "versions": (dict,), "seed": (int, type(None)), "steps": (int,),
    "dtype": (str, type(None)), "autocast": (str, type(None)), "model_dtype": (str, type(None)),
    "default_dtype": (str, type(None)), "weights": (dict, type(None)),
    "signatures": (dict,), "shared_parameters": (list, type(None)), "include": (list,),
    "exclude": (list,), "summary": (bool,), "tensor_digest": (str,),
}
# a loss scale multiplies gradients; beyond these, float32 gradients under- or overflow
LOSS_SCALE_RANGE = (1e-30, 1e30)


def parse_meta(text: Any, path: Path) -> dict[str, Any]:
    """The meta attribute as a dict, refused (TraceError) when it is not JSON text of bounded
    size and depth, or a key readers use has the wrong type."""
    def refuse(what: str) -> TraceError:
        return TraceError(f"{path}: its meta attribute {what}; the file is damaged, capture "
                          "it again")

    if text is None:
        raise refuse("is missing (every writer records one)")
    if not isinstance(text, str):
        raise refuse(f"is {type(text).__name__}, not JSON text")
    if len(text) > _META_BYTES:
        raise refuse(f"is {len(text):,} characters long, far beyond any writer's")
    if _json_depth(text) > _META_DEPTH:
        raise refuse(f"nests deeper than {_META_DEPTH} levels")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, an integer of 5,000 digits
        raise refuse(f"is not valid JSON ({str(exc)[:80]})") from exc
    if not isinstance(meta, dict):
        raise refuse("is not a JSON object")
    for key, types in _META_TYPES.items():
        if key in meta and (not isinstance(meta[key], types)
                            or (isinstance(meta[key], bool) and bool not in types)):
            raise refuse(f"has {key} {meta[key]!r:.40}, of the wrong type")
    algorithm = meta.get("tensor_digest", LEGACY_DIGEST)
    if algorithm not in (DIGEST_NAME, LEGACY_DIGEST):
        raise TraceError(f"{path}: its tensor digests are {algorithm!r:.40}, which this version "
                         "of layerdiff does not know; read it with the layerdiff that wrote it "
                         "(or a newer one)")
    scale = meta.get("loss_scale", 1.0)
    number = (float(scale) if isinstance(scale, float) or (
        isinstance(scale, int) and not isinstance(scale, bool) and abs(scale) < 1 << 128)
        else math.nan)  # an integer of 400 digits does not convert
    if not (math.isfinite(number) and LOSS_SCALE_RANGE[0] <= number <= LOSS_SCALE_RANGE[1]):
        raise TraceError(f"{path}: its loss scale {scale!r:.40} is not a finite number between "
                         f"{LOSS_SCALE_RANGE[0]:g} and {LOSS_SCALE_RANGE[1]:g}; the file is "
                         "damaged, capture it again")
    versions = meta.get("versions", {})
    if not all(isinstance(v, str) for v in versions.values()):
        raise refuse("has versions that are not text")
    weights = meta.get("weights") or {}
    mapping = weights.get("mapping")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            isinstance(mapping.get(k), str) for k in ("name", "text"))):
        raise refuse("records a mapping that is not {name, text}")
    return meta


def _json_depth(text: str) -> int:
    """How deep JSON text nests (brackets outside strings), without recursion."""
    if text.count("[") + text.count("{") <= _META_DEPTH:
        return 0  # cannot nest deeper than it has brackets
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > _META_DEPTH:
                return deepest
        elif char in "]}":
            depth -= 1
    return deepest
