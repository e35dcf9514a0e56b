"""A trace layerdiff wrote, and did not flag as incomplete, is never refused as damaged.

Captured and read back verified (every tensor checked against its digest and statistics, as
a reader does): models holding what real models hold at the ends of the float ranges (an HF
causal mask of the dtype's lowest value, gradients whose squares are subnormal in float32,
activations near float32's largest value), in every dtype ``capture --dtype`` offers, in
summary and full traces; each diffs against itself as identical (a summary, which holds no
bytes to compare, as same-digest). Then every bundled case (reference_models/catalog.py, and
the Hugging Face cases) in every dtype (marked slow).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, TraceWriter, diff, seed_everything
from layerdiff.capture import capture
from layerdiff.capture.precision import cast_case
from layerdiff.case import ExternalCase, load_case
from layerdiff.errors import CaptureError
from layerdiff.trace import stats
from layerdiff.trace.reader import open_trace
from reference_models.catalog import CATALOG

DTYPES = [None, "float64", "float32", "bfloat16", "float16"]  # None: the case as it is built


# ------------------------------------------------------------------ the crafted cases

class MaskedAttention(nn.Module):
    """Causal attention masked the Hugging Face way: scores plus a mask holding the dtype's
    lowest value above the diagonal, the mask passed as an argument (so it is recorded)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1]) + mask
        return scores.softmax(dim=-1) @ v


