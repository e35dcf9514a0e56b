"""Mappings: how a port's site and parameter names correspond to the reference's.

One mapping serves the diff (pairing sites), ``capture --weights-from`` and ``load_weights``
(moving weights) and replay/swap (arguments and parameters). Pure Python: no torch, numpy or
h5py, and nothing of the other layerdiff stages. The file format is described in
:mod:`layerdiff.mapping.rules`.
"""

from layerdiff.mapping.code import CodeRef, is_code
from layerdiff.mapping.params import TRANSFORMS, ParamSource, PartView, Slice
from layerdiff.mapping.pattern import Pattern
from layerdiff.mapping.rules import (
    Mapping,
    OutputConversion,
    ParamRule,
    ShardRule,
    SiteRule,
    UnmatchedRecord,
)

__all__ = ["TRANSFORMS", "CodeRef", "Mapping", "OutputConversion", "ParamRule", "ParamSource",
           "PartView", "Pattern", "ShardRule", "SiteRule", "Slice", "UnmatchedRecord",
           "is_code"]
