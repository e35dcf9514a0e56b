"""The mapping's code references (conversions, call adapters), output renames and single
unmatched records: read as plain data, checked for form, imported only when resolved."""

from __future__ import annotations

import sys

import pytest

from layerdiff.errors import MappingError
from layerdiff.mapping import CodeRef, Mapping

MAPPING = """version = 1
[[site]]
reference = "model.layers.*.self_attn"
port = "layers.*.attention"
call = "{module}:adapt"
outputs = {{ "0" = "0" }}

[[pair]]
reference = "<root>#0"
port = "<root>#0"
outputs = {{ logits = "0" }}

[[unmatched]]
reference = "model.layers.*.self_attn"
output = 1
why = "the port returns no attention weights"

[[unmatched]]
port = "layers.*.attention.mask"
why = "the port's own causal mask"

[[param]]
port = "layers.*.attention.wq.weight"
reference = "model.layers.*.self_attn.q_proj.weight"
transform = ["{module}:rope_rows", "copy"]
"""


@pytest.fixture
def code_module(tmp_path, monkeypatch):
    """A module of conversion code on sys.path, named uniquely, forgotten afterwards."""
    name = f"ld_conversions_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "def rope_rows(t):\n    return t.flip(0)\n\n"
        "def adapt(*args, **kwargs):\n    return args, {}\n\nnot_a_function = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _mapping(tmp_path, module: str) -> Mapping:
    path = tmp_path / "m.toml"
    path.write_text(MAPPING.format(module=module))
    return Mapping.load(path)


def test_reading_a_mapping_imports_no_code(tmp_path):
    mapping = _mapping(tmp_path, "no_such_package.anywhere")
    assert "no_such_package" not in sys.modules
    assert [ref.spec for ref in mapping.code_refs()] == [
        "no_such_package.anywhere:rope_rows", "no_such_package.anywhere:adapt"]
    with pytest.raises(MappingError, match=r"m\.toml line 2: .*does not import"):
        mapping.call_adapter("model.layers.0.self_attn#0").resolve()


def test_rules_give_adapters_output_names_and_conversion_chains(tmp_path, code_module):
    mapping = _mapping(tmp_path, code_module)
    adapter = mapping.call_adapter("model.layers.1.self_attn#2")
    assert adapter is not None and adapter.resolve()(1, 2, mask=3) == ((1, 2), {})
    assert mapping.call_adapter("model.layers.1.mlp#0") is None
    assert mapping.output_names("<root>#0") == {"logits": "0"}
    assert mapping.output_names("model.layers.1.self_attn#0") == {"0": "0"}
    source = mapping.param_source("layers.1.attention.wq.weight", {})
    assert source.functions == (f"{code_module}:rope_rows",)
    (ref,) = source.code_refs()
    assert ref.resolve() is not None
    provenance = ref.provenance()
    assert provenance["function"] == f"{code_module}:rope_rows"
    assert len(provenance["source_sha256"]) == 64


def test_unmatched_records_cover_the_record_and_its_gradient_only(tmp_path):
    mapping = _mapping(tmp_path, "x.y")
    why = "the port returns no attention weights"
    site = "model.layers.1.self_attn#0"
    assert mapping.why_unmatched_record("reference", site, "output", "1") == why
    assert mapping.why_unmatched_record("reference", site, "grad_output", "1") == why
    assert mapping.why_unmatched_record("reference", site, "output", "0") is None
    assert mapping.why_unmatched_record("reference", site, "input", "1") is None
    assert mapping.why_unmatched_record("port", site, "output", "1") is None
    # a site-level declaration is not made by a record-level one
    assert mapping.why_unmatched("reference", site) is None
    assert mapping.why_unmatched("port", "layers.0.attention.mask") == "the port's own causal mask"


@pytest.mark.parametrize("entry, words", [
    ('[[site]]\nreference = "a"\nport = "b"\ncall = "adapt"\n', "package.module:function"),
    ('[[site]]\nreference = "a"\nport = "b"\noutputs = { x = true }\n', "outputs must be"),
    ('[[param]]\nport = "a.w"\nreference = "b.w"\ntransform = "rope"\n',
     "nor a conversion function"),
    ('[[unmatched]]\nreference = "a"\noutput = ""\n', "needs 'output' as an argument path"),
    ('[[unmatched]]\nreference = "a"\noutput = "1"\ninput = "0"\n', "one of 'input' or"),
])
def test_bad_code_and_record_rules_name_the_line(tmp_path, entry, words):
    path = tmp_path / "m.toml"
    path.write_text("version = 1\n\n" + entry)
    with pytest.raises(MappingError, match=words) as info:
        Mapping.load(path)
    assert f"{path} line 3" in str(info.value)


def test_a_code_reference_to_a_missing_name_lists_what_the_module_has(code_module):
    with pytest.raises(MappingError, match="has no 'permute'; it defines adapt, rope_rows"):
        CodeRef(f"{code_module}:permute", "m.toml line 9").resolve()
    with pytest.raises(MappingError, match="is a int, not a function"):
        CodeRef(f"{code_module}:not_a_function").resolve()
