"""Trace format v1: the names and types that make the contract (see docs/trace-format.md).

No torch here: a writer in any framework, and a reader in CI, need h5py and numpy alone.
"""

from __future__ import annotations

import re
from enum import StrEnum

import numpy as np

FORMAT_NAME = "layerdiff-trace"
FORMAT_VERSION = 1

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
    "digest": STR,                   # xxh3-64 hex of the raw C-order bytes; '' if not computed
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
