"""MoE routing compared as decisions (layerdiff/compare/routing.py), on the MoE validation pair
with a planted near-tie: layer 0's router scores for one token (moe_cases.TIE_TOKEN) are made
to differ by 2e-4 on one bfloat16 value. A port that runs its router softmax and top-k in
bfloat16 then sends that token to another expert; the faithful float32 port does not."""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from layerdiff import capture, diff
from layerdiff.capture.port import capture_port
from layerdiff.capture.routes import forcer_from
from layerdiff.compare.judge import Verdict
from layerdiff.errors import MappingError
from layerdiff.mapping import Mapping
from layerdiff.replay import replay, swap
from layerdiff.report.findings.diff import describe_origin
from layerdiff.report.html import render_html
from layerdiff.report.terminal import format_diff
from tests.validation import moe_cases as cases

MAP = Path(__file__).resolve().parent / "validation" / "moe.map.toml"
ROUTER0 = "model.layers.0.mlp.gate#0"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("routing")
    reference = capture(cases.reference_near_tie(), folder / "ref.h5", loss_scale=2**20,
                        progress=False)
    made = {name: capture_port(getattr(cases, name)(), folder / f"{name}.h5",
                               weights_from=reference, mapping=MAP, progress=False)
            for name in ("port", "port_router_bf16", "port_chooses_in_bf16")}
    made["baseline"] = capture_port(cases.reference_router_bf16(), folder / "baseline.h5",
                                    loss_scale=2**20, progress=False)
    return reference, made


@pytest.fixture(scope="module")
def flipped(traces):
    reference, made = traces
    return diff(reference, made["port_router_bf16"], mapping=MAP)


def _index_rows(result):
    rows = result.rows
    return rows[rows["dtype"].astype(str).str.startswith("int")
                & rows["site"].str.endswith("mlp.experts#0")]


def test_the_faithful_float32_port_makes_no_flip_on_the_near_tie(traces):
    reference, made = traces
    result = diff(reference, made["port"], mapping=MAP)
    assert result, [describe_origin(o) for o in result.origins]
    assert result.meta["routing"] == []
    assert "routing:" not in format_diff(result)
    index = _index_rows(result)
    assert len(index) == 2 and index["ratio"].isna().all()
    assert index["note"].str.startswith("decision: the same top-2 experts for all 20").all()


def test_a_bfloat16_router_flips_the_near_tie_and_the_origin_says_so(flipped):
    assert not flipped
    origin = flipped.origin
    assert origin.site == "model.layers.0.mlp#0" and origin.pass_ == "forward"
    assert origin.routing is not None, describe_origin(origin)
    assert origin.routing["router"] == ROUTER0
    assert tuple(origin.routing["position"]) == cases.TIE_TOKEN
    assert origin.routing["reference"] != origin.routing["port"]
    text = origin.routing["text"]
    assert text.startswith(f"layer 0, token (b={cases.TIE_TOKEN[0]}, t={cases.TIE_TOKEN[1]}): "
                           "experts {"), text
    assert "the port's router scores tie in bfloat16" in text, text
    # the routers only: not the MoE block that holds one (its output's top 2 are no experts)
    assert {r["site"] for r in flipped.meta["routing"]} <= {ROUTER0, "model.layers.1.mlp.gate#0"}
    layer0 = next(r for r in flipped.meta["routing"] if r["site"] == ROUTER0)
    assert len(layer0["flips"]) == 1
    flip = layer0["flips"][0]
    assert tuple(flip["position"]) == cases.TIE_TOKEN and not flip["shared"]
    assert flip["tie"] == "bfloat16" and flip["reference"] != flip["port"]
    assert math.isclose(flip["reference_margin"], cases.TIE_GAP, rel_tol=0.05)
    for router in flipped.meta["routing"]:  # layer 1's flips follow layer 0's: said so
        if router["site"] != ROUTER0:
            assert all("the router's input already differs" in f["why"] for f in
                       router["flips"]), router["flips"]
    report = format_diff(flipped)
    assert f"routing flip: {text[:40]}" in report.replace("\n        ", " ")
    assert "routing: tokens whose top-k experts differ" in report
    assert "Routing flip: layer 0, token (b=1, t=6)" in render_html(flipped)
    as_json = json.loads(json.dumps(flipped.as_json()))
    assert as_json["origins"][0]["routing"]["position"] == list(cases.TIE_TOKEN)


