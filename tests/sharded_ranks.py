"""Running the sharded ports of reference_models.sharded on local gloo ranks and joining their
records by hand, with no layerdiff gather: what tests/test_sharded_models.py checks with.

A :class:`Recorder` keeps every named module's inputs, outputs and their gradients, and every
parameter's gradient, keyed ``(step, module path, role, index)``. :func:`run_ranks` records
cases on W forked (or spawned) gloo processes. :func:`join` makes one record whole from the
ranks' parts by the layouts of a mapping file's ``[[shard]]`` rules (read with tomllib, not
with layerdiff's parser): split, zigzag, partial, replicate, experts.
"""

from __future__ import annotations

import fnmatch
import os
import time
import tomllib
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from layerdiff.capture.run import run_case
from tests.gloo import free_port

GRADIENT_ROLES = {"grad_input": "input", "grad_output": "output"}


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank records the same records in the same
    order); a plain tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return (full() if full is not None else tensor).detach().clone()


class Recorder:
    """Forward hooks (and, with ``backward``, full backward hooks) on every named module, and
    the parameters' gradients after each backward."""

    phase = "forward"

    def __init__(self, model: nn.Module, backward: bool = True) -> None:
        self.model, self.step = model, 0
        self.records: dict[tuple, torch.Tensor] = {}
        self.losses: list[torch.Tensor] = []
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_hook(self._forward(name)))
                if backward:
                    self.handles.append(module.register_full_backward_hook(self._backward(name)))

    def _keep(self, name: str, role: str, tensors) -> None:
        for index, tensor in enumerate(tensors):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                self.records[(self.step, name, role, index)] = _whole(tensor)

    def _forward(self, name: str):
        def hook(module, args, output):
            self._keep(name, "input", args)
            self._keep(name, "output", (output,))
        return hook

    def _backward(self, name: str):
        def hook(module, grad_input, grad_output):
            self._keep(name, "grad_output", grad_output)
            self._keep(name, "grad_input", grad_input)
        return hook

    def begin_step(self, step: int) -> None:
        self.step = step

    def record_loss(self, loss: torch.Tensor) -> None:
        self.losses.append(loss.detach().clone())

    def after_backward(self) -> None:
        for name, param in self.model.named_parameters():
            site, _, leaf = name.rpartition(".")
            if param.grad is not None:
                self.records[(self.step, site, f"{leaf}_grad", 0)] = _whole(param.grad)

    def end_step(self, step: int) -> None:
        pass


def record(case, backward: bool = True) -> dict:
    """Run ``case`` and return its records and losses."""
    recorder = Recorder(case.model, backward)
    run_case(case, observer=recorder)
    for handle in recorder.handles:
        handle.remove()
    return {"records": recorder.records, "losses": recorder.losses}


# ---- W gloo ranks recording cases


def _rank_main(rank: int, world: int, port: int, out_dir: str, work, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    except Exception:
        Path(out_dir, f"init_failed.rank{rank}").write_text(traceback.format_exc())
        return
    try:
        torch.save(work(rank, world, *args), Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def on_ranks(work, world: int, out_dir: Path, *args, timeout: float = 240) -> list:
    """``work(rank, world, *args)`` on each of ``world`` gloo ranks (a module-level function;
    the process group is up): what each rank returned, in rank order. Skips when gloo cannot
    start local processes here."""
    import torch.multiprocessing as mp

    # fork where there is one: spawned ranks import torch again and torch._dynamo at their first
    # optimizer step (measured on 2 busy cores: 20 s against 1 s forked). The ranks use no
    # lock another thread could hold (no h5py, no CUDA).
    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*multi-threaded.*fork",
                                category=DeprecationWarning)
        context = mp.start_processes(_rank_main, args=(world, free_port(), str(out_dir), work,
                                                       args),
                                     nprocs=world, join=False, start_method=method)
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the {world} ranks ({method}) did not finish in {timeout} s")
    failed = sorted(out_dir.glob("init_failed.*"))
    if failed:
        last = failed[0].read_text().strip().splitlines()[-1]
        pytest.skip(f"gloo could not start {world} local processes here: {last}")
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(world)]


def _record_specs(rank: int, world: int, specs: list[tuple[str, bool]]) -> dict:
    import importlib

    results = {}
    for spec, backward in specs:
        module, _, name = spec.partition(":")
        results[spec] = record(getattr(importlib.import_module(module), name)(), backward)
    return results


def run_ranks(specs: list[tuple[str, bool]], world: int, out_dir: Path,
              timeout: float = 240) -> dict[str, list[dict]]:
    """Each case spec recorded on ``world`` gloo ranks (``(spec, backward hooks)`` pairs, in
    one group of processes): spec -> one result per rank."""
    loaded = on_ranks(_record_specs, world, out_dir, specs, timeout=timeout)
    return {spec: [run[spec] for run in loaded] for spec, _ in specs}


