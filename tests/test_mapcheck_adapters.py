"""``map_check`` on the bundled Hugging Face Llama pair: modules run through the mapping's call
adapters and outputs paired through its ``outputs`` renames, so the RoPE conversion of q/k is
checked at the attention; a wrong conversion, or one left out, fails.
Skipped without transformers (tiny random config, no downloads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from click.testing import CliRunner

from layerdiff import Mapping, MappingError, load_weights, open_trace
from layerdiff.case import load_case
from layerdiff.cli import main
from layerdiff.replay.mapcheck import MISMATCH_AROUND, _SiteRunner, map_check
from layerdiff.replay.ports import port_model
from layerdiff.report.findings import render
from layerdiff.report.findings.replay import mapcheck_verdict

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"
CONVERSION = "reference_models.hf_llama_convert:hf_to_meta_qk"
PORT = "reference_models.llama_port:port"
QK = [f"layers.{i}.attention.w{x}.weight" for i in (0, 1) for x in "qk"]


def flipped_rows(tensor: torch.Tensor) -> torch.Tensor:
    """A wrong 'conversion': reverses the rows, not the per-head RoPE interleave."""
    return tensor.flip(0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mapcheck_adapters") / "ref.h5"
    result = CliRunner().invoke(main, ["capture", "reference_models.hf_llama:reference",
                                       "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path


def _mapping(tmp_path: Path, old: str, new: str) -> Path:
    text = LLAMA_MAP.read_text()
    assert old in text
    path = tmp_path / "llama.map.toml"
    path.write_text(text.replace(old, new))
    return path


def _entries(check) -> dict:
    return {entry.port: entry for entry in check.entries}


def test_the_right_conversion_is_checked_at_the_attention_through_its_adapter(reference):
    check = map_check(reference, load_case(PORT), LLAMA_MAP)
    assert check.passed, render(check)
    entries = _entries(check)
    for name in QK:
        entry = entries[name]
        layer = name.split(".")[1]
        assert entry.status == "ok", entry.note
        assert entry.conversion["site"] == f"model.layers.{layer}.self_attn#0", entry.note
        # the right layout reproduces the attention; HF's rows unconverted do not
        assert entry.conversion["with"] * 1000 < entry.conversion["without"], entry.note
    assert "4 conversions checked" in " ".join(mapcheck_verdict(check).split())


UNPAIRED_QK = """
[[unmatched]]
reference = "model.layers.*.self_attn.[qk]_proj"
why = "checked at the attention"

[[unmatched]]
port = "layers.*.attention.w[qk]"
why = "checked at the attention"
"""


@pytest.mark.parametrize(("transform", "unpaired"), [(f"{__name__}:flipped_rows", False),
                                                     ("copy", True)])
def test_a_wrong_or_missing_conversion_fails_at_each_qk_tensor(reference, tmp_path, transform,
                                                              unpaired):
    """A flip with the q/k sites paired (their outputs compared through the inverse of the
    flip, derived from it: that undoes any row order, so the projections say nothing of it and
    the attention around them decides), or no conversion while the q/k sites are declared
    without partner: the shapes fit, and the attention around them is off."""
    path = _mapping(tmp_path, f'transform = "{CONVERSION}"', f'transform = "{transform}"')
    if unpaired:
        path.write_text(path.read_text() + UNPAIRED_QK)
    check = map_check(reference, load_case(PORT), path)
    assert not check.passed
    entries = _entries(check)
    assert {name for name, e in entries.items() if e.status == MISMATCH_AROUND} == set(QK), \
        render(check)
    note = entries["layers.0.attention.wk.weight"].note
    assert "model.layers.0.self_attn#0" in note and "transpose" not in note
    assert "4 off in the module around them; check their rules, or the port there" in \
        mapcheck_verdict(check)


def test_the_root_is_measured_through_its_outputs_rename(reference):
    """HF's CausalLMOutputWithPast.logits against the port's bare logits (0); the blocks
    through block_call. Both reproduce the reference once the conversion is loaded."""
    case = load_case(PORT)
    check = map_check(reference, case, LLAMA_MAP)  # leaves the port as it was: load it here
    assert check.passed
    load_weights(case.model, reference, mapping=LLAMA_MAP)
    with open_trace(reference) as ref:
        runner = _SiteRunner(ref, port_model(case, "map-check"), Mapping.load(LLAMA_MAP))
        for module, site in [("<root>", "<root>#0"), ("layers.1", "model.layers.1#0")]:
            measured = runner.measure(module)
            assert measured.site == site and measured.error < measured.rounding, measured


def test_an_adapter_that_does_not_import_is_refused_naming_the_rule(reference, tmp_path):
    path = _mapping(tmp_path, "reference_models.hf_llama_convert:attention_call",
                    "reference_models.hf_llama_convert:no_such_adapter")
    with pytest.raises(MappingError, match="no_such_adapter"):
        map_check(reference, load_case(PORT), path)
