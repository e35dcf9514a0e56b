"""What a jitted Flax capture must share with the eager capture of the same case."""

from __future__ import annotations

import numpy as np

COLUMNS = ("step", "pass", "site", "role", "arg", "kind")


def rows(trace) -> list[tuple]:
    """Each record's place in the trace: its step, pass, site, role, argument and kind."""
    return list(zip(*(trace.index[c] for c in COLUMNS), strict=True))


def assert_same_records(eager, jitted) -> None:
    """The same records in the same order, tensors of the same dtype and shape within
    rounding (the compiled step may fuse differently), other values equal."""
    assert rows(eager) == rows(jitted)
    for (_, row), (_, other) in zip(eager.index.iterrows(), jitted.index.iterrows(),
                                    strict=True):
        if row["kind"] == "tensor":
            a, b = np.asarray(eager.read(row)), np.asarray(jitted.read(other))
            assert a.dtype == b.dtype and a.shape == b.shape, (row["site"], row["arg"])
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{row['site']} {row['role']}")
        else:
            assert eager.read(row) == jitted.read(other), (row["site"], row["arg"])
