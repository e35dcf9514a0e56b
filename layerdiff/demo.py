"""The demo as a library call: capture a bundled reference and one of its ports (a planted bug
by default) with the reference's weights, and diff them. ``layerdiff demo`` prints the result
and writes its HTML report; from Python:

    from layerdiff.demo import run_demo
    demo = run_demo(output_dir="layerdiff-demo")
    demo.diff.origin
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerdiff import bundled
from layerdiff.errors import CaseError
from layerdiff.outputs import make_folder

if TYPE_CHECKING:  # the command line imports this module for its default; keep that light
    from layerdiff.compare.result import Diff
    from reference_models.catalog import CaseInfo

DEFAULT_DEMO_PORT = "reference_models.transformer_port:bug_softmax_axis"


@dataclass(frozen=True)
class Demo:
    """What the demo made: the bundled port's catalog entry, both traces and their diff."""

    info: CaseInfo
    port_spec: str
    folder: Path
    reference: Path
    port: Path
    diff: Diff

    def __bool__(self) -> bool:
        """The diff's verdict (a planted bug makes it False)."""
        return bool(self.diff)

    def as_json(self) -> dict[str, Any]:
        return {"reference_case": self.info.reference, "port_case": self.port_spec,
                "reference": str(self.reference), "port": str(self.port),
                "diff": self.diff.as_json()}


def run_demo(port_spec: str = DEFAULT_DEMO_PORT,
             output_dir: str | os.PathLike = "layerdiff-demo", *, progress: bool = True) -> Demo:
    """Capture ``port_spec``'s reference into ``output_dir``/reference.h5, the port with the
    reference's weights into port.h5, and diff them (through the catalog's mapping).

    ``port_spec`` must be a bundled port (``layerdiff cases`` lists them): a
    :class:`CaseError` says so before anything is written. A port that records itself
    (an external case) loads its own weights.
    """
    from layerdiff.capture import capture
    from layerdiff.case import load_case
    from layerdiff.compare import diff
    from layerdiff.framework import framework_of

    info = bundled.import_module("reference_models.catalog").find(port_spec)
    if info is None or info.reference is None:
        raise CaseError(f"{port_spec} is not a bundled port; `layerdiff cases` lists them")
    out = make_folder(output_dir, "-o")
    reference = capture(load_case(info.reference), out / "reference.h5", progress=progress)
    port_case = load_case(port_spec)
    if getattr(port_case, "model", None) is not None:  # one that records itself has its own
        framework_of(port_case).load_weights(port_case, reference, info.mapping_path)
    port = capture(port_case, out / "port.h5", progress=progress)
    result = diff(reference, port, mapping=info.mapping_path)
    return Demo(info=info, port_spec=port_spec, folder=out, reference=reference, port=port,
                diff=result)
