"""Capturing a torch case: module hooks (and op frames) record a run of it into a trace."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from layerdiff.capture.hooks import ModuleRecorder, around_modules, select_modules
from layerdiff.capture.ops import OpRecorder, select_op_modules
from layerdiff.capture.precision import autocast_context, cast_case, model_dtype
from layerdiff.capture.routes import RouteForcer
from layerdiff.capture.run import check_run_options, run_case
from layerdiff.capture.sharded import data_parallel_meta, module_type_name
from layerdiff.capture.stage import Stager, dtype_name
from layerdiff.case import Case
from layerdiff.errors import CaptureError, LayerdiffError, interrupt_inside
from layerdiff.options import CaptureOptions
from layerdiff.progress import StepProgress
from layerdiff.signature import Signature
from layerdiff.trace import schema
from layerdiff.trace.recorder import Recorder
from layerdiff.trace.schema import Role
from layerdiff.trace.writer import base_meta, check_writable


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


def capture_torch(case: Case, path: str | os.PathLike, options: CaptureOptions) -> Path:
    """Capture a torch case (see :func:`layerdiff.capture.capture`): cast it to
    ``options.dtype``, set the capture up, run it."""
    if options.matmul_precision != "float32":
        raise CaptureError(f"--matmul-precision applies to JAX models; case {case.name} is "
                           "not one (torch runs float32 matmuls in float32 unless the model "
                           "enables TF32 itself)")
    if options.dtype is not None:
        cast_case(case, options.dtype)
    return PreparedCapture(case, path, options).run(progress=options.progress)


class PreparedCapture:
    """A capture set up (options checked, file created, ring allocated) but not yet run.

    ``capture`` is this in one call; benchmarks use it to time the steps apart from setup.
    """

    def __init__(self, case: Case, path: str | os.PathLike,
                 options: CaptureOptions | None = None, *, async_device: bool = True,
                 **given: Any) -> None:
        options = CaptureOptions.of(options, **given)
        self.case = case
        self.steps = case.steps if options.steps is None else options.steps
        self.routes = options.force_routing
        self.loss_scale = options.loss_scale
        self.autocast = options.autocast
        check_run_options(case, self.steps, options.loss_scale)
        autocast_context(case, options.autocast)  # an unknown autocast dtype fails before any file
        check_writable(path)
        modules = select_modules(case.model, options.include, options.exclude)
        # checked before the file exists: a glob that matches nothing is a typo
        op_modules = (select_op_modules(case.model, options.ops, modules) if options.ops
                      else set())
        meta = _meta(case, options.include, options.exclude)
        meta.update(options.meta(self.steps), autocast=options.autocast,
                    model_dtype=model_dtype(case))
        meta["ops"] = {"globs": list(options.ops), "modules": sorted(op_modules),
                       "all": options.ops_all}
        if self.routes is not None:
            self.routes.check_steps(self.steps, case.name)
            meta["forced_routing"] = {"from": self.routes.source, "routes": sum(
                len(routes) for routes in self.routes.routes.values())}
        if options.record_steps is not None:
            meta["recorded_steps"] = sorted(options.record_steps)
        data_parallel = data_parallel_meta(case.model)
        if data_parallel is not None:
            meta["data_parallel"] = data_parallel
        keep = self._kept(case, options, modules, meta)
        self.recorder = Recorder(path, meta, summary=options.summary,
                                 queue_bytes=options.queue_bytes, keep=keep)
        try:
            self.stager = Stager(self.recorder, async_device=async_device)
            self.hooks = ModuleRecorder(modules, self.stager, weights=options.weights,
                                        record_steps=options.record_steps)
            self.ops = (OpRecorder(case.model, self.hooks, options.ops,
                                   all_ops=options.ops_all) if options.ops else None)
        except BaseException:  # the writer threads and the file must not outlive a failed setup
            _close_incomplete(self.recorder)
            raise

    @staticmethod
    def _kept(case: Case, options: CaptureOptions, modules: list,
              meta: dict[str, Any]) -> Callable[[str], bool] | None:
        """Which sites keep tensor data when ``--full-around`` or ``data_modules`` narrow it
        (None: every site), recorded in ``meta``."""
        kept: set[str] = set()
        if options.full_around:
            kept = around_modules(case.model, options.full_around, options.radius)
            meta["full_around"] = {"around": list(options.full_around),
                                   "radius": options.radius, "modules": sorted(kept)}
        if options.data_modules is not None:
            named = {path for path, _ in modules}
            unknown = sorted(options.data_modules - {path for path, _ in
                                                     select_modules(case.model, (), ())})
            if unknown:
                raise CaptureError(f"data_modules names no module {', '.join(unknown[:4])} of "
                                   f"{type(case.model).__name__}")
            meta["data_modules"] = sorted(options.data_modules & named)
            kept = kept | options.data_modules
        if options.full_around or options.data_modules is not None:
            return partial(_keeps, frozenset(kept))
        return None

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
                    f"published ({partial} holds what was recorded up to there)"
                    f"{_loss_parallel_advice(exc, observer.phase)}") from exc
            except BaseException:  # KeyboardInterrupt: leave the partial file, publish nothing
                _close_incomplete(recorder)
                raise
            finally:
                if self.ops is not None:
                    self.ops.detach()
                hooks.detach()
        # how the ranks' parts of the sharded records make the whole (none: nothing added)
        recorder.add_meta(self.stager.layouts.meta())
        return recorder.close(complete=True)


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


def _meta(case: Case, include: Sequence[str], exclude: Sequence[str]) -> dict[str, Any]:
    """What only a torch capture knows of its run (the options' part: ``options.meta``)."""
    from layerdiff.capture.hooks import shared_parameters

    meta = base_meta("layerdiff.capture (torch)")
    first = next(case.model.parameters(), None)
    meta.update({
        "case": case.name,
        "seed": case.seed,
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
        name = module_type_name(module)
        if name not in found:
            signature = Signature.of(module.forward)
            if signature is not None:
                found[name] = signature.as_json()
    return found


def _loss_parallel_advice(exc: Exception, phase: str) -> str:
    """Advice for a DTensor loss whose backward ran outside the context it needs."""
    if phase != "backward" or "mixed torch.Tensor and DTensor" not in str(exc):
        return ""
    return ("; if the model's loop runs the loss and backward under torch's loss_parallel(), "
            "give the case step_context=loss_parallel (docs/distributed.md)")
