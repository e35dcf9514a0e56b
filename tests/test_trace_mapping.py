"""A trace is read as a mapping of its sites, as h5py's Group is: ``trace[site]`` gives that
site's records of every step, ``in`` and iteration go over the sites that hold records."""

import pytest
import torch
from torch import nn

from layerdiff import Case, capture
from layerdiff.trace import Trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    case = Case(model=model, inputs={"input": torch.randn(5, 4)},
                loss_fn=lambda out: out.square().mean(), steps=2,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="seq")
    return Trace(capture(case, tmp_path_factory.mktemp("map") / "t.h5", progress=False))


def test_a_site_gives_its_records_of_every_step(trace):
    rows = trace["0#0"]
    assert set(rows["site"]) == {"0#0"} and set(rows["step"]) == {0, 1}
    assert {"input", "output", "weight", "grad_output", "weight_grad"} <= set(rows["role"])
    assert rows.equals(trace.records(site="0#0"))


def test_sites_iterate_in_recording_order_and_answer_in(trace):
    assert list(trace)[:2] == ["<root>#0", "0#0"]
    assert "2#0" in trace and "3#0" not in trace and 0 not in trace
    assert dict(trace.items()).keys() == set(trace.keys())


def test_an_unknown_site_is_a_key_error_naming_the_file_and_some_sites(trace):
    with pytest.raises(KeyError, match=r"t\.h5 records no site 'model\.0#0' \(its sites: "):
        trace["model.0#0"]
