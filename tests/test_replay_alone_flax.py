"""Replay of a Flax NNX port judges what a module's call alone makes (issue 39), as torch
replay does (tests/test_replay_alone.py): a parameter the port's code reads outside every call
whose replay makes its gradient (``self.tok.attend(x)`` from the root) is split with the
reference case or set aside as "cannot judge alone", never a local error. The cases are in
``tests/flax_tied_cases.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("flax")
import jax.numpy as jnp
from flax import nnx

from layerdiff import Case, capture, load_case
from layerdiff.flax.reads import outside_reads
from layerdiff.replay import ReplayOutcome, replay

CASES = "tests.flax_tied_cases"
REFERENCE = "tests.replay_alone_cases:gpt"   # torch: x @ self.tok.weight.T in its root
MAP = str(Path(__file__).with_name("flax_tied.map.toml"))
SET_ASIDE = "tok#0 weight_grad embedding"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    return capture(load_case(REFERENCE), tmp_path_factory.mktemp("ref") / "ref.h5")


def _local(result):
    table = result.local
    chosen = table[table["verdict"] == "LOCAL ERROR"]
    return set(zip(chosen["site"], chosen["pass"], strict=True))


def _replay(ref, port: str, split: bool = False):
    return replay(ref, load_case(f"{CASES}:{port}"), mapping=MAP, propagated=False,
                  reference_case=load_case(REFERENCE) if split else None)


# ---- which reads are outside

class _Reads(nnx.Module):
    """Reads a child's kernel's shape and dtype (no value a gradient flows from), its
    transpose (``.T``, past get_value) and another child's kernel through ``[...]``."""

    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.a, self.b, self.c = (nnx.Linear(2, 2, rngs=rngs) for _ in range(3))

    def __call__(self, x):
        y = self.b(self.a(x).astype(self.b.kernel.dtype)) * self.b.kernel.shape[0]
        return y + x @ self.a.kernel.T + x @ self.c.kernel[...]


def test_reads_outside_every_call_that_makes_the_gradient_are_found():
    tiny = load_case(f"{CASES}:gpt")
    found = outside_reads(tiny)
    assert found == {id(tiny.model.tok.embedding): ["<root>"]}
    # the torch reference's head is found the same way (tests/test_replay_alone.py)
    model = _Reads()
    found = outside_reads(Case(model=model, inputs=(jnp.ones((1, 2)),),
                               loss_fn=lambda out: out.sum(), name="reads"))
    # c is never called: the root's replay makes its gradient, so that read is no use outside
    assert found == {id(model.a.kernel): ["<root>"]}
    # the held-out GPT-2 port's LMHead, holding wte and calling wte.attend in its own call, is
    # a site, not a use outside: tests/test_flax_heldout.py judges wte's summed gradient
    assert "get_value" not in nnx.Param.__dict__   # nnx.Variable put back
    assert nnx.Variable.get_value.__module__ == "flax.nnx.variablelib"


# ---- replay

def test_a_faithful_port_attending_from_its_root_passes(ref):
    result = _replay(ref, "gpt")  # was tok#0 backward, LOCAL ERROR at 4.1e4x
    assert result.outcome == ReplayOutcome.PASS and not _local(result)
    why = dict(result.skipped)[SET_ASIDE]
    assert why.startswith("cannot judge alone: tok.embedding is also used at <root>")
    rows = result.diff.rows
    assert set(rows.loc[rows["site"] == "tok#0", "role"]) == {
        "input", "output", "grad_output", "weight"}   # the rest of the embedding is judged


def test_a_planted_bug_in_the_embeddings_own_lookup_is_still_named(ref):
    result = _replay(ref, "gpt_bug_lookup")
    assert not result and _local(result) == {("tok#0", "forward")}


def test_with_the_reference_case_the_gradient_is_split_and_judged(ref):
    faithful = _replay(ref, "gpt", split=True)
    assert faithful.outcome == ReplayOutcome.PASS and not faithful.skipped
    assert faithful.notes == ["tok.embedding is also used at <root>: judged on what the calls "
                              "of tok alone make, on both sides"]
    rows = faithful.diff.rows
    grad = rows[(rows["site"] == "tok#0") & (rows["role"] == "weight_grad")]
    assert len(grad) == 1 and grad["ratio"].iloc[0] <= 0.01
    # a bug in the lookup's own gradient into the table: named only once the total is split
    bug = _replay(ref, "gpt_bug_lookup_grad", split=True)
    assert _local(bug) == {("tok#0", "backward")}


@pytest.mark.slow
def test_hf_gpt2_against_a_flax_port_attending_from_its_root(reference_traces):
    """transformers' GPT2LMHeadModel (its lm_head tied to wte) against the held-out Flax port
    with its head moved into the root: ``self.transformer.wte.attend(x)``."""
    pytest.importorskip("transformers")
    hf = reference_traces("tests.flax_heldout:reference")
    heldout_map = str(Path(__file__).with_name("flax_heldout.map.toml"))
    result = replay(hf, load_case(f"{CASES}:gpt2_head_in_root"), mapping=heldout_map,
                    propagated=False, reference_case=load_case("tests.flax_heldout:reference"))
    assert result.passed and not _local(result)   # was transformer.wte#0 backward
    assert result.notes == ["transformer.wte.embedding is also used at <root>: judged on what "
                            "the calls of transformer.wte alone make, on both sides"]
    rows = result.diff.rows
    grad = rows[(rows["site"] == "transformer.wte#0") & (rows["role"] == "weight_grad")]
    assert len(grad) == 1 and grad["ratio"].iloc[0] < 1
