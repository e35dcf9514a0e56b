"""``CaptureOptions``: what a capture records and how, as one frozen object.

A capture's options used to travel as a dozen keyword arguments from the command line through
``capture_port`` and ``capture`` into each framework's capture, each floor copying the list and
some checking a part of it. Here they are checked once, when the object is made, and passed
whole; a framework says which it takes (:meth:`CaptureOptions.refuse`), and the trace's meta
records them from one place (:meth:`CaptureOptions.meta`).

    options = CaptureOptions(loss_scale=2**20, include=("blocks.*",))
    capture(case, "ref.h5", options)
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from layerdiff.errors import CaptureError
from layerdiff.trace.recorder import DEFAULT_QUEUE_BYTES

DTYPES = ("float64", "float32", "bfloat16", "float16")
# jax.default_matmul_precision's names; "default" leaves the framework's own (TF32 or bf16
# passes on accelerators). Torch runs float32 matmuls in float32 unless a model enables TF32.
MATMUL_PRECISIONS = ("float32", "tensorfloat32", "bfloat16", "highest", "high", "default")

# How each option is named to the user when a framework refuses it: its command-line flag,
# or its keyword where the command line has none.
FLAGS = {"include": "--include", "exclude": "--exclude", "loss_scale": "--loss-scale",
         "steps": "--steps", "summary": "--summary", "weights": "--no-weights",
         "queue_bytes": "--queue-mb", "progress": "progress", "dtype": "--dtype",
         "autocast": "--autocast", "extra_meta": "extra_meta",
         "record_steps": "--record-steps", "ops": "--ops", "ops_all": "--ops-all",
         "full_around": "--full-around", "radius": "--radius",
         "matmul_precision": "--matmul-precision", "data_modules": "data_modules",
         "force_routing": "--force-routing"}


def _strings(value: Sequence[str] | str, name: str) -> tuple[str, ...]:
    if isinstance(value, str):  # a lone glob, not its characters
        return (value,)
    items = tuple(value)
    if not all(isinstance(item, str) for item in items):
        raise CaptureError(f"capture option {name} must be strings (globs or module paths), "
                           f"got {items!r}")
    return items


@dataclass(frozen=True)
class CaptureOptions:
    """What a capture records (see :func:`layerdiff.capture.capture` for each option's
    meaning). Sequences become tuples and collections frozensets, so that one options object
    can be shared by every floor (and pickled to a spawned rank); every value is checked when
    the object is made."""

    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    loss_scale: float = 1.0
    steps: int | None = None  # None: the case's own
    summary: bool = False
    weights: bool = True
    queue_bytes: int = DEFAULT_QUEUE_BYTES
    progress: bool = False
    dtype: str | None = None
    autocast: str | None = None
    extra_meta: Mapping[str, Any] = field(default_factory=dict)
    record_steps: frozenset[int] | None = None
    ops: tuple[str, ...] = ()
    ops_all: bool = False
    full_around: tuple[str, ...] = ()
    radius: int = 1
    matmul_precision: str = "float32"
    data_modules: frozenset[str] | None = None
    force_routing: Any = None  # a layerdiff.capture.routes.RouteForcer

    def __post_init__(self) -> None:
        def set_(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        for name in ("include", "exclude", "ops", "full_around"):
            set_(name, _strings(getattr(self, name), name))
        if self.record_steps is not None:
            set_("record_steps", frozenset(int(step) for step in self.record_steps))
        if self.data_modules is not None:
            set_("data_modules", frozenset(_strings(tuple(self.data_modules), "data_modules")))
        set_("extra_meta", dict(self.extra_meta or {}))  # a copy: the caller's stays theirs
        self._check()

    def _check(self) -> None:
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise CaptureError(f"--loss-scale must be a finite positive number (got "
                               f"{self.loss_scale}); use a power of two that leaves room, "
                               "such as 2**20 (1048576)")
        if self.steps is not None and self.steps < 1:
            raise CaptureError(f"--steps must be at least 1 (got {self.steps})")
        if self.queue_bytes <= 0:
            raise CaptureError(f"--queue-mb must be positive (got {self.queue_bytes} bytes)")
        if self.radius < 0:
            raise CaptureError(f"--radius must be 0 or more (got {self.radius})")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise CaptureError(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise CaptureError(f"--matmul-precision {self.matmul_precision!r} is not one of "
                               f"{', '.join(MATMUL_PRECISIONS)}")
        if self.summary and (self.full_around or self.data_modules is not None):
            which = "--full-around" if self.full_around else "data_modules"
            raise CaptureError(f"{which} keeps tensor data for the modules it names and "
                               "statistics elsewhere; it cannot be combined with --summary, "
                               "which keeps none")

    @classmethod
    def of(cls, options: CaptureOptions | None = None, **given: Any) -> CaptureOptions:
        """``options`` with ``given`` put over it (or the options ``given`` alone): how a
        function that takes either an options object or keywords makes the one object."""
        unknown = sorted(set(given) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"unknown capture option(s) {', '.join(unknown)}; known: "
                            f"{', '.join(f.name for f in fields(cls))}")
        return replace(options, **given) if options is not None else cls(**given)

    def given(self) -> list[str]:
        """The options set away from their defaults, by field name."""
        return [f.name for f in fields(self)
                if getattr(self, f.name) != (f.default_factory() if callable(f.default_factory)
                                             else f.default)]

    def refuse(self, accepted: Collection[str], case: str, why: str) -> None:
        """Raise one :class:`CaptureError` naming every given option not in ``accepted``, as
        the user wrote them: ``why`` says what the case is (``"is a Flax model"``)."""
        refused = [FLAGS[name] for name in self.given() if name not in accepted]
        if refused:
            raise CaptureError(f"case {case} {why}, so {', '.join(refused)} "
                               f"{'does' if len(refused) == 1 else 'do'} not apply to it; "
                               "capture it without them")

    def meta(self, steps: int) -> dict[str, Any]:
        """What every trace's meta records of its options (``steps`` resolved against the
        case), with ``extra_meta`` over it; the framework adds what only it knows."""
        return {"steps": steps, "loss_scale": self.loss_scale, "summary": self.summary,
                "include": list(self.include), "exclude": list(self.exclude),
                "dtype": self.dtype, **self.extra_meta}