class MaskedModel(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attn = MaskedAttention(width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[1]
        lowest = torch.finfo(x.dtype).min  # as transformers' _prepare_4d_causal_attention_mask
        mask = torch.full((size, size), lowest, dtype=x.dtype).triu(1)[None]
        return self.out(self.attn(x, mask))


def _sgd(parameters):
    return torch.optim.SGD(parameters, lr=0.1)


def finfo_min_mask() -> Case:
    seed_everything(0)
    return Case(model=MaskedModel(), inputs=(torch.randn(2, 6, 8),),
                loss_fn=lambda out: out.float().pow(2).mean(), optimizer=_sgd,
                name=f"{__name__}:finfo_min_mask")


def vanishing_gradients() -> Case:
    """A deep narrow tanh stack with a loss scaled to 1e-22: its gradients are ~1e-23, whose
    squares (~1e-46, down to float32's smallest subnormal) are far below float32's normal
    range (deep_narrow's, in the issue, are ~1e-22)."""
    seed_everything(0)
    layers = [m for _ in range(6) for m in (nn.Linear(8, 8), nn.Tanh())]
    return Case(model=nn.Sequential(*layers), inputs=(torch.randn(4, 8),),
                loss_fn=lambda out: out.float().pow(2).mean() * 1e-22, optimizer=_sgd,
                name=f"{__name__}:vanishing_gradients")


class NearMax(nn.Module):
    """Activations between 1.6e38 and 3.2e38, near float32's largest value (3.4e38)."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.big = nn.Linear(width, width, bias=False)
        with torch.no_grad():
            self.big.weight.fill_(4e37)
        self.act = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.big(x))


def near_float32_max() -> Case:
    seed_everything(0)
    return Case(model=NearMax(), inputs=(torch.rand(3, 8) * 0.5 + 0.5,),
                loss_fn=lambda out: (out.float() * 1e-30).sum(), optimizer=_sgd,
                name=f"{__name__}:near_float32_max")


CRAFTED = [f"{__name__}:{name}" for name in ("finfo_min_mask", "vanishing_gradients",
                                             "near_float32_max")]


def _read_everything(path: Path) -> int:
    """Open ``path`` verified and read every stored tensor (each checked against its digest
    and its statistics), with the compiled statistics and with numpy's (what a process that
    has not loaded numba checks small records with); returns how many. Raises what a reader
    raises."""
    counts = []
    with pytest.MonkeyPatch.context() as patch:
        for env in ("", "numpy"):
            patch.setenv("LAYERDIFF_STATS", env)
            stats.compiled.cache_clear()
            trace = open_trace(path)
            try:
                index = trace.index
                stored = index[(index["kind"] == "tensor") & (index["segment"] >= 0)]
                for position in range(len(stored)):
                    trace.read(stored.iloc[position])
                counts.append(len(stored))
            finally:
                trace.close()
    stats.compiled.cache_clear()
    return counts[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d or "as-built")
@pytest.mark.parametrize("spec", CRAFTED, ids=lambda s: s.split(":")[1])
def test_crafted_extremes_capture_read_back_and_diff_as_identical(spec, dtype, run, tmp_path):
    dtype_option = ["--dtype", dtype] if dtype else []
    for summary in (False, True):
        path = tmp_path / ("summary.h5" if summary else "full.h5")
        captured = run("capture", spec, "-o", path, *dtype_option,
                       *(["--summary"] if summary else []))
        assert captured.exit_code == 0, captured.output
        if not summary:
            assert _read_everything(path) > 0
        assert len(open_trace(path, verify=False).index)  # the refusal came from here too
        shown = run("show", path)
        assert shown.exit_code == 0, shown.output
        copy = tmp_path / f"copy-{path.name}"
        shutil.copyfile(path, copy)
        compared = run("diff", path, copy)
        assert compared.exit_code == 0, compared.output
        result = diff(path, copy)
        assert result.passed
        floats = result.rows[result.rows["dtype"].astype(str).str.contains("float")]
        # a summary holds no bytes to compare: its records agree by their digests alone
        assert (floats["verdict"] == ("same-digest" if summary else "identical")).all()


def test_a_finfo_min_mask_in_float64_is_what_the_index_says(tmp_path):
    """The issue's first reproducer: the float64 mask's statistics are finite except its L2
    norm, which exceeds float64's range (sqrt(15) * 1.8e308) and is stored as inf."""
    case = load_case(CRAFTED[0])
    cast_case(case, "float64")
    path = capture(case, tmp_path / "t.h5", dtype="float64", summary=True)
    index = open_trace(path).index
    mask = index[(index["site"] == "attn#0") & (index["arg"] == "1")].iloc[0]
    lowest = float(torch.finfo(torch.float64).min)
    assert (mask["min"], mask["max"], mask["nan"], mask["inf"]) == (lowest, 0.0, 0, 0)
    assert mask["mean"] == pytest.approx(lowest / 36 * 15, rel=1e-12)  # 15 of 36 masked
    assert math.isfinite(mask["std"]) and mask["std"] > 0
    assert mask["l2"] == math.inf


@pytest.mark.parametrize("spec", CRAFTED, ids=lambda s: s.split(":")[1])
def test_diverge_with_its_float64_golden_runs_on_extremes(spec, run, tmp_path):
    """diverge captures a float64 golden of the reference by default: it exited 2 on a model
    with an HF mask ("non-finite statistic ... the file is damaged")."""
    result = run("diverge", spec, spec, "--steps", "2", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "no step differs" in result.output


def test_hf_llama_in_float64_reads_back(run, tmp_path):
    """The issue's reproducer with transformers' own mask (eager attention)."""
    pytest.importorskip("transformers")
    path = tmp_path / "llama.h5"
    captured = run("capture", "reference_models.hf_llama:reference", "--dtype", "float64",
                   "-o", path)
    assert captured.exit_code == 0, captured.output
    assert _read_everything(path) > 0
    copy = tmp_path / "copy.h5"
    shutil.copyfile(path, copy)
    assert run("diff", path, copy).exit_code == 0
    assert run("show", path).exit_code == 0


# ------------------------------------------------------------------ every bundled case

# (spec, dtype) pairs capture refuses, each with one sentence (a CaptureError), for reasons
# that are the model's and not the trace's: masks filled with a float32 constant float16
# cannot hold; a planted bug that runs one layer in a fixed dtype.
_FLOAT16_MASK_OVERFLOW = {"reference_models.transformer:reference",
                          "reference_models.transformer:reference_large",
                          "reference_models.transformer_port:port_manual",
                          "reference_models.transformer_port:bug_softmax_axis",
                          "reference_models.transformer_port:bug_missing_scale",
                          "reference_models.transformer_port:bug_inverted_mask"}
REFUSED = ({(spec, "float16") for spec in _FLOAT16_MASK_OVERFLOW}
           | {("reference_models.hint_bugs:mlp_bf16_layer", d)
              for d in ("float64", "bfloat16", "float16")})
BUNDLED = [info.spec for info in CATALOG] + ["reference_models.hf_llama:reference",
                                             "reference_models.hf_gpt2:reference"]


# the large case is here for its tensor sizes (many segments, wide tables): as built and in
# bfloat16; its float64 and float32 paths are the small reference's too (14 s of the suite)
WIDE_LARGE = {("reference_models.transformer:reference_large", d) for d in ("float64", "float32")}


@pytest.mark.slow
@pytest.mark.parametrize(("spec", "dtype"), [
    pytest.param(spec, dtype, id=f"{spec}-{dtype or 'as-built'}") for spec in BUNDLED
    for dtype in DTYPES if (spec, dtype) not in WIDE_LARGE])
def test_every_bundled_case_reads_back_verified(spec, dtype, tmp_path):
    if spec.startswith("reference_models.hf_"):
        pytest.importorskip("transformers")
    for summary in (False, True):
        case = load_case(spec)
        if isinstance(case, ExternalCase) and dtype:
            pytest.skip("a port that records itself: --dtype does not apply to it")
        if dtype:
            cast_case(case, dtype)
        path = tmp_path / f"{summary}.h5"
        if (spec, dtype) in REFUSED:
            with pytest.raises(CaptureError, match="the model raised"):
                capture(case, path, dtype=dtype, steps=1, summary=summary)
            return
        capture(case, path, dtype=dtype, steps=1, summary=summary)
        if summary:
            assert len(open_trace(path).index)  # verified: the index's own checks
        else:
            assert _read_everything(path) > 0


@pytest.mark.parametrize("summary", [True, False])
def test_a_float64_record_whose_norm_overflows_is_still_judged(tmp_path, summary):
    """Values near 1e160 in float64: their squares overflow, so the index's L2 is inf. The
    diff judges the record by its rms all the same (sqrt(mean^2 + std^2)); before, the origin
    rule's squares raised OverflowError and the baseline's allowance became infinite."""
    x = np.linspace(1, 2, 64) * 1e160

    def write(name, values):
        with TraceWriter(tmp_path / name, meta={}, summary=summary) as writer, \
                writer.site("fc") as site:
            writer.record(site, "output", values)
        return tmp_path / name

    ref = write("ref.h5", x)
    assert diff(ref, write("same.h5", x.copy())).passed
    off = diff(ref, write("off.h5", x * 1.01))
    assert not off.passed and off.origin.site == "fc#0"