# ---- joining the ranks' parts by a mapping file's layouts


def shard_rules(path: Path | None) -> list[dict]:
    if path is None:
        return []
    return tomllib.loads(path.read_text(encoding="utf-8")).get("shard", [])


def rule_for(rules: list[dict], key: tuple) -> tuple[dict | None, bool]:
    """The first rule covering record ``key`` and whether the record is a gradient of the
    tensor the rule names (a rule on a parameter, input or output covers its gradient)."""
    _, site, role, index = key
    if role.endswith("_grad"):
        names, gradient = {role.removesuffix("_grad")}, True
    else:
        base = GRADIENT_ROLES.get(role, role)
        names, gradient = {base, f"{base}.{index}"}, role in GRADIENT_ROLES
    for rule in rules:
        if fnmatch.fnmatchcase(site, rule["site"]) and rule["tensor"] in names:
            return rule, gradient
    return None, gradient


def zigzag_join(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """Rank i holds chunks i and 2W-1-i of 2W: the chunks put back in sequence order."""
    world = len(parts)
    halves = [half for part in parts for half in part.chunk(2, dim)]
    order = [2 * j if j < world else 2 * (2 * world - 1 - j) + 1 for j in range(2 * world)]
    return torch.cat([halves[index] for index in order], dim)


def experts_join(parts: list[torch.Tensor], dim: int, experts: list[list[int]]) -> torch.Tensor:
    """Rank r's slices along ``dim`` are the experts ``experts[r]``: each put at its index."""
    ids = torch.tensor([expert for held in experts for expert in held])
    joined = torch.cat(parts, dim)
    return joined.index_select(dim, torch.argsort(ids))


def join(runs: list[dict], key: tuple, rules: list[dict]) -> torch.Tensor:
    """The whole tensor of record ``key`` from the ranks' parts, by the rules' layouts; rank 0's
    copy of a replicated one. A ``partial`` record's gradient is replicated (the all-reduce's
    backward gives every rank the whole gradient)."""
    parts = [run["records"][key] for run in runs]
    rule, gradient = rule_for(rules, key)
    layout = rule.get("layout", "split") if rule else "replicate"
    if layout == "partial":
        layout = "replicate" if gradient else "partial"
    if layout == "replicate":
        return parts[0]
    if layout == "partial":
        return torch.stack(parts).sum(0)
    if layout == "zigzag":
        return zigzag_join(parts, rule["dim"])
    if layout == "experts":
        return experts_join(parts, rule["dim"], rule["experts"])
    return torch.cat(parts, rule["dim"])


def max_errors(runs: list[dict], reference: dict, rules: list[dict]) -> dict[tuple, float]:
    """Every record's max abs error of the joined port against the reference."""
    assert runs[0]["records"].keys() == reference["records"].keys()
    return {key: (join(runs, key, rules) - tensor).abs().max().item()
            for key, tensor in reference["records"].items()}


# ---- the same join over captured traces (every record a capture makes: the root's, the
# loss, integer inputs, weights)


def trace_errors(reference: str | Path, port: str | Path, rules: list[dict]) -> dict[tuple, float]:
    """Every tensor record of the one-process ``reference`` trace against the port's ranks
    (``port`` is the manifest of a multi-rank capture) joined by the rules' layouts: its max
    abs error, keyed ``(step, pass, site, role, arg)``."""
    import numpy as np

    from layerdiff import open_trace

    with open_trace(port) as manifest:
        rank_paths = list(manifest.rank_paths)
    ref, ranks = open_trace(reference), [open_trace(path) for path in rank_paths]
    try:
        modules = dict(zip(ref.sites["site"], ref.sites["module"], strict=True))
        errors = {}
        for _, row in ref.index[ref.index["kind"] == "tensor"].iterrows():
            step, pass_, site, role, arg = (row[k] for k in ("step", "pass", "site", "role",
                                                             "arg"))
            # the Recorder's keys: a parameter by its name (its gradient name_grad)
            name = {"weight": arg, "weight_grad": f"{arg}_grad"}.get(role, role)
            key = (step, modules[site], name, int(arg) if arg.isdigit() else 0)
            parts = [torch.from_numpy(np.array(trace.read(trace.find(step, site, role, arg,
                                                                     pass_=pass_))))
                     for trace in ranks]
            whole = join([{"records": {key: part}} for part in parts], key, rules)
            expected = torch.from_numpy(np.array(ref.read(row)))
            assert whole.shape == expected.shape, (site, role, arg, whole.shape, expected.shape)
            errors[(step, pass_, site, role, arg)] = (
                (whole.double() - expected.double()).abs().max().item() if whole.numel() else 0.0)
        return errors
    finally:
        for trace in (ref, *ranks):
            trace.close()