def test_index_records_are_decisions_never_a_ratio(flipped):
    index = _index_rows(flipped)
    assert len(index) == 2 and index["ratio"].isna().all() and index["max_abs"].isna().all()
    layer0 = index[index["site"] == "model.layers.0.mlp.experts#0"].iloc[0]
    assert layer0["verdict"] == Verdict.OUT
    assert layer0["note"].startswith("decision differs: 1 of 20 tokens"), layer0["note"]


def test_a_baseline_that_makes_the_same_flip_keeps_the_port_passing(traces):
    reference, made = traces
    result = diff(reference, made["port_router_bf16"], mapping=MAP,
                  baseline=made["baseline"])
    assert result, [describe_origin(o) for o in result.origins]
    flips = [flip for router in result.meta["routing"] for flip in router["flips"]]
    assert any(tuple(f["position"]) == cases.TIE_TOKEN for f in flips)
    assert all(f["shared"] for f in flips), flips
    assert (_index_rows(result)["verdict"] == Verdict.WITHIN).all()
    assert "the baseline makes the same flip (within precision)" in \
        format_diff(result).replace("\n      ", " ")


def test_a_declared_router_is_compared_as_the_detected_one(traces, flipped):
    reference, made = traces
    text = MAP.read_text(encoding="utf-8") + (
        '\n[[router]]\nsite = "model.layers.*.mlp.gate"\nk = 2\n')
    mapping = Mapping.from_text(text, "moe.map.toml", recorded_in=None)
    assert [rule.k for rule in mapping.routers] == [2]
    result = diff(reference, made["port_router_bf16"], mapping=mapping)
    assert result.meta["routing"] == flipped.meta["routing"]


@pytest.mark.parametrize(("body", "said"), [
    ('site = "m.layers.*.gate"\nk = 2\ntopk = 2', "topk"),
    ('site = "m.layers.*.gate"\nk = 0', "'k' as a positive integer"),
    ('site = "m.layers.0.gate#0"\nk = 2', "names a call"),
    ("k = 2", "needs 'site'"),
])
def test_a_malformed_router_rule_is_refused_with_its_line(body, said):
    with pytest.raises(MappingError, match="router rule 1") as error:
        Mapping.from_text(f"version = 1\n\n[[router]]\n{body}\n", "bad.map.toml",
                          recorded_in="")
    assert said in str(error.value) and "line" in str(error.value), str(error.value)


def test_the_flip_leads_the_origin_and_says_whether_it_explains_all_of_it(flipped):
    """The bf16 router's flip leads (the precision first), with the baseline command; the
    origin's error outside the flipped token is still out here (the router's bfloat16 softmax
    weights every token), so the own-code reason stays, qualified by that number."""
    origin = flipped.origin
    routing = origin.routing
    assert routing["tie"] == "bfloat16" and routing["confined"] is False, routing
    assert 1 < routing["outside_ratio"] < 1e-2 * origin.metrics["ratio"], routing
    assert "--baseline" in routing["baseline_command"], routing
    lead = ("the port's router decides in bfloat16: a near-tie (margin 0.0002 in the "
            "reference) flips token (b=1, t=6); everything downstream of that token differs "
            "without any wrong code there")
    assert routing["lead"].startswith(lead), routing["lead"]
    assert origin.reason.startswith("outside the flipped token it is still out ("), origin.reason
    report = " ".join(format_diff(flipped).split())
    said = report.index(lead)
    assert said < report.index("routing flip: layer 0") < report.index("outside the flipped")
    assert said < report.index("so the fault is in its own code")
    page = " ".join(render_html(flipped).split())
    assert escape(lead) in page and escape("The port's router decides in bfloat16") in page
    as_json = json.loads(json.dumps(flipped.as_json()))["origins"][0]["routing"]
    assert as_json["confined"] is False and as_json["lead"] == routing["lead"]


class _Reader:
    """Stands in for the diff's PairReader: one origin's tensors."""

    def __init__(self, ref, port):
        self.pair = (ref, port)

    def read(self, row, compared=False):
        return self.pair


