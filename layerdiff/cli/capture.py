"""``layerdiff capture``: a thin shell over :func:`layerdiff.capture.port.capture_port` (one
process) and :func:`layerdiff.capture.distributed.capture_ranks` (under torchrun or --nproc)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from layerdiff.cli.options import force_option
from layerdiff.outputs import refuse_existing, refuse_inputs, refuse_rank_file

if TYPE_CHECKING:
    from layerdiff.weights import WeightsReport


@click.command("capture")
@click.argument("case_spec", metavar="CASE")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Trace file to write (HDF5).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Record only modules whose path matches (repeatable; '<root>' is the model).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Do not record modules whose path matches (repeatable).")
@click.option("--loss-scale", type=float, default=1.0, show_default=True,
              help="Multiply the loss before backward so tiny gradients rise above rounding "
                   "noise; training is unaffected. Powers of two (2**20) unscale exactly.")
@click.option("--steps", type=int, default=None, help="Training steps (default: the case's).")
@click.option("--summary", is_flag=True, help="Record statistics only, no tensor data.")
@click.option("--no-weights", is_flag=True, help="Do not record weights and weight gradients.")
@click.option("--queue-mib", type=click.IntRange(min=1), default=256, show_default=True,
              help="Memory cap for tensors waiting to be written.")
@click.option("--weights-from", type=click.Path(dir_okay=False), metavar="TRACE",
              help="Load the model's weights from this reference trace first.")
@click.option("--map", "mapping", type=click.Path(dir_okay=False), metavar="FILE",
              help="Mapping file for --weights-from when names differ (recorded in the trace, "
                   "so that diff finds it).")
@click.option("--dtype", type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
              help="Cast the model's floating parameters and buffers and the inputs first "
                   "(a baseline: the reference in the port's precision).")
@click.option("--autocast", type=click.Choice(["bfloat16", "float16"]),
              help="Run the forward and the loss under torch.autocast in this dtype.")
@click.option("--ops", multiple=True, metavar="GLOB",
              help="Also record each tensor op that the own code of modules matching GLOB "
                   "runs, as sites <module site>/<op>#<k> (repeatable; '*' for every module).")
@click.option("--ops-all", is_flag=True,
              help="With --ops, keep the views and metadata ops (view, transpose, indexing) "
                   "that are skipped by default.")
@click.option("--full-around", multiple=True, metavar="SITE",
              help="Keep tensor data only for this module (a site, path or glob; repeatable), "
                   "what is inside it and --radius siblings each side; statistics elsewhere. "
                   "The second phase after a --summary diff of a model too big to capture.")
@click.option("--radius", type=click.IntRange(min=0), default=1, show_default=True,
              help="With --full-around: how many sibling modules on each side keep data too.")
@click.option("--matmul-precision",
              type=click.Choice(["float32", "tensorfloat32", "bfloat16", "highest", "high",
                                 "default"]),
              help="JAX models: the matmul precision of the capture (jax.default_matmul_"
                   "precision), recorded in the trace. Default float32, pinned; 'default' "
                   "captures at the framework's own (TF32 or bf16 passes on accelerators).")
@click.option("--nproc", type=click.IntRange(min=1), default=None, metavar="N",
              help="Spawn N local processes on the gloo backend, one per rank; each writes "
                   "OUTPUT.rank<r>.h5 and OUTPUT becomes their manifest (under torchrun the "
                   "ranks are torchrun's).")
@click.option("--force-routing", type=click.Path(dir_okay=False), metavar="TRACE",
              help="Mixture of experts: every router's top-k takes the routes TRACE recorded "
                   "(the reference's, for a port; the port's, for the reference), so experts "
                   "are compared apart from routing (docs/moe.md).")
@force_option
def capture_command(case_spec: str, output: str, include: tuple[str, ...],
                    exclude: tuple[str, ...], loss_scale: float, steps: int | None,
                    summary: bool, no_weights: bool, queue_mib: int, weights_from: str | None,
                    mapping: str | None, dtype: str | None, autocast: str | None,
                    ops: tuple[str, ...], ops_all: bool, full_around: tuple[str, ...],
                    radius: int, matmul_precision: str | None, nproc: int | None,
                    force_routing: str | None, force: bool) -> None:
    """Capture a trace of CASE (package.module:name) into OUTPUT.

    Under torchrun, or with --nproc N, each rank writes OUTPUT's name with .rank<r> and rank 0
    publishes OUTPUT last: a manifest naming them (see docs/distributed.md).
    """
    from layerdiff.capture.distributed import capture_ranks, launched_world
    from layerdiff.capture.port import capture_port
    from layerdiff.options import CaptureOptions
    from layerdiff.trace.manifest import rank_path

    refuse_inputs({"-o": output}, {"--weights-from trace": weights_from,
                                   "mapping file": mapping, "--force-routing trace": force_routing})
    if mapping and not weights_from:
        raise click.UsageError("--map is used with --weights-from when capturing")
    if ops_all and not ops:
        raise click.UsageError("--ops-all keeps more of the ops that --ops records; give --ops "
                               "GLOB too")
    options = CaptureOptions(
        include=include, exclude=exclude, loss_scale=loss_scale, steps=steps, summary=summary,
        weights=not no_weights, queue_bytes=queue_mib * 2**20, progress=True, dtype=dtype,
        autocast=autocast, ops=ops, ops_all=ops_all, full_around=full_around, radius=radius,
        # a JAX model's; a torch case refuses any but the default
        matmul_precision=matmul_precision or "float32")
    port = dict(weights_from=weights_from, mapping=mapping, options=options,
                on_weights=say_weights, on_written=say_written)
    launched = launched_world()
    if nproc is None and launched is None:
        refuse_rank_file(output, "-o")
        refuse_existing(output, "-o", force)
        capture_port(case_spec, output, force_routing=force_routing,
                     on_forced=lambda said: click.echo(f"routing from {force_routing}: {said}"),
                     **port)
        return
    if force_routing:
        raise click.UsageError("--force-routing captures one process; it does not apply under "
                               "torchrun or --nproc yet")
    world = nproc or launched[1]
    refuse_inputs({f"-o's rank {r} file": rank_path(output, r) for r in range(world)},
                  {"--weights-from trace": weights_from, "mapping file": mapping})
    if launched is None or launched[0] == 0:
        for path in [output, *(rank_path(output, r) for r in range(world))]:
            refuse_rank_file(path, "-o", rewritten=output)
            refuse_existing(str(path), "-o", force)
    start = time.perf_counter()
    published = capture_ranks(case_spec, output, nproc=nproc, **port)
    if published is not None:
        click.echo(f"wrote manifest {published} naming {world} rank files in "
                   f"{time.perf_counter() - start:.2f} s")


def say_weights(trace: str | os.PathLike, report: WeightsReport) -> None:
    """What loading the reference's weights did (every rank says it)."""
    click.echo(f"weights from {trace}: {report.summary()}")


def say_written(path: Path, seconds: float) -> None:
    """The line after a capture (golden's too): where, how big, how long."""
    size = os.path.getsize(path)
    click.echo(f"wrote {path} ({size / 2**20:,.1f} MiB) in {seconds:.2f} s")


COMMANDS = (capture_command,)
