"""The list of bundled cases that `layerdiff cases` prints: what each is and, for a planted bug,
where it lives. Scripts drive every bundled case from the JSON form of this list."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CaseInfo:
    spec: str                      # package.module:name, for `layerdiff capture`
    model: str                     # mlp | cnn | transformer | convlstm | bench
    kind: str                      # reference | port | bug
    description: str
    reference: str | None = None   # for a port or a bug: the case it should match
    mapping: str | None = None     # the mapping file it needs, once mapping files exist
    site: str | None = None        # for a bug: the site (in the port's names) where it lives
    pass_: str | None = None       # for a bug: forward | backward

    def as_json(self) -> dict:
        data = asdict(self)
        data["pass"] = data.pop("pass_")
        return data


def _ref(model: str, description: str) -> CaseInfo:
    return CaseInfo(f"reference_models.{model}:reference", model, "reference", description)


CATALOG: list[CaseInfo] = [
    _ref("mlp", "MLP classifier: Linear, in-place ReLU, dropout, GELU; cross-entropy"),
    _ref("transformer", "encoder-decoder translation transformer (Attention Is All You Need "
                        "style), 2+2 layers, d_model 64; NLL loss"),
    CaseInfo("reference_models.transformer:reference_large", "transformer", "reference",
             "the transformer at benchmark size: d_model 256, 4+4 layers, length 128"),
    CaseInfo("reference_models.bench:deep_narrow", "bench", "reference",
             "120 Linear+ReLU blocks on small activations: ~1,450 tensors a step"),
]
