"""A port that runs and records itself (an :class:`~layerdiff.case.ExternalCase`: numpy, JAX
code layerdiff does not hook, a C++ binding) behind the framework interface. It is given a
:class:`~layerdiff.trace.TraceWriter` and records its own sites; layerdiff cannot cast it or
set its weights, and replays its layers only through the per-site callables it gives
(:mod:`layerdiff.replay.numpy_replay`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NoReturn

from layerdiff.errors import CaptureError, CaseError, LayerdiffError, interrupt_inside
from layerdiff.options import CaptureOptions
from layerdiff.rng import seed_everything

# what a capture can still choose for a port that records itself: the rest is its own code's
ACCEPTED = frozenset({"loss_scale", "steps", "summary", "queue_bytes", "progress", "weights",
                      "extra_meta"})


class ExternalFramework:
    name = "external"
    title = "a port that records itself"
    records_itself = True

    def owns(self, case: Any) -> bool:
        # asked last: a case with no model of a known framework that runs itself
        return getattr(case, "model", case) is case and callable(getattr(case, "run", None))

    def check_case(self, case: Any) -> None:
        pass

    def cast(self, case: Any, dtype: str) -> None:
        raise CaptureError(f"case {case.name} records itself, so --dtype and --autocast do "
                           "not apply to it; run the port in that precision in its own code")

    def load_weights(self, case: Any, trace: str | os.PathLike, mapping: Any) -> NoReturn:
        raise CaptureError(f"case {case.name} records itself, so layerdiff cannot set its "
                           "weights; load them from the reference in the port's own code")

    def capture(self, case: Any, path: str | os.PathLike, options: CaptureOptions) -> Path:
        from layerdiff.trace.writer import TraceWriter

        options.refuse(ACCEPTED, case.name, "records itself")
        steps = case.steps if options.steps is None else options.steps
        meta = {"case": case.name, "seed": case.seed, **options.meta(steps)}
        seed_everything(case.seed)
        writer = TraceWriter(path, meta=meta, summary=options.summary,
                             queue_bytes=options.queue_bytes,
                             producer=f"layerdiff.ExternalCase ({case.name})")
        try:
            case.run(writer, steps=steps, loss_scale=options.loss_scale)
        except LayerdiffError:
            writer.close(complete=False)
            raise
        except Exception as exc:
            writer.close(complete=False)
            if interrupt_inside(exc) is not None:
                raise KeyboardInterrupt from exc
            raise CaptureError(f"case {case.name}: the port raised {type(exc).__name__}: "
                               f"{exc} at step {writer.current_step}; no trace was "
                               "published") from exc
        except BaseException:
            writer.close(complete=False)
            raise
        return writer.close()

    def replay_port(self, case: Any, reference: Any, mapping: Any) -> Any:
        if not case.layers:
            raise CaptureError(f"case {case.name} records itself and gives no per-site "
                               "layers, so its layers cannot be replayed one by one; give "
                               "the ExternalCase a 'layers' dict of forward/backward callables")
        from layerdiff.replay.numpy_replay import CallablePort

        return CallablePort(case.layers, reference)

    def port_model(self, case: Any, command: str) -> NoReturn:
        raise CaseError(f"case {case.name or '?'}: {command} needs a layerdiff.Case whose "
                        "model is a torch or Flax NNX module (it loads weights into it and "
                        "runs it), got an ExternalCase; for a port that records itself, check "
                        "the names with diff --map")

    def as_array(self, tensor: Any) -> Any:
        return tensor.numpy()

    def run_checked(self, case: Any, writer: Any, steps: int) -> None:
        case.run(writer, steps=steps, loss_scale=1.0)

    def nan_op(self, case: Any, result: Any) -> None:
        return None  # its code is its own: layerdiff cannot re-run one of its calls

    def swap_donor(self, case: Any) -> None:
        return None  # its layers go into a torch reference as they are


FRAMEWORK = ExternalFramework()
