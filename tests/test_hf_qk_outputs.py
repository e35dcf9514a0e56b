"""q/k projections whose weights the mapping converts by a row permutation pair in the diff
(issue 39, item 3): the diff derives the output permutation from the weight's conversion.

Hugging Face's Llama keeps each head's q/k rows in rotate-half order, the Meta-style port
(``reference_models/llama_port.py``) interleaved; ``hf_llama.map.toml`` converts the weights with
``hf_to_meta_qk`` and pairs the projection sites like any other (``[[site]]`` rules, no
``[[unmatched]]``): the faithful port passes, with the q/k outputs and their gradients compared
through the inverse permutation, and the attention bugs are still named at the attention.
Tiny random config, no downloads; skipped without transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from layerdiff import diff  # noqa: E402
from layerdiff.cli import main  # noqa: E402
from layerdiff.compare import read_pair  # noqa: E402
from layerdiff.compare.judge import Verdict  # noqa: E402
from layerdiff.compare.outconv import _row_permutation  # noqa: E402
from layerdiff.mapping import ParamSource  # noqa: E402
from layerdiff.report.findings.diff import describe_origin  # noqa: E402
from reference_models import hf_llama_convert as convert  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"
LOSS_SCALE = 2**20
PASSING = {Verdict.WITHIN, Verdict.IDENTICAL}
QK = "reference_models.hf_llama_convert:hf_to_meta_qk"


def test_the_bundled_mapping_pairs_the_qk_projections():
    """hf_llama.map.toml pairs q/k by [[site]] rules; nothing declares them unpaired."""
    from layerdiff.mapping import Mapping

    mapping = Mapping.load(LLAMA_MAP)
    for site in ("model.layers.0.self_attn.q_proj#0", "model.layers.1.self_attn.k_proj#0"):
        assert mapping.why_unmatched("reference", site) is None
    for site in ("layers.0.attention.wq#0", "layers.1.attention.wk#0"):
        assert mapping.why_unmatched("port", site) is None


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_qk")
    mapping = LLAMA_MAP

    def capture(spec: str, *extra) -> Path:
        path = folder / f"{spec.rpartition(':')[2]}.h5"
        result = CliRunner().invoke(main, [str(a) for a in (
            "capture", spec, "-o", path, "--loss-scale", LOSS_SCALE, *extra)])
        assert result.exit_code == 0, result.output
        return path

    reference = capture("reference_models.hf_llama:reference")

    def port(name: str) -> Path:
        return capture(f"reference_models.llama_port:{name}", "--weights-from", reference,
                       "--map", mapping)

    return reference, mapping, port


def test_the_faithful_port_passes_with_its_qk_projections_paired(traces):
    reference, mapping, port = traces
    result = diff(reference, port("port"), mapping=mapping)
    assert result, [describe_origin(origin) for origin in result.origins]
    rows = result.rows
    for layer in (0, 1):
        for proj, port_proj in (("q_proj", "wq"), ("k_proj", "wk")):
            site = f"model.layers.{layer}.self_attn.{proj}#0"
            at = rows[(rows["site"] == site) & rows["role"].isin(["output", "grad_output"])]
            assert sorted(at["role"]) == ["grad_output", "output"], at
            assert (at["match"] == "output-converted").all()
            assert at["verdict"].isin(PASSING).all(), at
            assert (at["port_site"] == f"layers.{layer}.attention.{port_proj}#0").all()
            assert all("the inverse of the row permutation" in note and "hf_to_meta_qk" in note
                       for note in at["note"])
            row = at[at["role"] == "output"].iloc[0]
            ref_values, port_values = read_pair(result, row)  # read back as compared
            np.testing.assert_allclose(port_values, ref_values, rtol=1e-5, atol=1e-6)
    assert not result.unmatched["site"].str.contains(r"[qk]_proj|w[qk]#").any()


@pytest.mark.parametrize(("bug", "port_site"), [("port_bug_attention", "layers.1.attention#0"),
                                                ("port_bug_rotary", "layers.0.attention#0")])
def test_attention_bugs_are_named_at_the_attention(traces, bug, port_site):
    reference, mapping, port = traces
    result = diff(reference, port(bug), mapping=mapping)
    assert not result
    origin = result.origin
    assert (origin.port_site, origin.pass_) == (port_site, "forward"), describe_origin(origin)


def test_the_permutation_is_found_exactly_or_not_at_all():
    shape = (4 * convert.HEAD_DIM, 8)
    perm = _row_permutation(ParamSource(["w"], (QK,)), shape, shape, "wq.weight")
    w = torch.randn(shape)
    assert torch.equal(convert.hf_to_meta_qk(w), w[list(perm)])
    assert perm != tuple(range(shape[0]))
    # a copy keeps the rows in place; a transpose or a chain that changes the shape is none
    assert _row_permutation(ParamSource(["w"]), shape, shape, "w") == tuple(range(shape[0]))
    square = (convert.HEAD_DIM, convert.HEAD_DIM)
    assert _row_permutation(ParamSource(["w"], ("transpose",)), square, square, "w") is None
    assert _row_permutation(ParamSource(["w"], (QK,)), shape, (8, shape[0]), "w") is None


@pytest.mark.parametrize(("bug", "local_at"), [("port", set()),
                                               ("port_bug_attention", {"layers.1.attention#0"})])
def test_replay_feeds_the_qk_projections_their_gradient_in_the_ports_order(traces, bug,
                                                                            local_at):
    from layerdiff import load_case
    from layerdiff.replay import replay

    reference, mapping, _ = traces
    result = replay(reference, load_case(f"reference_models.llama_port:{bug}"),
                    mapping=mapping, propagated=False)
    table = result.local
    local = table[table["verdict"] == "LOCAL ERROR"]
    assert set(local["port_site"]) == local_at, table
    qk = table[table["port_site"].str.contains(r"attention\.w[qk]#")]
    assert set(qk["pass"]) == {"forward", "backward"} and len(qk) == 8, qk
