"""``capture``: run a case with hooks and write its trace."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from collections.abc import Collection, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from layerdiff.capture.hooks import ModuleRecorder, around_modules, select_modules
from layerdiff.capture.ops import OpRecorder, select_op_modules
from layerdiff.capture.precision import autocast_context, cast_case, model_dtype
from layerdiff.capture.routes import RouteForcer
from layerdiff.capture.run import check_run_options, run_case
from layerdiff.capture.stage import Stager, dtype_name
from layerdiff.case import Case, ExternalCase, load_case, seed_everything
from layerdiff.errors import CaptureError, LayerdiffError, interrupt_inside
from layerdiff.progress import StepProgress
from layerdiff.signature import Signature
from layerdiff.trace import schema
from layerdiff.trace.recorder import DEFAULT_QUEUE_BYTES, Recorder
from layerdiff.trace.schema import Role
from layerdiff.trace.writer import TraceWriter, base_meta, check_writable


class _Observer:
    """Connects the step loop to the module hooks, the recorder and the progress display."""

    def __init__(self, hooks: ModuleRecorder, recorder: Recorder, progress: StepProgress,
                 ops: OpRecorder | None = None, routes: RouteForcer | None = None,
                 name: str = "") -> None:
        self.hooks = hooks
        self.ops = ops
        self.routes = routes
        self.name = name
        self.recorder = recorder
        self.progress = progress
        self.phase = "setup"
        self.step = 0

    def begin_step(self, step: int) -> None:
        self.step = step
        self.hooks.begin_step(step)
        if self.ops is not None:
            self.ops.begin_step()
        if self.routes is not None:
            self.routes.begin_step(step)

    def record_loss(self, loss: torch.Tensor) -> None:
        self.hooks.record_loss(loss)

    def after_backward(self) -> None:
        self.hooks.after_backward()

    def end_step(self, step: int) -> None:
        if self.routes is not None:
            self.routes.check_taken(step, f"step {step} of case {self.name}")
        self.recorder.checkpoint()  # a crash in a later step keeps this one on disk
        self.progress.advance()


def capture(case: Case | ExternalCase | str, path: str | os.PathLike, *,
            include: Sequence[str] = (), exclude: Sequence[str] = (), loss_scale: float = 1.0,
            steps: int | None = None,
            summary: bool = False, weights: bool = True,
            queue_bytes: int = DEFAULT_QUEUE_BYTES, progress: bool = False,
            dtype: str | None = None, autocast: str | None = None,
            extra_meta: dict[str, Any] | None = None,
            record_steps: Collection[int] | None = None, ops: Sequence[str] = (),
            ops_all: bool = False, full_around: Sequence[str] = (),
            radius: int = 1, matmul_precision: str = "float32",
            data_modules: Collection[str] | None = None,
            force_routing: RouteForcer | None = None) -> Path:
    """Run ``case`` (a Case, or a spec such as ``"my_models:reference"``) with every selected
    module call recorded into the trace at ``path``.

    Records inputs, outputs, weights (each step), the gradients arriving at and leaving each
    call, and weight gradients (before the optimizer step). ``include`` / ``exclude`` are globs
    over module paths (``<root>`` is the model itself). ``loss_scale`` multiplies the loss
    before backward (recorded gradients are amplified; training is not). ``summary`` keeps
    statistics only. ``queue_bytes`` caps the memory that staged tensors may take.
    ``dtype`` casts the model's floating parameters and buffers and the case's floating inputs
    first; ``autocast`` runs the forward under ``torch.autocast`` in that dtype: both are how a
    baseline is made (the reference run the way a port runs). ``extra_meta`` is recorded in the
    trace's meta as given (``weights``: where the weights came from and the mapping used).
    ``record_steps``, when given, are the only steps recorded (the others run unrecorded); the
    meta lists them as ``recorded_steps``. ``ops`` are globs over module paths whose own code is
    recorded op by op (op sites ``<module site>/<op>#<k>``, see :mod:`layerdiff.capture.ops`);
    ``ops_all`` keeps the views and metadata ops that are skipped by default. ``full_around``
    keeps tensor data only for the modules named (paths, globs or sites), everything inside
    them and their ``radius`` nearest siblings on each side; every other record keeps its
    statistics, as in a summary trace (the second phase of a two-phase capture of a model too
    large to capture in full). ``data_modules`` keeps tensor data for exactly the modules
    named (paths, not globs: nothing inside them, no siblings), statistics for every other
    record: what a later diff must read element by element and no more (``diverge`` keeps so
    the inputs of sites a mapping's call adapter rebuilds, and the parameters a conversion
    makes); with ``full_around``, the two sets are kept together. ``force_routing`` (see
    :func:`layerdiff.capture.routes.forcer_from`) makes every router's top-k take the routes
    another trace recorded; its ``forced()`` then says what that changed.

    A case whose model is a Flax NNX module is captured by :mod:`layerdiff.flax.capture`
    into the same format (``include``, ``exclude``, ``loss_scale``, ``steps``, ``summary``,
    ``weights``, ``dtype`` apply); ``matmul_precision`` is JAX's matmul precision during its
    capture ("float32", pinned by default; "default" for the framework's own).

    Returns the published path. Raises :class:`CaptureError` with a sentence for the user when
    the model raises (naming the site) or the file cannot be written; nothing incomplete is
    ever published under ``path``.
    """
    if isinstance(case, str):  # a spec, 'module:function', as on the command line
        case = load_case(case)
    if isinstance(case, Case) and case.framework == "flax":
        unsupported = [flag for flag, given in (
            ("--autocast", autocast), ("--record-steps", record_steps is not None),
            ("--ops", ops or ops_all), ("--full-around", full_around),
            ("data_modules", data_modules is not None),
            ("--force-routing", force_routing is not None)) if given]
        if unsupported:
            raise CaptureError(f"case {case.name} is a Flax model: {', '.join(unsupported)} "
                               "apply to torch models only; capture it without them")
        from layerdiff.flax.capture import capture_nnx

        return capture_nnx(case, path, include=include, exclude=exclude,
                           loss_scale=loss_scale, steps=steps, summary=summary,
                           weights=weights, queue_bytes=queue_bytes, progress=progress,
                           dtype=dtype, matmul_precision=matmul_precision,
                           extra_meta=extra_meta)
    if matmul_precision != "float32":
        raise CaptureError(f"--matmul-precision applies to JAX models; case {case.name} is "
                           "not one (torch runs float32 matmuls in float32 unless the model "
                           "enables TF32 itself)")
    if isinstance(case, ExternalCase):
        if dtype or autocast:
            raise CaptureError(f"case {case.name} records itself, so --dtype and --autocast do "
                               "not apply to it; run the port in that precision in its own code")
        if record_steps is not None:
            raise CaptureError(f"case {case.name} records itself, so layerdiff cannot record "
                               "only some of its steps; capture all of them")
        if ops or full_around or data_modules is not None or force_routing is not None:
            raise CaptureError(f"case {case.name} records itself, so --ops, --full-around, "
                               "--force-routing and data_modules "
                               "do not apply to it; record what it needs in its own code")
        return _capture_external(case, path, include=include, exclude=exclude,
                                 loss_scale=loss_scale, steps=steps, summary=summary,
                                 queue_bytes=queue_bytes)
    if dtype is not None:
        cast_case(case, dtype)
    prepared = PreparedCapture(case, path, include=include, exclude=exclude,
                               loss_scale=loss_scale, steps=steps, summary=summary,
                               weights=weights, queue_bytes=queue_bytes, autocast=autocast,
                               extra_meta={"dtype": dtype, **(extra_meta or {})},
                               record_steps=record_steps, ops=ops, ops_all=ops_all,
                               full_around=full_around, radius=radius,
                               data_modules=data_modules, force_routing=force_routing)
    return prepared.run(progress=progress)


class PreparedCapture:
    """A capture set up (options checked, file created, ring allocated) but not yet run.

    ``capture`` is this in one call; benchmarks use it to time the steps apart from setup.
    """

    def __init__(self, case: Case, path: str | os.PathLike, *, include: Sequence[str] = (),
                 exclude: Sequence[str] = (), loss_scale: float = 1.0,
                 steps: int | None = None, summary: bool = False, weights: bool = True,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, async_device: bool = True,
                 autocast: str | None = None, extra_meta: dict[str, Any] | None = None,
                 record_steps: Collection[int] | None = None, ops: Sequence[str] = (),
                 ops_all: bool = False, full_around: Sequence[str] = (),
                 radius: int = 1, data_modules: Collection[str] | None = None,
                 force_routing: RouteForcer | None = None) -> None:
        self.case = case
        self.steps = case.steps if steps is None else steps
        self.routes = force_routing
        self.loss_scale = loss_scale
        self.autocast = autocast
        check_run_options(case, self.steps, loss_scale)
        autocast_context(case, autocast)  # an unknown autocast dtype fails before any file
        check_writable(path)
        modules = select_modules(case.model, include, exclude)
        # checked before the file exists: a glob that matches nothing is a typo
        op_modules = select_op_modules(case.model, ops, modules) if ops else set()
        meta = _meta(case, self.steps, loss_scale, summary, include, exclude)
        meta["ops"] = {"globs": list(ops), "modules": sorted(op_modules), "all": ops_all}
        if force_routing is not None:
            force_routing.check_steps(self.steps, case.name)
            meta["forced_routing"] = {"from": force_routing.source, "routes": sum(
                len(routes) for routes in force_routing.routes.values())}
        keep = None
        kept: set[str] = set()
        if full_around:
            if summary:
                raise CaptureError("--full-around keeps tensor data around the sites it names "
                                   "and statistics elsewhere; it cannot be combined with "
                                   "--summary, which keeps none")
            kept = around_modules(case.model, full_around, radius)
            meta["full_around"] = {"around": list(full_around), "radius": radius,
                                   "modules": sorted(kept)}
        if data_modules is not None:
            if summary:
                raise CaptureError("data_modules keeps tensor data for the modules it names "
                                   "and statistics elsewhere; it cannot be combined with "
                                   "summary, which keeps none")
            named = {path for path, _ in modules}
            unknown = sorted(set(data_modules) - {path for path, _ in
                                                  select_modules(case.model, (), ())})
            if unknown:
                raise CaptureError(f"data_modules names no module {', '.join(unknown[:4])} of "
                                   f"{type(case.model).__name__}")
            meta["data_modules"] = sorted(set(data_modules) & named)
            kept = kept | set(data_modules)
        if full_around or data_modules is not None:
            keep = partial(_keeps, frozenset(kept))
        meta.update(extra_meta or {}, autocast=autocast, model_dtype=model_dtype(case))
        if record_steps is not None:
            meta["recorded_steps"] = sorted(int(step) for step in record_steps)
        self.recorder = Recorder(path, meta, summary=summary, queue_bytes=queue_bytes,
                                 keep=keep)
        try:
            self.stager = Stager(self.recorder, async_device=async_device)
            self.hooks = ModuleRecorder(modules, self.stager, weights=weights,
                                        record_steps=record_steps)
            self.ops = (OpRecorder(case.model, self.hooks, ops, all_ops=ops_all) if ops
                        else None)
        except BaseException:  # the writer threads and the file must not outlive a failed setup
            _close_incomplete(self.recorder)
            raise

    def run(self, progress: bool = False) -> Path:
        """Run the steps with the hooks attached, then publish the trace."""
        try:
            return self._run(progress)
        except BaseException:
            # wherever a Ctrl-C landed (between the steps and the close, in the hooks'
            # detaching), the writer stops and the file closes; a no-op once closed
            _close_incomplete(self.recorder)
            raise
        finally:
            self.stager.release()

    def _run(self, progress: bool) -> Path:
        case, recorder, hooks = self.case, self.recorder, self.hooks
        with StepProgress(self.steps, enabled=progress, label=f"capture {case.name}",
                          recorded=lambda: (recorder.seq, recorder.bytes_submitted)) as bar:
            observer = _Observer(hooks, recorder, bar, self.ops, self.routes, case.name)
            hooks.attach()
            if self.ops is not None:
                self.ops.attach()  # after the module hooks: its frames wrap theirs
            try:
                # the forcer under the op recorder's mode: an op site records the forced top-k
                with self.routes if self.routes is not None else contextlib.nullcontext():
                    run_case(case, steps=self.steps, loss_scale=self.loss_scale,
                             observer=observer, autocast=self.autocast)
            except LayerdiffError:
                _close_incomplete(recorder)
                raise
            except Exception as exc:
                partial = _close_incomplete(recorder)
                if interrupt_inside(exc) is not None:
                    raise KeyboardInterrupt from exc  # the user's Ctrl-C, wrapped on its way
                where = (f" inside site {hooks.open[-1].site} ({hooks.open[-1].type})"
                         if hooks.open and observer.phase == "forward" else "")
                raise CaptureError(
                    f"case {case.name}: the model raised {type(exc).__name__}: {exc}{where} "
                    f"during the {observer.phase} of step {observer.step}; no trace was "
                    f"published ({partial} holds what was recorded up to there)") from exc
            except BaseException:  # KeyboardInterrupt: leave the partial file, publish nothing
                _close_incomplete(recorder)
                raise
            finally:
                if self.ops is not None:
                    self.ops.detach()
                hooks.detach()
        return recorder.close(complete=True)


def _capture_external(case: ExternalCase, path: str | os.PathLike, *, include: Sequence[str],
                      exclude: Sequence[str], loss_scale: float, steps: int | None,
                      summary: bool, queue_bytes: int) -> Path:
    """A port that records itself: give it a TraceWriter and let it run."""
    steps = case.steps if steps is None else steps
    if include or exclude:
        raise CaptureError(f"case {case.name} records itself, so --include and --exclude do "
                           "not apply to it; narrow the sites when comparing instead")
    if steps < 1:
        raise CaptureError(f"--steps must be at least 1 (got {steps}) for case {case.name}")
    meta = {"case": case.name, "seed": case.seed, "steps": steps, "loss_scale": loss_scale,
            "summary": summary}
    seed_everything(case.seed)
    writer = TraceWriter(path, meta=meta, summary=summary, queue_bytes=queue_bytes,
                         producer=f"layerdiff.ExternalCase ({case.name})")
    try:
        case.run(writer, steps=steps, loss_scale=loss_scale)
    except LayerdiffError:
        writer.close(complete=False)
        raise
    except Exception as exc:
        writer.close(complete=False)
        if interrupt_inside(exc) is not None:
            raise KeyboardInterrupt from exc
        raise CaptureError(f"case {case.name}: the port raised {type(exc).__name__}: {exc} "
                           f"at step {writer.current_step}; no trace was published") from exc
    except BaseException:
        writer.close(complete=False)
        raise
    return writer.close()


def weights_meta(weights_from: str | os.PathLike, mapping: str | os.PathLike | None
                 ) -> dict[str, Any]:
    """What a port trace records of how its weights were loaded: the reference trace and the
    mapping file's whole text with its hash, so that ``diff`` can use the same mapping."""
    record: dict[str, Any] = {"from": str(weights_from), "mapping": None}
    if mapping is not None:
        path = Path(mapping)
        text = path.read_text(encoding="utf-8")
        record["mapping"] = {"name": path.name, "path": str(path), "text": text,
                             "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return {"weights": record}


def _keeps(modules: frozenset[str], site: str) -> bool:
    """Whether a --full-around capture keeps the tensor data of ``site`` (the loss always)."""
    if site == schema.LOSS_SITE:
        return True
    op = schema.split_op_site(site)
    return schema.split_site(op[0] if op else site)[0] in modules


def _close_incomplete(recorder: Recorder) -> Path:
    try:
        return recorder.close(complete=False)
    except CaptureError:
        return recorder.file.partial


def _meta(case: Case, steps: int, loss_scale: float, summary: bool, include: Sequence[str],
          exclude: Sequence[str]) -> dict[str, Any]:
    from layerdiff.capture.hooks import shared_parameters

    meta = base_meta("layerdiff.capture (torch)")
    first = next(case.model.parameters(), None)
    meta.update({
        "case": case.name,
        "seed": case.seed,
        "steps": steps,
        "loss_scale": loss_scale,
        "summary": summary,
        "include": list(include),
        "exclude": list(exclude),
        "device": str(first.device) if first is not None else "cpu",
        "default_dtype": dtype_name(torch.get_default_dtype()),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "num_threads": torch.get_num_threads(),
        "machine": platform.machine(),
        # tied weights: recorded once, under "name"; "users" are all the names they go by
        "shared_parameters": shared_parameters(case.model, include, exclude),
        # the tensors of modules never called are recorded at their nearest called ancestor
        # (traces without this key predate that and lack them)
        "uncalled_weights": "ancestor",
        # grad_output is the gradient arriving from outside each call (traces without this key
        # predate that: theirs held everything that reached the output, internal uses too)
        Role.GRAD_OUTPUT: "outside",
        # what replay and swap bind the recorded calls against (layerdiff.replay.calling)
        "signatures": _signatures(case.model),
        # torch's own module types: a leaf of these runs one op (the diff suggests --ops
        # only where a module's own code can hold more)
        "builtin_types": sorted({type(m).__name__ for m in case.model.modules()
                                 if type(m).__module__.startswith("torch.nn.")}),
    })
    meta["versions"]["torch"] = torch.__version__
    return meta


def _signatures(model: torch.nn.Module) -> dict[str, Any]:
    """Each module type's forward signature, by type name (the first module of a type wins)."""
    found: dict[str, Any] = {}
    for module in model.modules():
        name = type(module).__name__
        if name not in found:
            signature = Signature.of(module.forward)
            if signature is not None:
                found[name] = signature.as_json()
    return found
