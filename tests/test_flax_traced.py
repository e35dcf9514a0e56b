"""Flax NNX captured inside traced code: a layer stack built with nnx.vmap and run with
nnx.scan, named layer by layer as torch names an nn.ModuleList and loaded from its per-layer
weights by one rule; and the step run under jax.jit, its records sent from inside the compiled
computation, where a slip that only tracing takes is found at its site."""

from __future__ import annotations

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.capture.port import capture_port  # noqa: E402
from layerdiff.trace import open_trace  # noqa: E402
from tests.flax_traces import assert_same_records  # noqa: E402

LAYERS, D = 3, 8
X = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
KEEP = np.ones(4, dtype=bool)

MAPPING = """
[[param]]
port = "*.kernel"
reference = "*.weight"
transform = "transpose"

[[param]]
port = "*.scale"
reference = "*.weight"
"""
# layer 1's square kernel loaded as it is: a slip in one layer's weights
UNTRANSPOSED_LAYER_1 = """
[[param]]
port = "layers.1.fc.kernel"
reference = "layers.1.fc.weight"
""" + MAPPING


class TorchBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc = torch.nn.Linear(D, D)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class TorchMaskRows(torch.nn.Module):
    def forward(self, y, keep):
        return y * keep[:, None]


class TorchStack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(5, D)
        self.layers = torch.nn.ModuleList(TorchBlock() for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, 3)
        self.mask_rows = TorchMaskRows()
        with torch.no_grad():
            for block in self.layers:  # affine parameters away from 1 and 0: a real load
                block.norm.weight.uniform_(0.5, 1.5)
                block.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x, keep):
        x = self.proj(x)
        for block in self.layers:
            x = block(x)
        return self.mask_rows(self.head(x), keep)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, tanh_slip: bool = False) -> None:
        self.norm = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)
        self.tanh_slip = tanh_slip

    def __call__(self, x):
        h = self.fc(self.norm(x))
        return x + (jax.nn.soft_sign(h) if self.tanh_slip else jnp.tanh(h))


class MaskRows(nnx.Module):
    """Rows of ``y`` where ``keep`` is False zeroed. A fast path skips the masking when it can
    see that every row is kept; the general path, which only traced code takes (the mask is a
    tracer there), has the slip: it multiplies in bfloat16."""

    def __init__(self, bf16_slip: bool = False) -> None:
        self.bf16_slip = bf16_slip

    def __call__(self, y, keep):
        if not isinstance(keep, jax.core.Tracer) and bool(np.all(np.asarray(keep))):
            return y
        dtype = jnp.bfloat16 if self.bf16_slip else y.dtype
        return (y.astype(dtype) * keep[:, None].astype(dtype)).astype(y.dtype)


class ScannedStack(nnx.Module):
    def __init__(self, *, tanh_slip: bool = False, bf16_slip: bool = False,
                 remat: bool = False) -> None:
        rngs = nnx.Rngs(0)
        self.remat = remat
        self.proj = nnx.Linear(5, D, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs, tanh_slip)

        self.layers = make(rngs)
        self.head = nnx.Linear(D, 3, rngs=rngs)
        self.mask_rows = MaskRows(bf16_slip)

    def __call__(self, x, keep):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return nnx.remat(lambda block, x: block(x))(block, x) if self.remat else block(x)

        return self.mask_rows(self.head(run(self.proj(x), self.layers)), keep)


def mean_square(y):
    return jnp.mean(y ** 2)


def port_case(*, jit: bool = False, steps: int = 1, **slips) -> layerdiff.Case:
    import optax

    return layerdiff.Case(model=ScannedStack(**slips), inputs=(X, KEEP), loss_fn=mean_square,
                          optimizer=optax.sgd(0.1), steps=steps, jit=jit, name="scanned")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("traced")


@pytest.fixture(scope="module")
def reference(work):
    case = layerdiff.Case(model=TorchStack(), inputs=(torch.from_numpy(X),
                                                      torch.from_numpy(KEEP)),
                          loss_fn=lambda y: (y ** 2).mean(),
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="torch_stack")
    return layerdiff.capture(case, work / "ref.h5", steps=2)


@pytest.fixture(scope="module")
def mapping(work):
    path = work / "stack.map.toml"
    path.write_text(MAPPING)
    return path


def capture(case, path, reference, mapping, **options):
    return capture_port(case, path, weights_from=reference, mapping=mapping, progress=False,
                        **options)


@pytest.fixture(scope="module")
def faithful(work, reference, mapping):
    return capture(port_case(), work / "port.h5", reference, mapping)


@pytest.fixture(scope="module")
def faithful_jit(work, reference, mapping):
    return capture(port_case(jit=True), work / "port_jit.h5", reference, mapping)


