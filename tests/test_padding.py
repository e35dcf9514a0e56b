"""Padding positions (layerdiff/compare/padding.py): a tiny encoder fed a batch padded to one
length, with a root ``attention_mask`` and a loss that ignores padded positions (labels -100).

- ``fill``: the port adds -1e4 to masked scores where the reference fills them with the
  dtype's minimum. A padded query attends to nothing: the reference's row is uniform, the
  port's is the softmax of its scores. Only padded positions differ, and the reference's
  gradient is exactly zero there: PASS, the records set apart.
- ``off_by_one``: the port's key mask lets the first padding position through, so real
  tokens attend to a padding key: FAIL at the attention.
- ``minus_inf``: the port fills with -inf; a padded query's row is then NaN, and the
  loss's backward turns it into NaN gradients (0 x NaN) that reach the weight gradients: FAIL.
- the ``fill`` port captured without a backward pass: nothing shows padding unused, so it
  still fails, and the diff says why.
- ``keys_seen``: a reference whose real tokens attend to padding keys, and a port that zeroes
  the embeddings at padding before the attention. The loss reads no padded position of the
  output, but the attention reads the padded inputs: their own gradient is not zero, so they
  are not excused, and the origin is the root's own code that zeroes them.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, diff, seed_everything
from layerdiff.compare.judge import Verdict
from layerdiff.errors import DiffError
from layerdiff.report.terminal import format_diff

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, WIDTH, LENGTH, LENGTHS, IGNORED = 16, 16, 12, (12, 9, 6), -100
PADDED = sum(LENGTH - n for n in LENGTHS)  # 9 (batch, position) pairs


class MaskedAttention(nn.Module):
    """One bidirectional head; a query or key at a padded position is masked."""

    def __init__(self, fill: str = "min", off_by_one: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.fill, self.off_by_one = fill, off_by_one

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        keys = mask.bool()
        if self.off_by_one:
            keys = keys | keys.roll(1, dims=1)  # BUG: one padding key let through
        allowed = mask.bool()[:, :, None] & keys[:, None, :]
        scores = (q @ k.transpose(-2, -1)) / WIDTH ** 0.5
        if self.fill == "min":
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        elif self.fill == "add":
            scores = scores + (~allowed) * -1e4
        else:
            scores = scores.masked_fill(~allowed, float("-inf"))
        return scores.softmax(-1) @ v


class KeysSeen(MaskedAttention):
    """Only padded queries are masked: real tokens attend to padding keys too."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        allowed = mask.bool()[:, :, None].expand(-1, -1, x.size(1))
        scores = (q @ k.transpose(-2, -1)) / WIDTH ** 0.5
        return scores.masked_fill(~allowed, torch.finfo(scores.dtype).min).softmax(-1) @ v