def _origin_with(flip, port):
    import numpy as np

    from layerdiff.compare.result import Origin
    from layerdiff.compare.routing import RouterReport, _lead
    report = RouterReport(0, ROUTER0, "layers.0.block_sparse_moe.gate#0", 2, 4, 20, "", [],
                          [], [flip])
    origin = Origin(0, "forward", "model.layers.0.mlp#0", "layers.0.block_sparse_moe#0",
                    "output", "0", "0", "so the fault is in its own code between its children",
                    {"rtol": 1e-5, "atol": 1e-5}, routing={})
    ref = np.ones((2, 10, 8))
    _lead(origin, report, flip, _Reader(ref, ref + port), ["layerdiff", "diff", "r.h5", "p.h5"])
    return origin


def test_an_error_confined_to_the_flipped_token_drops_the_own_code_reason():
    import numpy as np

    from layerdiff.compare.routing import Flip
    tie = Flip(16, (1, 6), [1, 2], [1, 3], None, 2e-4, 2e-4, False, "tie", "bfloat16")
    error = np.zeros((2, 10, 8))
    error[1, 6] = 0.5  # on the flipped token only
    origin = _origin_with(tie, error)
    assert origin.routing["confined"] is True and origin.routing["outside_ratio"] == 0
    assert "own code" not in origin.reason and "only at the flipped token" in origin.reason
    assert origin.routing["baseline_command"] == \
        "layerdiff diff r.h5 p.h5 --baseline r.router-bfloat16.h5"
    error[0, 0] = 0.5  # and elsewhere: the reason stays, after the number
    assert _origin_with(tie, error).routing["confined"] is False
    ranked = Flip(16, (1, 6), [1, 2], [1, 3], None, 0.5, 0.1, False, "ranked", "")
    lead = _origin_with(ranked, np.zeros((2, 10, 8))).routing["lead"]
    assert "the router's inputs or weights differ" in lead
    assert "layers.0.block_sparse_moe.gate#0" in lead, lead


# ---------------------------------------------------------------- routing replay (forced routes)

def test_routing_replay_passes_a_port_whose_only_difference_is_routing(traces, tmp_path):
    """port_chooses_in_bf16 picks its experts from bfloat16 probabilities (the near-tie flips)
    and weights them in float32: with the reference's routes forced, capture, replay and swap
    all pass it, and each says what forcing moved."""
    reference, made = traces
    unforced = diff(reference, made["port_chooses_in_bf16"], mapping=MAP)
    assert not unforced and unforced.origin.routing is not None
    said = []
    forced = capture_port(cases.port_chooses_in_bf16(), tmp_path / "forced.h5",
                          weights_from=reference, mapping=MAP, force_routing=reference,
                          on_forced=said.append, progress=False)
    result = diff(reference, forced, mapping=MAP)
    assert result, [describe_origin(o) for o in result.origins]
    assert "routing forced: the port ran with the routes recorded in" in format_diff(result)
    assert said == [f"2 router calls forced; 1 token went to other experts than this run's own "
                    f"router chose ({ROUTER0}: 1 of 20 tokens)"]

    replayed = replay(reference, cases.port_chooses_in_bf16(), mapping=MAP, propagated=False)
    assert not replayed and replayed.origin.site == "model.layers.0.mlp#0"
    assert any("holds the router model.layers.0.mlp.gate#0" in note and "--force-routing" in note
               for note in replayed.notes), replayed.notes
    replayed = replay(reference, cases.port_chooses_in_bf16(), mapping=MAP, propagated=False,
                      force_routing=True)
    assert replayed, replayed.diff.origins
    assert any(f"({ROUTER0}: 1 of 20 tokens)" in note for note in replayed.notes)

    block = ["layers.0.block_sparse_moe"]
    assert swap(cases.reference_near_tie, cases.port_chooses_in_bf16, block,
                mapping=MAP).breaks
    swapped = swap(cases.reference_near_tie, cases.port_chooses_in_bf16, block, mapping=MAP,
                   force_routing=True)
    assert swapped and "1 token went to other experts" in swapped.routing


def test_the_ports_routes_forced_into_the_reference_make_it_route_as_the_port(traces,
                                                                              tmp_path):
    """The other way round: the reference captured with the port's recorded routes (read from
    the port's trace, its router detected there) then matches the port that flipped."""
    _, made = traces
    port = made["port_chooses_in_bf16"]
    rerouted = capture(cases.reference_near_tie(), tmp_path / "ref.rerouted.h5",
                       loss_scale=2**20, force_routing=forcer_from(port), progress=False)
    result = diff(rerouted, port, mapping=MAP)
    assert result, [describe_origin(o) for o in result.origins]
    assert result.meta["forced_routing"]["reference"]["from"] == str(port)
