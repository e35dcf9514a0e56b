"""Where a port parameter comes from: reference names and a chain of transforms, and how each
reference tensor is found in the port's tensor (slices and a transpose), from shapes alone."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerdiff.mapping.code import CodeRef

TRANSFORMS = ("copy", "transpose", "concat", "split")


@dataclass(frozen=True)
class Slice:
    """Part of a tensor along one axis: rows ``start:stop`` of ``axis``."""

    axis: int
    start: int
    stop: int


@dataclass(frozen=True)
class PartView:
    """How one reference tensor of a parameter is found in the port's tensor.

    The reference tensor (its ``ref_slice``, when a split gave the port only part of it)
    equals the port's stored tensor cut to ``port_slice`` and then, when ``transpose_port``,
    transposed (all axes reversed). In that order, always: any chain of transposes around one
    concat or split comes down to it, because a slice of a transposed tensor is the transpose
    of a slice along the mirrored axis.
    """

    reference: int                  # position in ParamSource.reference
    ref_slice: Slice | None = None
    port_slice: Slice | None = None
    transpose_port: bool = False


@dataclass
class ParamSource:
    """Where one port parameter comes from: reference names and the chain of transforms that
    makes the port's tensor from them, applied in order (a single name is a chain of one)."""

    reference: list[str]
    transforms: tuple[str, ...] | str = ("copy",)
    axis: int = 0
    part: int = 0     # split: which part of the reference tensor
    parts: int = 1    # split: into how many
    where: str = field(default="", compare=False)  # the rule (file and line), for messages

    def __post_init__(self) -> None:
        if isinstance(self.transforms, str):
            self.transforms = (self.transforms,)
        self.transforms = tuple(self.transforms)

    @property
    def transform(self) -> str:
        """The chain as text: ``concat``, or ``concat, transpose``."""
        return ", ".join(self.transforms)

    @property
    def functions(self) -> tuple[str, ...]:
        """The conversion functions of the chain (``package.module:function`` steps)."""
        return tuple(step for step in self.transforms if step not in TRANSFORMS)

    def code_refs(self) -> list[CodeRef]:
        """The chain's conversion functions as code references, to import when needed."""
        return [CodeRef(name, self.where or "mapping") for name in self.functions]

    @property
    def reshapes(self) -> bool:
        """Whether the chain concatenates or splits (its views then depend on shapes)."""
        return any(step in ("concat", "split") for step in self.transforms)

    def views(self, ref_shapes: list[tuple[int, ...]],
              port_shape: tuple[int, ...]) -> list[PartView]:
        """Each reference tensor's place in the port's tensor, from the shapes alone; the
        chain undone in reverse order. Raises ValueError when ``axis`` is not an axis of the
        tensors."""
        structural = [i for i, t in enumerate(self.transforms) if t in ("concat", "split")]
        cut = structural[0] if structural else len(self.transforms)
        flip_before = self.transforms[:cut].count("transpose") % 2 == 1
        flip_after = self.transforms[cut:].count("transpose") % 2 == 1
        transpose = flip_before != flip_after
        if not structural:
            return [PartView(0, transpose_port=transpose)]
        step = self.transforms[cut]
        if step == "split":
            rows = port_shape[self._axis(port_shape, flip_after, step)]
            part = Slice(self._axis(ref_shapes[0], flip_before, step), self.part * rows,
                         (self.part + 1) * rows)
            return [PartView(0, ref_slice=part, transpose_port=transpose)]
        views, start = [], 0
        port_axis = self._axis(port_shape, flip_after, step)
        for number, shape in enumerate(ref_shapes):
            rows = shape[self._axis(shape, flip_before, step)]
            views.append(PartView(number, port_slice=Slice(port_axis, start, start + rows),
                                  transpose_port=transpose))
            start += rows
        return views

    def _axis(self, shape: tuple[int, ...], flipped: bool, step: str) -> int:
        """``axis`` as an axis of a tensor of ``shape``, seen through a transpose (reversed
        axes) when ``flipped``."""
        ndim = len(shape)
        if not -ndim <= self.axis < ndim:
            raise ValueError(f"a tensor of shape ({', '.join(map(str, shape))}) has no axis "
                             f"{self.axis} to {step} along")
        axis = self.axis % ndim
        return ndim - 1 - axis if flipped else axis

