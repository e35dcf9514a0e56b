"""The 2-rank captures the multi-rank trace tests read (test_gather, test_ranks), made once per
session by one group of 2 spawned processes that captures every case in turn, as under torchrun.

Each process start costs seconds of imports (torch, then torch._dynamo at the first optimizer
step): one start for all of them instead of one per capture. ``capture --nproc``'s own spawning
is tested in test_distributed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from reference_models import tensor_parallel as tp

MAP = str(tp.MAP_FILE)

# name: (spec, capture options); "reference" in an option stands for the path of the one-process
# reference trace of the tensor-parallel model (captured first, in this process)
CAPTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "port": (f"{tp.MODULE}:port", {}),
    "port_summary": (f"{tp.MODULE}:port", {"summary": True}),
    "bias": (f"{tp.MODULE}:bug_bias_before_allreduce", {}),
    "dropout": (f"{tp.MODULE}:bug_dropout_per_rank", {}),
    # the bug shows at step 0: one step is enough for `layerdiff ranks`
    "dropout_one_step": (f"{tp.MODULE}:bug_dropout_per_rank", {"steps": 1}),
    "rank_one": ("tests.dist_cases:tp_gelu_tanh_on_rank_one", {}),
    "own_weights": ("tests.dist_cases:tp_port_own_weights",
                    {"weights_from": "reference", "mapping": MAP}),
    "dp": ("tests.test_ranks:dp_first_layer_unreduced", {}),
}


def _capture_each(rank: int, world: int, port: int, jobs: list[tuple[str, str, dict]]) -> None:
    """One rank of a 2-process group capturing every job in turn, as under torchrun."""
    import torch
    import torch.distributed as dist

    from layerdiff.capture.distributed import capture_ranks

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for spec, output, options in jobs:
            capture_ranks(spec, output, nproc=None, progress=False, **options)
    finally:
        dist.destroy_process_group()


def capture_all(folder: Path) -> dict[str, Path]:
    """The one-process reference ("reference", "reference_summary", captured by the command
    line) and the manifest of every 2-rank capture of :data:`CAPTURES`, by name, in ``folder``."""
    import torch.multiprocessing as mp
    from click.testing import CliRunner

    from layerdiff.cli import main
    from tests.gloo import free_port

    paths = {name: folder / f"{name}.h5" for name in ["reference", "reference_summary",
                                                       *CAPTURES]}
    for name, extra in (("reference", []), ("reference_summary", ["--summary"])):
        done = CliRunner().invoke(main, ["capture", f"{tp.MODULE}:reference", "-o",
                                         str(paths[name]), *extra])
        assert done.exit_code == 0, done.output
    jobs = [(spec, str(paths[name]),
             {key: str(paths["reference"]) if value == "reference" else value
              for key, value in options.items()})
            for name, (spec, options) in CAPTURES.items()]
    try:
        mp.start_processes(_capture_each, args=(2, free_port(), jobs), nprocs=2,
                           start_method="spawn")
    except mp.ProcessExitedException:
        # a rank killed by a signal (seen once in eight runs at load 7: gloo's
        # "terminate called without an active exception", SIGABRT, no Python error) says
        # nothing of the traces these tests read: one more group, from scratch
        for path in [*folder.glob("*.rank*"), *(paths[name] for name in CAPTURES)]:
            path.unlink(missing_ok=True)
        mp.start_processes(_capture_each, args=(2, free_port(), jobs), nprocs=2,
                           start_method="spawn")
    assert all(path.exists() for path in paths.values())
    return paths
