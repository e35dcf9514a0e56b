"""Routing forced (layerdiff/capture/routes.py) on a toy mixture of experts: a forced top-k
returns the recorded experts with this run's own scores at them, leaves other top-k calls
alone, and a run that routes by other means is refused, not judged as if it were forced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layerdiff import Case, capture, diff
from layerdiff.capture.port import capture_port
from layerdiff.capture.routes import RouteForcer, RouteRecorder, StepsOf, forcer_from
from layerdiff.capture.run import run_case
from layerdiff.errors import CaptureError
from layerdiff.trace.routers import Route

TOKENS, DIM, EXPERTS, K = 6, 8, 4, 2


class Moe(nn.Module):
    """A router (gate), experts taking the chosen indices (the sibling that makes the router
    detectable), and the weighted sum in the block's own code; ``choose`` picks the experts."""

    def __init__(self, choose=None) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.choose = choose or (lambda probs: torch.topk(probs, K, dim=-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)
        weights, chosen = self.choose(probs)
        return torch.einsum("tkd,tk->td", self.experts(x, chosen), weights)


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * DIM ** -0.5)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,tkde->tke", x, self.w[chosen])


def _case(choose=None, name: str = "toy_moe") -> Case:
    torch.manual_seed(0)
    model = Moe(choose)
    x = torch.randn(TOKENS, DIM)
    return Case(model=model, inputs={"x": x}, loss_fn=lambda out: out.square().mean(),
                name=name)


def _elsewhere(chosen: np.ndarray) -> np.ndarray:
    """``chosen`` with token 1 sent to the two experts it did not choose."""
    moved = chosen.copy()
    moved[1] = sorted(set(range(EXPERTS)) - set(chosen[1].tolist()))
    return moved


def test_a_forced_top_k_returns_the_route_with_this_runs_own_scores_and_gradients():
    x = torch.randn(TOKENS, EXPERTS, requires_grad=True)
    probs = x.softmax(-1)
    own = torch.topk(probs, K).indices.numpy()
    route = _elsewhere(own)
    forcer = RouteForcer({0: [Route(0, "gate#0", EXPERTS, route)]})
    with forcer:
        values, chosen = torch.topk(x.softmax(-1), K, dim=-1)
        sampled = torch.randn(3, 50).topk(5)  # a sampler's top-k: not router-shaped
    assert chosen.numpy().tolist() == route.tolist()
    assert torch.equal(values, probs.gather(-1, chosen))  # this run's scores, the route's experts
    assert sampled.indices.shape == (3, 5)
    assert [(f.site, f.rerouted) for f in forcer.forced()] == [("gate#0", [1])]
    values.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_a_recorded_run_forced_into_itself_changes_nothing():
    recorder = RouteRecorder()
    with recorder:
        run_case(_case(), observer=StepsOf(recorder))
    forcer = RouteForcer(recorder.routes, "itself")
    with forcer:
        run_case(_case(), observer=StepsOf(forcer))
    forcer.check_taken(0, "the toy")
    assert [f.rerouted for f in forcer.forced()] == [[]]


def test_a_port_that_routes_without_top_k_is_refused_not_judged_as_forced(tmp_path):
    reference = capture(_case(), tmp_path / "ref.h5")

    def argmax_twice(probs):  # the same experts, chosen without torch.topk
        first = probs.argmax(-1, keepdim=True)
        second = probs.scatter(-1, first, -1.0).argmax(-1, keepdim=True)
        chosen = torch.cat([first, second], -1)
        return probs.gather(-1, chosen), chosen

    with pytest.raises(CaptureError) as refused:
        capture_port(_case(argmax_twice, "argmax_port"), tmp_path / "port.h5",
                     weights_from=reference, force_routing=reference, progress=False)
    said = str(refused.value)
    assert "routes by other means" in said and "gate#0" in said and "top-2 over (6, 4)" in said
    assert not (tmp_path / "port.h5").exists()


def test_a_trace_without_a_router_is_refused_in_one_sentence(tmp_path):
    plain = Case(model=nn.Linear(DIM, DIM), inputs={"input": torch.randn(2, DIM)},
                 loss_fn=lambda out: out.sum(), name="plain")
    trace = capture(plain, tmp_path / "plain.h5")
    with pytest.raises(CaptureError, match="records no router whose routes can be read"):
        forcer_from(trace)