class Encoder(nn.Module):
    def __init__(self, mixer: nn.Module, zero_padding: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mixer = mixer
        self.head = nn.Linear(WIDTH, VOCAB)
        self.zero_padding = zero_padding

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.zero_padding:  # the port's own code: padding embeddings set to zero
            x = x * attention_mask[..., None]
        return self.head(self.mixer(x, attention_mask))


def reference(backward: bool = True) -> Case:
    seed_everything(0)
    model = Encoder(MaskedAttention())
    mask = (torch.arange(LENGTH)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    ids = torch.randint(1, VOCAB, mask.shape) * mask
    labels = torch.randint(0, VOCAB, ids.shape).masked_fill(mask == 0, IGNORED)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                               ignore_index=IGNORED)
        # forward only: the same loss, but no gradient reaches the model
        return loss if backward else loss.detach().requires_grad_()

    return Case(model=model, inputs={"input_ids": ids, "attention_mask": mask},
                loss_fn=loss_fn, seed=0, steps=1, name="padding_reference")


def port(mixer: MaskedAttention, backward: bool = True, zero_padding: bool = False) -> Case:
    case = reference(backward)
    model = Encoder(mixer, zero_padding)
    model.load_state_dict(case.model.state_dict())
    return dataclasses.replace(case, model=model, name="padding_port")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("padding")
    cases = {"reference": reference(), "fill": port(MaskedAttention(fill="add")),
             "off_by_one": port(MaskedAttention(off_by_one=True)),
             "minus_inf": port(MaskedAttention(fill="inf")),
             "reference_forward": reference(backward=False),
             "fill_forward": port(MaskedAttention(fill="add"), backward=False),
             "keys_seen_reference": port(KeysSeen()),
             "keys_seen": port(KeysSeen(), zero_padding=True)}
    return {name: capture(case, folder / f"{name}.h5") for name, case in cases.items()}


@pytest.fixture(scope="module")
def fill(traces):
    return diff(traces["reference"], traces["fill"])


def test_a_port_that_differs_only_at_padding_passes_with_the_records_set_apart(fill):
    assert fill.passed and fill.origin is None
    rows = fill.rows.set_index(["site", "role"])
    excused = rows[rows["verdict"] == Verdict.PADDING]
    # what the attention computes for padded queries, and everything after it, positionwise
    assert set(excused.index) == {("mixer#0", "output"), ("head#0", "input"),
                                  ("head#0", "output"), ("<root>#0", "output")}
    assert (excused["ratio"] > 1e3).all()  # far out, but only where nothing reads it
    assert "differs only at padding positions" in excused.loc[("mixer#0", "output"), "note"]
    text = format_diff(fill)
    assert text.splitlines()[0].startswith("PASS  31 records within tolerance (largest error 0 ")
    assert text.splitlines()[0].endswith("; 4 differ only at padding")
    flat = " ".join(text.split())
    assert ("padding 4 records differ only at padding positions (worst 1.36e+04x tolerance "
            "there), where the reference's gradient (<root>#0 grad_output 0) is zero") in flat
    assert "mask: root input 'attention_mask'" in flat
    assert max(map(len, text.splitlines())) <= 100


def test_a_mask_off_by_one_still_fails_at_the_attention(traces):
    result = diff(traces["reference"], traces["off_by_one"])
    assert not result.passed and result.origin.site == "mixer#0"
    assert result.origin.role == "output" and result.origin.pass_ == "forward"
    assert not (result.rows["verdict"] == Verdict.PADDING).any()
    # real tokens are out: positions 0-5 hold no padding in any batch row
    assert min(result.origin.positions[:6]) > 1
    assert result.meta["padding"]["records"] == 0


def test_nan_at_padding_that_reaches_the_weight_gradients_fails(traces):
    result = diff(traces["reference"], traces["minus_inf"])
    assert not result.passed
    rows = result.rows.set_index(["site", "role", "arg"])
    # the forward NaN sits at padded queries only, which the loss does not read ...
    assert rows.loc[("mixer#0", "output", "0"), "verdict"] == Verdict.PADDING
    # ... but the loss's backward multiplies it by 0: NaN gradients, in every weight gradient
    assert rows.loc[("mixer.qkv#0", "weight_grad", "weight"), "verdict"] == Verdict.OUT
    assert result.meta["padding"]["non_finite"] == 4
    flat = " ".join(format_diff(result).split())
    assert "The port holds NaN or Inf there in 4 of them: a backward that multiplies" in flat


def test_without_a_backward_pass_padding_is_not_excluded_and_the_diff_says_why(traces):
    result = diff(traces["reference_forward"], traces["fill_forward"])
    assert not result.passed and result.origin.site == "mixer#0"
    found = result.meta["padding"]
    assert found["excluded"] is False and found["records"] == 0 and found["not_excluded"] == 4
    text = format_diff(result)
    flat = " ".join(text.split())
    assert ("padding 4 failing records differ only at padding positions (worst 1.36e+04x "
            "tolerance there; mask: root input 'attention_mask'), but they were not excluded "
            "from the verdict: the reference trace has no backward pass") in flat
    assert flat.count("no backward pass") == 1
    assert max(map(len, text.splitlines())) <= 100


def test_padding_a_layer_reads_is_not_excused_though_the_loss_reads_none_of_it(traces):
    result = diff(traces["keys_seen_reference"], traces["keys_seen"])
    assert result.meta["padding"]["unused"] == {"0": PADDED}  # at the root's output ...
    # ... but the attention's input at padding has a gradient: the attention reads it
    assert result.meta["padding"]["records"] == 0
    assert not (result.rows["verdict"] == Verdict.PADDING).any()
    rows = result.rows.set_index(["site", "role", "arg"])
    assert rows.loc[("mixer#0", "input", "0"), "verdict"] == Verdict.OUT
    assert result.origin.site == "<root>#0" and result.origin.pass_ == "forward"


def test_the_json_carries_the_mask_the_records_and_the_padding_positions(fill):
    data = json.loads(json.dumps(fill.as_json()))
    found = data["meta"]["padding"]
    assert found["mask"] == "attention_mask" and not found["declared"]
    assert found["padded"] == {"0": PADDED} and found["unused"] == {"0": PADDED}
    assert found["records"] == 4 and found["excluded"] and found["worst"] > 1e3
    assert found["padded_positions"]["0"] == [False] * 6 + [True] * 6
    verdicts = {(row["site"], row["role"]): row["verdict"] for row in data["rows"]}
    assert verdicts[("mixer#0", "output")] == "padding-only"
    entry = next(e for e in data["positions"] if (e["site"], e["role"]) == ("mixer#0", "output"))
    assert entry["padding"] == [False] * 6 + [True] * 6
    assert entry["padding_ratios"][:6] == [None] * 6 and min(entry["padding_ratios"][6:]) > 1


def test_declared_or_turned_off(traces, fill):
    declared = diff(traces["reference"], traces["fill"], padding_mask="attention_mask")
    assert declared.passed and declared.meta["padding"]["declared"]
    off = diff(traces["reference"], traces["fill"], padding_mask=False)
    assert not off.passed and off.origin.site == "mixer#0" and off.meta["padding"] is None
    with pytest.raises(DiffError, match=r"records no input 'mask' of <root>#0 .*its inputs: "
                       r"input_ids, attention_mask"):
        diff(traces["reference"], traces["fill"], padding_mask="mask")
    with pytest.raises(DiffError, match=r"no \(batch, length\) tensor of 0s and 1s"):
        diff(traces["reference"], traces["fill"], padding_mask="input_ids")


def test_the_command_line_and_the_heatmap(traces, run, tmp_path):
    page = tmp_path / "report.html"
    done = run("diff", traces["reference"], traces["fill"], "--html", page)
    assert done.exit_code == 0 and "4 differ only at padding" in done.output
    html = page.read_text()
    start = html.index('id="position-errors">') + len('id="position-errors">')
    data = json.loads(html[start:html.index("</script>", start)])
    assert len(data["padding_only_rows"]) == 4
    assert np.array(data["padding"])[:, 6:].all() and not np.array(data["padding"])[:, :6].any()
    assert "Hatched cells are padding positions" in html
    off = run("diff", traces["reference"], traces["fill"], "--no-padding-mask")
    assert off.exit_code == 1 and "origin: mixer#0" in off.output
    both = run("diff", traces["reference"], traces["fill"], "--no-padding-mask",
               "--padding-mask", "attention_mask")
    assert both.exit_code == 2


def test_replay_of_a_port_that_differs_only_at_padding_lists_no_local_error(traces):
    """Replay judges its table by the diff's verdicts: a layer out only at padding the loss
    leaves unused was 'LOCAL ERROR' in the table under a PASS headline."""
    from layerdiff.replay import replay
    result = replay(traces["reference"], port(MaskedAttention(fill="add")))
    assert result
    assert "LOCAL ERROR" not in set(result.local["verdict"]), result.local
