"""What a digest match is called. The tensor digest is linear modulo two primes: random damage
changes it with a chance near 1 - 2**-63, but a deliberate change can keep it. So the diff calls
a pair "identical" only when it compared their bytes (it reads both anyway, to check them), and
"same-digest" where it knows the digests alone (a summary trace, or --no-verify)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from layerdiff import TraceWriter, diff, open_trace
from layerdiff.trace.digest import PRIME_A, PRIME_B, digest_bytes, weights

# Added to the first 8 float32 words of a tensor (as int32: 4-44 ULP), this keeps its digest.
# Found by lattice reduction (LLL) of {du : sum du[r] W_a[r] = 0 mod P_A, sum du[r] W_b[r] = 0
# mod P_B} over word positions r = 0..7 of one block: what a crafted file can do to any tensor.
COLLISION = np.array([-4, 8, -41, -26, 27, 36, 43, -44], dtype=np.int32)


def _collided(values: np.ndarray) -> np.ndarray:
    changed = np.ascontiguousarray(values, dtype=np.float32).copy()
    changed.reshape(-1).view(np.int32)[:COLLISION.size] += COLLISION
    return changed


def _write(path, weight, *, summary=False):
    x = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
    with TraceWriter(path, meta={"case": "digest"}, summary=summary) as writer, \
            writer.site("fc", "Linear") as site:
        writer.record(site, "input", x)
        writer.record(site, "weight", weight, arg="weight")
        writer.record(site, "output", x @ weight.T)
    return path


@pytest.fixture
def collided(tmp_path):
    """A reference, and a port whose weight differs in 8 values yet keeps the digest (its output
    is the reference's: only the weight is changed, as a crafted file would change it)."""
    weight = np.random.default_rng(0).uniform(50.0, 100.0, (6, 8)).astype(np.float32)
    changed = _collided(weight)
    assert digest_bytes(weight.view(np.uint8)) == digest_bytes(changed.view(np.uint8))
    ref = _write(tmp_path / "ref.h5", weight)
    port = tmp_path / "port.h5"
    x = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(4, 8)
    with TraceWriter(port, meta={"case": "digest"}) as writer, \
            writer.site("fc", "Linear") as site:
        writer.record(site, "input", x)
        writer.record(site, "weight", changed, arg="weight")
        writer.record(site, "output", x @ weight.T)
    return ref, port, weight, changed


def _row(result, role):
    return result.rows[result.rows["role"] == role].iloc[0]


def test_the_collision_is_real():
    """The planted change keeps the digest of any float32 tensor (the definition is linear)."""
    table = weights()
    assert int(COLLISION.astype(np.int64) @ table[:8, 0]) % PRIME_A == 0
    assert int(COLLISION.astype(np.int64) @ table[:8, 1]) % PRIME_B == 0


def test_equal_digests_over_unequal_bytes_are_not_called_identical(collided):
    ref, port, weight, changed = collided
    with open_trace(ref) as a, open_trace(port) as b:
        assert a.find(0, "fc#0", "weight", "weight")["digest"] == b.find(
            0, "fc#0", "weight", "weight")["digest"]
    result = diff(ref, port)
    row = _row(result, "weight")
    assert row["verdict"] == "out" and row["max_abs"] == pytest.approx(
        float(np.abs(weight - changed).max()))
    assert "equal digests, unequal bytes" in row["note"]
    assert not result.passed and result.origin.role == "weight"
    # what the bytes show equal stays identical
    assert _row(result, "input")["verdict"] == "identical"
    assert _row(result, "output")["verdict"] == "identical"


def test_without_reading_the_bytes_a_digest_match_is_only_same_digest(collided, tmp_path):
    """--no-verify reads no record whose digests agree: it cannot say identical."""
    from click.testing import CliRunner

    from layerdiff.cli import main

    ref, port, _, _ = collided
    result = diff(ref, port, verify=False)
    assert set(result.rows["verdict"]) == {"same-digest"} and result.passed
    out = tmp_path / "d.json"
    done = CliRunner().invoke(main, ["diff", str(ref), str(port), "--no-verify", "-v",
                                     "--json", str(out)])
    assert done.exit_code == 0, done.output
    assert {row["verdict"] for row in json.loads(out.read_text())["rows"]} == {"same-digest"}


def test_a_summary_side_knows_digests_alone(collided, tmp_path):
    """A summary trace holds no tensors: equal digests are all the diff can compare."""
    ref, port, weight, _ = collided
    summary = _write(tmp_path / "summary.h5", weight, summary=True)
    result = diff(summary, port)
    assert set(result.rows["verdict"]) == {"same-digest"} and result.passed
    from layerdiff.report.terminal import format_diff

    said = " ".join(format_diff(result, verbose=True).split())
    assert ("digests 3 records agree by their digests alone, bytes not compared" in said
            and "not against a deliberate one" in said and "same-digest" in said)
    from layerdiff.report.html import write_html

    page = write_html(result, tmp_path / "report.html").read_text()
    assert "3 records agree by their digests alone (same digest: bytes not compared" in page
    assert set(diff(summary, ref).rows["verdict"]) == {"same-digest"}
    assert set(diff(ref, ref).rows["verdict"]) == {"identical"}