def tensor(trace, site: str, role: str, arg: str = "0", step: int = 0) -> np.ndarray:
    rows = trace.records(site=site)
    row = rows[(rows["role"] == role) & (rows["arg"] == arg) & (rows["step"] == step)]
    assert len(row) == 1, (site, role, arg)
    return np.asarray(trace.read(row.iloc[0]))


def origins(reference, port) -> list[tuple[str, str, str]]:
    result = layerdiff.diff(reference, port)
    return [(o.site, o.pass_, o.role) for o in result.origins]


def test_each_layer_of_a_scanned_stack_is_a_site_with_its_slice_of_the_weights(
        faithful, reference):
    with open_trace(faithful) as port, open_trace(reference) as ref:
        sites = list(port.sites["site"])
        for k in range(LAYERS):
            assert {f"layers.{k}#0", f"layers.{k}.norm#0", f"layers.{k}.fc#0"} <= set(sites)
        assert sites.index("layers.0#0") < sites.index("layers.1#0") < sites.index(
            "layers.2#0")
        for k in range(LAYERS):
            site = f"layers.{k}.fc#0"
            kernel = tensor(port, site, "weight", "kernel")
            np.testing.assert_array_equal(kernel, tensor(ref, site, "weight", "weight").T)
            grad = tensor(port, site, "weight_grad", "kernel")
            assert grad.shape == (D, D)
            np.testing.assert_allclose(grad, tensor(ref, site, "weight_grad", "weight").T,
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(tensor(port, f"layers.{k}#0", "grad_output"),
                                       tensor(ref, f"layers.{k}#0", "grad_output"),
                                       rtol=1e-4, atol=1e-6)
        assert port.meta["jit"] is False


def test_a_faithful_scanned_port_passes_the_diff_eager_and_jitted(faithful, faithful_jit,
                                                                   reference):
    for port in (faithful, faithful_jit):
        result = layerdiff.diff(reference, port)
        assert result.passed, result.origins
        assert result.origins == []
        # every record of the port's one step has its partner (the reference ran two)
        assert set(result.unmatched["step"]) == {1}, result.unmatched
    with open_trace(faithful_jit) as trace:
        assert trace.meta["jit"] is True


def test_jit_records_what_eager_records(faithful, faithful_jit):
    with open_trace(faithful) as eager, open_trace(faithful_jit) as jitted:
        assert_same_records(eager, jitted)


def test_one_layers_weights_loaded_wrong_is_named_at_that_layer(work, reference):
    path = work / "layer1.map.toml"
    path.write_text(UNTRANSPOSED_LAYER_1)
    port = capture(port_case(), work / "bug_load.h5", reference, path)
    assert origins(reference, port) == [("layers.1.fc#0", "forward", "output")]


@pytest.mark.slow
def test_a_slip_in_the_scanned_block_is_named_at_its_first_layer(work, reference, mapping):
    port = capture(port_case(tanh_slip=True), work / "bug_block.h5", reference, mapping)
    assert origins(reference, port)[:1] == [("layers.0#0", "forward", "output")]


def test_a_slip_only_traced_code_takes_passes_eager_and_is_named_under_jit(work, reference,
                                                                            mapping):
    eager = capture(port_case(bf16_slip=True), work / "bf16_eager.h5", reference, mapping)
    assert layerdiff.diff(reference, eager).passed
    jitted = capture(port_case(bf16_slip=True, jit=True), work / "bf16_jit.h5", reference,
                     mapping)
    assert origins(reference, jitted) == [("mask_rows#0", "forward", "output")]


@pytest.mark.slow
def test_two_jitted_steps_match_the_references_two_steps(
        work, reference, mapping):
    port = capture(port_case(jit=True, steps=2), work / "two.h5", reference, mapping, steps=2)
    result = layerdiff.diff(reference, port)
    assert result.passed, result.origins
    with open_trace(port) as trace:
        assert set(trace.index["step"]) == {0, 1}


def reference_case():
    return layerdiff.Case(model=TorchStack(), inputs=(torch.from_numpy(X),
                                                      torch.from_numpy(KEEP)),
                          loss_fn=lambda y: (y ** 2).mean(), name="torch_stack")


@pytest.mark.parametrize("remat", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_replay_runs_each_layer_of_a_scanned_stack_alone_and_the_root_whole(reference,
                                                                             mapping, remat):
    """Each layer is its slice of the stack, replayed on the reference's recorded call; the
    root runs the scan whole (each layer under nnx.remat too). Nothing is skipped, and each
    layer's weight gradient is judged against the reference's."""
    result = layerdiff.replay(reference, port_case(remat=remat), mapping=mapping,
                              propagated=False)
    assert result.passed, result.origin
    assert result.skipped == [] and result.cannot_judge == []
    replayed = {port for _, port in result.replayed}
    for k in range(LAYERS):
        assert {f"layers.{k}#0", f"layers.{k}.norm#0", f"layers.{k}.fc#0"} <= replayed
    assert "<root>#0" in replayed
    rows = result.diff.rows
    grads = rows[rows["role"] == "weight_grad"]
    assert {f"layers.{k}.fc#0" for k in range(LAYERS)} <= set(grads["site"])


def test_replay_names_a_slip_in_the_scanned_blocks_code_at_its_first_layer(reference,
                                                                             mapping):
    """Every layer runs the block's code, so each has the local error; the first is named,
    and the root, which runs them all, only holds one."""
    result = layerdiff.replay(reference, port_case(tanh_slip=True), mapping=mapping,
                              propagated=False)
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("layers.0#0", "forward", "output")
    local = result.local
    forward = local[local["pass"] == "forward"].set_index("site")["verdict"]
    assert {site for site, verdict in forward.items() if verdict == "LOCAL ERROR"} == {
        f"layers.{k}#0" for k in range(LAYERS)}
    assert forward["<root>#0"] == "holds one"
    assert result.skipped == []


@pytest.mark.slow
def test_replay_names_the_one_layer_whose_slice_was_loaded_wrong(work, reference):
    path = work / "layer1_replay.map.toml"
    path.write_text(UNTRANSPOSED_LAYER_1)
    result = layerdiff.replay(reference, port_case(), mapping=path, propagated=False)
    local = result.local
    errors = set(local[local["verdict"] == "LOCAL ERROR"]["site"])
    assert errors == {"layers.1.fc#0"}, errors


def test_bisect_searches_a_scanned_stacks_layers_and_names_the_first_with_the_slip(mapping):
    from layerdiff.replay.bisect import BisectOutcome, bisect
    from layerdiff.replay.swap import Swapper

    result = bisect(Swapper(reference_case, lambda: port_case(tanh_slip=True), mapping))
    assert result.outcome == BisectOutcome.CULPRITS
    assert result.cannot_judge == []
    assert result.culprits[0] == ("layers.0", "layers.0")
    assert {port for _, port in result.culprits} <= {f"layers.{k}" for k in range(LAYERS)}


def test_one_faithful_stack_layer_swapped_in_is_within_with_its_slices_gradients(mapping):
    from layerdiff.replay.swap import swap

    result = swap(reference_case(), port_case(), ["layers.1"], mapping=mapping)
    assert result, result.describe()
    judged = {row.what.split(",")[0] for row in result.rows}
    assert "weight_grad layers.1.fc.weight (port layers.1.fc.kernel)" in judged, judged


def test_map_suggest_drafts_per_layer_rules_that_map_check_passes_with_transposes(work,
                                                                                   reference):
    from layerdiff.mapsuggest import suggest_mapping
    from layerdiff.replay.mapcheck import SUSPICIOUS, map_check

    draft = suggest_mapping(reference, port_case())
    assert "UNSURE" not in draft.text, draft.text
    assert ('port = "layers.*.fc.kernel"\nreference = "layers.*.fc.weight"\n'
            'transform = "transpose"') in draft.text, draft.text
    path = work / "drafted.map.toml"
    path.write_text(draft.text)
    check = map_check(reference, port_case(), path, sites=False)
    assert check.passed
    entries = {entry.port: entry for entry in check.entries}
    for k in range(LAYERS):
        assert entries[f"layers.{k}.fc.kernel"].note.startswith("transpose checked at "
                                                                f"layers.{k}.fc#0")
    wrong = work / "layer1_check.map.toml"
    wrong.write_text(UNTRANSPOSED_LAYER_1)
    check = map_check(reference, port_case(), wrong, sites=False)
    flagged = [entry.port for entry in check.entries if entry.status == SUSPICIOUS]
    assert flagged == ["layers.1.fc.kernel"]


class Rematted(nnx.Module):
    def __init__(self) -> None:
        self.a = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.b(nnx.remat(lambda a, x: jnp.tanh(a(x)))(self.a, x))


@pytest.mark.parametrize("jit", [False, True])
def test_a_module_under_nnx_remat_is_recorded_once_with_its_gradients(tmp_path, jit):
    case = layerdiff.Case(model=Rematted(), inputs=(X,), loss_fn=mean_square, jit=jit)
    with open_trace(layerdiff.capture(case, tmp_path / "remat.h5", progress=False)) as trace:
        rows = [(r.site, r.role) for r in trace.index.itertuples()]
    assert rows.count(("a#0", "output")) == 1  # not again when the backward recomputes it
    assert {("a#0", "grad_output"), ("a#0", "weight_grad")} <= set(rows)
    assert "a#1" not in {site for site, _ in rows}