def test_forcing_the_references_routes_passes_a_port_whose_only_difference_is_routing(
        tmp_path):
    """A selection-only bias (DeepSeek-V3's load balancing adds one to the scores it picks
    from, not to the weights) that sends token 1 elsewhere: unforced the diff fails, forced it
    passes and says that one token was moved back."""
    reference = capture(_case(), tmp_path / "ref.h5")
    route = forcer_from(reference).routes[0][0].chosen
    others = _elsewhere(route)[1]

    def biased(probs):
        bias = torch.zeros_like(probs)
        bias[1, others] = 1.0
        _, chosen = torch.topk(probs + bias, K, dim=-1)
        return probs.gather(-1, chosen), chosen

    port = capture_port(_case(biased, "biased"), tmp_path / "port.h5", weights_from=reference,
                        progress=False)
    assert not diff(reference, port)
    said = []
    forced = capture_port(_case(biased, "biased"), tmp_path / "forced.h5",
                          weights_from=reference, force_routing=reference,
                          on_forced=said.append, progress=False)
    result = diff(reference, forced)
    assert result, result.origins
    assert result.meta["forced_routing"] == {"port": {"from": str(reference), "routes": 1}}
    assert said == ["1 router call forced; 1 token went to other experts than this run's own "
                    "router chose (gate#0: 1 of 6 tokens)"]


def test_the_references_routes_forced_into_a_port_with_a_wrong_expert_still_fail(tmp_path):
    """Forcing takes routing out of the comparison, never a bug in the experts."""
    reference = capture(_case(), tmp_path / "ref.h5")
    case = _case(name="wrong_expert")
    with torch.no_grad():
        case.model.experts.w[2] *= 1.01
    forced = capture(case, tmp_path / "forced.h5", force_routing=forcer_from(reference))
    result = diff(reference, forced)
    assert not result and result.origin.site == "experts#0"


def toy_reference() -> Case:
    return _case(name="tests.test_routes:toy_reference")


def toy_plain() -> Case:
    return Case(model=nn.Linear(DIM, DIM), inputs={"input": torch.randn(2, DIM)},
                loss_fn=lambda out: out.sum(), name="tests.test_routes:toy_plain")


def test_the_commands_take_force_routing_and_say_what_it_did(run, tmp_path):
    reference = tmp_path / "ref.h5"
    assert run("capture", "tests.test_routes:toy_reference", "-o", reference).exit_code == 0
    done = run("capture", "tests.test_routes:toy_reference", "-o", tmp_path / "forced.h5",
               "--weights-from", reference, "--force-routing", reference)
    assert done.exit_code == 0, done.output
    assert (f"routing from {reference}: 1 router call forced; every token went where this "
            "run's own router sent it") in done.output
    shown = run("diff", reference, tmp_path / "forced.h5")
    assert shown.exit_code == 0 and "routing forced: the port ran with the routes" in shown.output
    done = run("replay", reference, "tests.test_routes:toy_reference", "--force-routing")
    assert done.exit_code == 0 and "--force-routing: 1 router call forced" in done.output
    plain = tmp_path / "plain.h5"
    assert run("capture", "tests.test_routes:toy_plain", "-o", plain).exit_code == 0
    refused = run("replay", plain, "tests.test_routes:toy_plain", "--force-routing")
    assert refused.exit_code == 2
    assert f"--force-routing: {plain} records no router whose routes can be read" in \
        refused.output
    assert "Traceback" not in refused.output


def _renormalised(probs):
    values, chosen = torch.topk(probs, K, dim=-1)
    return values / values.sum(-1, keepdim=True), chosen


@pytest.mark.parametrize(("reference_choice", "port_choice", "said"), [
    (_renormalised, None, "times the sum of its top-2 router probabilities"),
    (None, _renormalised, "divided by the sum of its top-2 router probabilities"),
])
def test_routing_weights_normalised_otherwise_are_named_with_the_routers_numbers(
        tmp_path, reference_choice, port_choice, said):
    reference = capture(_case(reference_choice, "ref"), tmp_path / "ref.h5")
    port = capture_port(_case(port_choice, "port"), tmp_path / "port.h5",
                        weights_from=reference, progress=False)
    result = diff(reference, port)
    assert not result and result.origin.site == "<root>#0"
    assert result.origin.hint["kind"] == "routing-weights"
    assert said in result.origin.hint["evidence"]
    assert "every element is within tolerance" in result.origin.hint["evidence"]


def test_a_wrong_expert_is_not_taken_for_routing_weights(tmp_path):
    reference = capture(_case(), tmp_path / "ref.h5")
    case = _case(name="wrong_expert")
    with torch.no_grad():
        case.model.experts.w[2] *= 1.5
    result = diff(reference, capture(case, tmp_path / "port.h5"))
    assert not result
    assert all((o.hint or {}).get("kind") != "routing-weights" for o in result.origins)
