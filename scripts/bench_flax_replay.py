"""How long replay into a Flax NNX port takes, op by op (before) and with each call compiled
once per module structure and call shape (after: ``layerdiff/flax/calls.py``).

    python scripts/bench_flax_replay.py [--pair gemma --pair flax_mlp --pair gemma:6]
                                        [--per-site]

Each pair's reference is captured once; then each way runs in a fresh process (JAX keeps
what it compiled for the life of a process, so a second run in the same one would be
warm): ``layerdiff.replay(reference, port, mapping=..., propagated=False)``, timed from the
call to its result (the weights loaded, the port's forward watched, every paired site
replayed, the replay diffed), with the sites it replayed. ``gemma:N`` is the Gemma
validation pair (tests/validation/) with N decoder layers instead of 2. Both ways must
reach the same verdict at every site, or the script says so and exits 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIRS = {
    "flax_mlp": ("reference_models.flax_mlp_reference:reference",
                 "reference_models.flax_mlp:port", "reference_models/flax_mlp.map.toml"),
    "gemma": ("tests.validation.gemma_cases:reference", "tests.validation.gemma_cases:port",
              "tests/validation/gemma.map.toml"),
}


def _cases(pair: str) -> tuple[str, str, Path, int | None]:
    name, _, layers = pair.partition(":")
    reference, port, mapping = PAIRS[name]
    return reference, port, ROOT / mapping, int(layers) if layers else None


def _deepen(layers: int | None) -> None:
    """The Gemma pair with ``layers`` decoder layers: both sides read the count when built."""
    if layers is not None:
        from tests.validation import gemma_cases, gemma_reference

        gemma_reference.LAYERS = gemma_cases.LAYERS = layers


def _child(pair: str, mode: str, reference: str, per_site: bool) -> None:
    """One way, timed, in this fresh process; prints one JSON line."""
    from layerdiff import load_case, replay
    from layerdiff.flax import replay as flax_replay

    _, port, mapping, layers = _cases(pair)
    _deepen(layers)
    timings: list[tuple[str, float]] = []
    original = flax_replay.FlaxPort

    class Timed(original):   # each site's own time, beside the total
        def replay(self, call, site, *args, **kwargs):
            start = time.perf_counter()
            try:
                return super().replay(call, site, *args, **kwargs)
            finally:
                timings.append((site, time.perf_counter() - start))

    flax_replay.FlaxPort = functools.partial(Timed, compiled=mode == "after")
    case = load_case(port)
    start = time.perf_counter()
    result = replay(reference, case, mapping=mapping, propagated=False)
    seconds = time.perf_counter() - start
    verdicts = {f"{row.port_site} {row['pass']}": row.verdict
                for _, row in result.local.iterrows()}
    print(json.dumps({"sites": len(result.replayed), "seconds": seconds,
                      "layers_seconds": sum(t for _, t in timings), "passed": result.passed,
                      "verdicts": verdicts, "per_site": timings if per_site else []}))


def _run(pair: str, mode: str, reference: Path, per_site: bool) -> dict:
    command = [sys.executable, __file__, "--child", pair, mode, str(reference)]
    if per_site:
        command.append("--per-site")
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{pair} ({mode}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _capture(pair: str, folder: Path) -> Path:
    from layerdiff import capture, load_case

    reference, _, _, layers = _cases(pair)
    _deepen(layers)
    return Path(capture(load_case(reference), folder / f"{pair.replace(':', '_')}.h5"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", action="append", choices=[*PAIRS, *(f"gemma:{n}"
                                                                      for n in range(1, 33))])
    parser.add_argument("--per-site", action="store_true", help="each site's seconds too")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, per_site=args.per_site)
        return 0
    pairs = args.pair or ["flax_mlp", "gemma", "gemma:6"]
    rows, disagree = [], []
    with tempfile.TemporaryDirectory(prefix="bench-flax-replay-") as tmp:
        for pair in pairs:
            reference = subprocess.run(
                [sys.executable, "-c", "import sys; sys.path.insert(0, '.'); "
                 "from scripts.bench_flax_replay import _capture; from pathlib import Path; "
                 f"print(_capture({pair!r}, Path({tmp!r})))"],
                cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()[-1]
            before = _run(pair, "before", Path(reference), args.per_site)
            after = _run(pair, "after", Path(reference), args.per_site)
            if before["verdicts"] != after["verdicts"] or before["passed"] != after["passed"]:
                disagree.append(pair)
            rows.append((pair, before, after))
            for mode, run in (("before", before), ("after", after)):
                for site, seconds in run["per_site"]:
                    print(f"  {pair} {mode} {site} {seconds:.3f} s")
    print("| pair | sites | before s | after s | before s/site | after s/site | "
          "before / after | of which sites' own calls: before s | after s | before / after |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for pair, before, after in rows:
        sites = after["sites"]
        print(f"| {pair} | {sites} | {before['seconds']:.1f} | {after['seconds']:.1f} | "
              f"{before['seconds'] / sites:.2f} | {after['seconds'] / sites:.2f} | "
              f"{before['seconds'] / after['seconds']:.1f}x | "
              f"{before['layers_seconds']:.1f} | {after['layers_seconds']:.1f} | "
              f"{before['layers_seconds'] / after['layers_seconds']:.1f}x |")
    for pair in disagree:
        print(f"{pair}: the two ways reached different verdicts")
    return 1 if disagree else 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    sys.exit(main())
