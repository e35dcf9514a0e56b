"""Fuzz the trace reader: mutate small real traces and check every mutant is refused or read right.

    python scripts/fuzz_trace.py --cases 10000 [--seed 0] [--workers 2] [--timeout 20]

Seed traces (captured once, in a subprocess, from bundled cases): the MLP reference, the same as
a summary trace (no tensor data) and a two-step capture. Each case copies one seed, applies one
mutation (a family below, its details drawn from a seeded RNG) and, in a forked child with a
wall-clock timeout and an address-space cap (RLIMIT_AS), runs ``layerdiff.open_trace``, the
``layerdiff.show`` functions, a read of every tensor, and ``layerdiff.diff(original, mutant)``.

Each outcome is one class:

- ``refused``: a LayerdiffError whose message is one line naming the mutant file;
- ``refused-badly``: a LayerdiffError whose message is several lines or does not name the file;
- ``passed-correctly``: no error, the mutant's *content* equals the original's and the diff
  result equals the unmutated diff's. Content is every root attribute, every column of /index
  and /sites (values and dtype), every segment's bytes, and how each dataset is stored (plain,
  external, virtual, linked): a mutant equal in all of them holds what the original holds, so
  the same answer is the right one;
- ``silent-pass``: no error, the content changed, and the diff result is still the unmutated
  one (a damaged file passed as if it were the original);
- ``silent-different``: no error, the content changed and the diff result changed (the file
  was read as something else without a word: a wrong answer unless the edit is a plausible
  trace, see docs/reliability.md);
- ``wrong-on-same``: no error, the content is the original's but the result differs;
- ``exception``: any other exception (counted by type and by file:line);
- ``hang``: the child outlived the timeout; ``crash``: the child died of a signal (or of the
  memory cap without a Python MemoryError).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SEEDS = {
    "mlp": "capture(load_case(MLP), OUT)",
    "mlp-summary": "capture(load_case(MLP), OUT, summary=True)",
    "mlp-2step": "capture(load_case(MLP), OUT, steps=2)",
}
FAMILIES = ("byte_flip", "truncate", "zero_block", "attr_edit", "meta_edit", "column_edit",
            "column_replace", "delete", "external")
MEMORY_CAP = 2 << 30  # bytes of address space a child may add to what the parent maps
BAD = ("refused-badly", "silent-pass", "silent-different", "wrong-on-same", "exception",
       "hang", "crash")


# ---------------------------------------------------------------------------- seed traces

def capture_seeds(folder: Path) -> dict[str, Path]:
    """Capture the seed traces in a subprocess (torch stays out of this process, which forks)."""
    paths = {name: folder / f"{name}.h5" for name in SEEDS}
    lines = ["from layerdiff import capture, load_case",
             "MLP = 'reference_models.mlp:reference'"]
    for name, call in SEEDS.items():
        lines.append(call.replace("OUT", repr(str(paths[name]))))
    subprocess.run([sys.executable, "-c", "\n".join(lines)], check=True, cwd=ROOT)
    return paths


# ---------------------------------------------------------------------------- mutations

def _h5():
    import h5py
    return h5py


def _datasets(path: Path) -> list[str]:
    h5py = _h5()
    names: list[str] = []
    with h5py.File(path, "r") as h5:
        h5.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) else None)
    return sorted(names)


def byte_flip(path: Path, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    count = rng.choice([1, 1, 1, 2, 4, 16])
    spots = [rng.randrange(len(data)) for _ in range(count)]
    for spot in spots:
        data[spot] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))
    return f"{count} byte(s) flipped at {spots[:4]}"


def truncate(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    length = rng.randrange(size)
    with open(path, "r+b") as handle:
        handle.truncate(length)
    return f"cut to {length} of {size} bytes"


def zero_block(path: Path, rng: random.Random) -> str:
    size = path.stat().st_size
    block = rng.choice([512, 4096])
    count = rng.choice([1, 1, 2, 3])
    starts = [rng.randrange(max(size // block, 1)) * block for _ in range(count)]
    with open(path, "r+b") as handle:
        for start in starts:
            handle.seek(start)
            handle.write(bytes(min(block, size - start)))
    return f"{count} zeroed {block} B block(s) at {starts}"


_COMPLETE = ["false", "no", "True", "true", "1", b"True", float("nan"), 1, 0, 1.0, -1, "",
             np.array([True, True]), np.int8(1)]
_VERSION = [0, -1, 2, 99, "1", "one", float("nan"), 1.5, 2**62, np.array([1, 1]), b"1"]
_FORMAT = ["layerdiff-trac", "", b"layerdiff-trace", 1, np.array([1, 2])]


def attr_edit(path: Path, rng: random.Random) -> str:
    h5py = _h5()
    with h5py.File(path, "r+") as h5:
        name = rng.choice(["complete", "complete", "layerdiff_version", "layerdiff_format",
                           "summary", "meta", "delete"])
        if name == "delete":
            victim = rng.choice(list(h5.attrs))
            del h5.attrs[victim]
            return f"attribute {victim} deleted"
        pool = {"complete": _COMPLETE, "layerdiff_version": _VERSION,
                "layerdiff_format": _FORMAT, "summary": ["yes", 2, float("nan"), True, False],
                "meta": [1, b"\xff\xfe{}", np.array([1.0]), ""]}[name]
        value = rng.choice(pool)
        h5.attrs[name] = value
        return f"attribute {name} = {value!r}"


def _meta_values(rng: random.Random, meta: dict) -> tuple[str, str]:
    choice = rng.randrange(16)
    depth = rng.choice([50, 999, 5000, 100000])
    if choice == 0:
        return "[" * depth + "]" * depth, f"nested list, depth {depth}"
    if choice == 1:
        return '{"a":' * depth + "1" + "}" * depth, f"nested object, depth {depth}"
    if choice == 2:
        text = json.dumps(meta)
        cut = rng.randrange(len(text))
        return text[:cut], f"cut at {cut}"
    if choice == 3:
        return "9" * rng.choice([400, 5000, 100000]), "huge integer"
    if choice == 4:
        return rng.choice(["[]", '"x"', "3", "null", "true"]), "not an object"
    key, value = rng.choice([
        ("loss_scale", 0), ("loss_scale", -1), ("loss_scale", "NaN"), ("loss_scale", "1"),
        ("loss_scale", True), ("loss_scale", 1e400), ("loss_scale", 10**400),
        ("loss_scale", None), ("loss_scale", []), ("loss_scale", 1e-310),
        ("versions", "torch 2"), ("versions", []), ("versions", {"a": {"b": []}}),
        ("case", ["x"]), ("case", 1e308), ("steps", "two"), ("seed", {}), ("device", 1),
        ("producer", None), ("case", "\udcff"), ("dtype", 7), ("autocast", [1]),
    ])
    meta = dict(meta)
    meta[key] = value
    text = json.dumps(meta, allow_nan=True)
    if value == 1e400:
        text = text.replace("Infinity", "1e400")
    if value == "NaN" and rng.random() < 0.5:
        text = text.replace('"NaN"', "NaN")
    return text, f"meta {key} = {value!r}"[:80]


def meta_edit(path: Path, rng: random.Random) -> str:
    h5py = _h5()
    with h5py.File(path, "r+") as h5:
        meta = json.loads(h5.attrs["meta"])
        text, what = _meta_values(rng, meta)
        h5.attrs["meta"] = text
        return what


_STRINGS = {
    "shape": ["", "a", "-1", "1e12", "1000000,1000000", "3,,4", "99999999999999999999",
              "1000000000000", "4, 8", "0", "2,3", "1," * 40 + "1", "nan"],
    "dtype": ["float33", "object", "U10", "V0", "", "bfloat16", "int8", "float64", "O",
              "complex128", "float16", "bool", "S3", "M8", "float8_e4m3fn", "uint64"],
    "kind": ["", "tensor", "value", "tensors", "\x00"],
    "role": ["", "input", "output", "weight", "grad_input", "x"],
    "pass": ["", "forward", "backward", "sideways"],
    "site": ["", "#", "fc1", "fc1#x", "fc1#99999999999999999999", "fc1#-1", "<root>#0",
             "a" * 5000],
    "digest": ["", "0" * 16, "zz", "x" * 1000],
    "value": ["", "nan", "{", "[" * 5000, "null"],
}
_INTS = {
    "segment": [-2, -1, 0, 1, 999999, 2**31 - 1, -(2**31)],
    "offset": [-1, 1, 63, 2**40, 2**62, -(2**62)],
    "nbytes": [0, -1, 1, 4, 2**40, 2**62, -(2**62)],
    "numel": [0, -1, 1, 10**12, 2**62],
    "nan": [-1, 1, 2**62],
    "inf": [-1, 1],
    "seq": [-1, 0, 2**62],
    "step": [-1, 1, 2**31 - 1, -(2**31)],
    "call": [-1, 1, 2**31 - 1],
    "enter_seq": [-1, 2**62, 0],
    "exit_seq": [-2, 2**62],
}
_FLOATS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e308, 5e-324]


def column_edit(path: Path, rng: random.Random) -> str:
    h5py = _h5()
    with h5py.File(path, "r+") as h5:
        table = rng.choice(["index", "index", "index", "sites"])
        column = rng.choice(sorted(h5[table]))
        dataset = h5[table][column]
        if not len(dataset):
            return f"{table}/{column} is empty: no edit"
        rows = sorted({rng.randrange(len(dataset)) for _ in range(rng.choice([1, 1, 3]))})
        if dataset.dtype.kind == "O":
            if rng.random() < 0.25:  # bytes that are not UTF-8 in a UTF-8 column
                value = rng.choice([b"\xff", b"fc1\xc3#0", b"\xed\xa0\x80", b"\x80abc"])
            else:
                value = rng.choice(_STRINGS.get(column, ["", "x", "\x00", "é" * 3]))
        elif dataset.dtype.kind == "f":
            value = rng.choice([*_FLOATS, float(dataset[rows[0]]) * (1 + 1e-06)])
        else:
            value = rng.choice([*_INTS.get(column, [-1, 2 ** 31 - 1]), int(dataset[rows[0]]) + 1])
        for row in rows:
            dataset[row] = value
        return f"{table}/{column} rows {rows[:3]} = {value!r}"[:100]


def column_replace(path: Path, rng: random.Random) -> str:
    """A column replaced by a dataset of the wrong type, length or rank."""
    h5py = _h5()
    with h5py.File(path, "r+") as h5:
        table = rng.choice(["index", "sites"])
        column = rng.choice(sorted(h5[table]))
        old = h5[table][column]
        length = len(old)
        how = rng.choice(["shorter", "longer", "2-D", "scalar", "strings", "floats", "ints",
                          "bytes", "empty", "group", "compound"])
        del h5[table][column]
        group = h5[table]
        if how == "shorter":
            group.create_dataset(column, data=np.zeros(max(length - 1, 0), np.int64))
        elif how == "longer":
            group.create_dataset(column, data=np.zeros(length + 5, np.int64))
        elif how == "2-D":
            group.create_dataset(column, data=np.zeros((length, 2), np.int64))
        elif how == "scalar":
            group.create_dataset(column, data=3)
        elif how == "strings":
            group.create_dataset(column, data=np.array(["1"] * length, dtype=object),
                                 dtype=h5py.string_dtype())
        elif how == "floats":
            group.create_dataset(column, data=np.full(length, 0.5))
        elif how == "ints":
            group.create_dataset(column, data=np.arange(length, dtype=np.int64))
        elif how == "bytes":
            group.create_dataset(column, data=np.array([b"ab"] * length, dtype="S2"))
        elif how == "empty":
            group.create_dataset(column, shape=(0,), dtype=np.float64)
        elif how == "group":
            group.create_group(column)
        else:
            group.create_dataset(column, data=np.zeros(length, [("a", "i4"), ("b", "f8")]))
        return f"{table}/{column} replaced: {how}"


def delete(path: Path, rng: random.Random) -> str:
    h5py = _h5()
    names = [*_datasets(path), "index", "sites", "tensors"]
    victim = rng.choice(names)
    with h5py.File(path, "r+") as h5:
        if rng.random() < 0.3 and victim in ("index", "sites", "tensors"):
            del h5[victim]
            h5.create_dataset(victim, data=np.arange(4))
            return f"/{victim} replaced by a dataset"
        if rng.random() < 0.2:
            del h5[victim]
            h5[victim] = h5py.SoftLink(f"/{victim}")  # a link to itself
            return f"/{victim} replaced by a soft link to itself"
        del h5[victim]
    return f"/{victim} deleted"


def external(path: Path, rng: random.Random) -> str:
    """Datasets that read other local files: external storage, external links, virtual."""
    h5py = _h5()
    other = path.with_name(path.stem + ".other.h5")
    shutil.copyfile(path, other)
    names = _datasets(path)
    victim = rng.choice(names)
    how = rng.choice(["storage", "link", "virtual", "group-link"])
    with h5py.File(path, "r+") as h5:
        if how == "group-link":
            group = rng.choice(["index", "sites", "tensors"])
            del h5[group]
            h5[group] = h5py.ExternalLink(str(other), f"/{group}")
            return f"/{group} is an external link to a copy"
        data = h5[victim][()]
        dtype = h5[victim].dtype
        del h5[victim]
        if how == "link":
            h5[victim] = h5py.ExternalLink(str(other), f"/{victim}")
        elif how == "virtual":
            layout = h5py.VirtualLayout(shape=data.shape, dtype=dtype)
            layout[...] = h5py.VirtualSource(str(other), f"/{victim}", shape=data.shape)
            h5.create_virtual_dataset(victim, layout)
        else:
            if dtype.kind == "O":
                return external(path, rng)  # variable-length strings cannot be external
            raw = path.with_name(path.stem + ".raw")
            np.ascontiguousarray(data).tofile(raw)
            h5.create_dataset(victim, shape=data.shape, dtype=dtype,
                              external=[(str(raw), 0, h5py.h5f.UNLIMITED)])
        return f"/{victim} through {how} into another file (same bytes)"


MUTATIONS = {name: globals()[name] for name in FAMILIES}


# ---------------------------------------------------------------------------- content

def content(path: Path) -> dict[str, str]:
    """What a reader's answer can depend on: attributes, tables, segment bytes, storage."""
    h5py = _h5()
    parts: dict[str, str] = {}
    with h5py.File(path, "r") as h5:
        for key in sorted(h5.attrs):
            parts[f"attr {key}"] = repr(h5.attrs[key])

        def visit(name: str) -> None:
            link = h5.get(name, getlink=True)
            item = h5.get(name)
            kind = type(link).__name__
            if isinstance(item, h5py.Dataset):
                kind += f" external={item.external} virtual={item.is_virtual}"
                digest = hashlib.sha256(repr((item.dtype.str, item.shape)).encode())
                values = item[()]
                if item.dtype.kind == "O":
                    for value in np.asarray(values).reshape(-1):
                        digest.update(repr(value).encode())
                else:
                    digest.update(np.ascontiguousarray(values).tobytes())
                parts[name] = kind + " " + digest.hexdigest()
            else:
                parts[name] = kind

        names: list[str] = []
        h5.visit(names.append)
        for name in sorted(names):
            visit(name)
    return parts


# Columns no part of the diff reads for site pairs found by name (grep the code: exit_seq is
# read by nothing in compare/ or report/; a site's type only by the structural guess for sites
# left unpaired by name and by hints at an origin; parent only when an origin is narrowed to a
# child): a mutant that changed only these and gives the unmutated answer answered right.
UNREAD = {"sites/exit_seq", "sites/type", "sites/parent",
          # the tables' digests guard the tables; without them a trace reads as one from
          # before they were written (or from another writer): same content, same answer
          "attr index_digest", "attr sites_digest", "attr meta_digest",
          # an empty /tensors group (a summary trace's): its segments, when it has any, are
          # content of their own (tensors/NNNNNN), so deleting a full one still changes them
          "tensors"}


def changed(original: dict[str, str], mutant: dict[str, str]) -> list[str]:
    return sorted(k for k in original.keys() | mutant.keys()
                  if original.get(k) != mutant.get(k))


# ---------------------------------------------------------------------------- one case

def normalized(result, paths: dict[str, str]) -> str:
    text = json.dumps(result.as_json(), sort_keys=True, default=str)
    for path, token in paths.items():
        text = text.replace(path, token)
    return text


def exercise(original: Path, mutant: Path) -> str:
    """What a user does with a trace: open, show, read every tensor, diff. The diff's answer."""
    import layerdiff
    from layerdiff import show

    with layerdiff.open_trace(mutant) as trace:
        records = show.select_records(trace, site="*", role=None, step=None)
        show.format_records(records)
        show.header_lines(trace)
        steps = sorted({int(s) for s in trace.sites["step"]}) or [0]
        show.format_sites(show.site_summary(trace, steps[0]))
        json.dumps(show.records_json(trace, records), allow_nan=False)
        for position in np.flatnonzero(((trace.index["kind"] == "tensor")
                                        & (trace.index["segment"] >= 0)).to_numpy()):
            trace.read(int(position))
    result = layerdiff.diff(original, mutant)
    return normalized(result, {str(original): "REF", str(mutant): "PORT"})


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/layerdiff/" in f.filename] or frames
    frame = ours[-1] if ours else None
    if frame is None:
        return "?"
    name = frame.filename
    name = name[name.index("layerdiff/"):] if "layerdiff/" in name else os.path.basename(name)
    return f"{name}:{frame.lineno}"


@dataclass
class Seed:
    name: str
    path: Path
    answer: str           # the unmutated diff's normalized result
    content: dict[str, str]


def run_case(seed: Seed, family: str, number: int, rng_seed: int, folder: Path) -> dict:
    """Mutate a copy of ``seed`` and exercise it (in this process: call it in a child)."""
    mutant = folder / f"case{number}.h5"
    shutil.copyfile(seed.path, mutant)
    what = MUTATIONS[family](mutant, random.Random(rng_seed))
    out = {"family": family, "seed": seed.name, "what": what}
    from layerdiff.errors import LayerdiffError

    try:
        answer = exercise(seed.path, mutant)
    except LayerdiffError as exc:
        message = str(exc)
        good = "\n" not in message and str(mutant) in message and len(message) < 1000
        out.update(outcome="refused" if good else "refused-badly", detail=message[:300],
                   type=type(exc).__name__)
        return out
    except BaseException as exc:
        out.update(outcome="exception", type=type(exc).__name__, where=_where(exc),
                   detail=str(exc)[:200])
        return out
    try:
        diffs = changed(seed.content, content(mutant))
    except Exception as exc:
        diffs = [f"unreadable by h5py: {type(exc).__name__}"]
    same = answer == seed.answer
    if not diffs or (same and set(diffs) <= UNREAD):
        out["outcome"] = "passed-correctly" if same else "wrong-on-same"
    else:
        out["outcome"] = "silent-pass" if same else "silent-different"
    out["detail"] = "changed: " + ", ".join(diffs[:4])
    return out


def _child(conn, seed: Seed, family: str, number: int, rng_seed: int, folder: Path) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as handle:
        mapped = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + MEMORY_CAP, hard))
    try:
        result = run_case(seed, family, number, rng_seed, folder)
    except MemoryError:
        result = {"family": family, "seed": seed.name, "outcome": "exception",
                  "type": "MemoryError", "where": "?", "what": "?"}
    except BaseException as exc:
        result = {"family": family, "seed": seed.name, "outcome": "mutation-failed",
                  "what": f"{type(exc).__name__}: {exc}"[:200]}
    conn.send(result)
    conn.close()


def run_isolated(seed: Seed, family: str, number: int, rng_seed: int, folder: Path,
                 timeout: float) -> dict:
    """One case in a forked child: a hang and a crash are outcomes, not the fuzzer's end."""
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(child, seed, family, number, rng_seed,
                                                   folder))
    process.start()
    child.close()
    result = None
    if parent.poll(timeout):
        try:
            result = parent.recv()
        except EOFError:
            result = None
    process.join(1 if result is not None else 0.1)
    if process.is_alive():
        process.kill()
        process.join()
        if result is None:
            result = {"family": family, "seed": seed.name, "outcome": "hang",
                      "what": f"case {number} (rng {rng_seed})", "detail": f">{timeout:g} s"}
    if result is None:
        result = {"family": family, "seed": seed.name, "outcome": "crash",
                  "what": f"case {number} (rng {rng_seed})",
                  "detail": f"exit {process.exitcode}"}
    for leftover in folder.glob(f"case{number}.*"):
        leftover.unlink()
    result.update(number=number, rng=rng_seed)
    return result


# ---------------------------------------------------------------------------- the run

def prepare(folder: Path) -> list[Seed]:
    import layerdiff

    seeds = []
    for name, path in capture_seeds(folder).items():
        copy = folder / f"{name}.copy.h5"
        shutil.copyfile(path, copy)
        answer = normalized(layerdiff.diff(path, copy), {str(path): "REF", str(copy): "PORT"})
        seeds.append(Seed(name, path, answer, content(path)))
    return seeds


def plan(cases: int, seed: int) -> list[tuple[int, int, str, int]]:
    """(case number, seed trace, family, rng seed) for every case: same arguments, same run."""
    rng = random.Random(seed)
    return [(n, n % len(SEEDS), FAMILIES[n % len(FAMILIES)], rng.randrange(2**32))
            for n in range(cases)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--budget", type=float, default=0.0,
                        help="stop starting cases after this many seconds (0: no limit)")
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write every outcome here")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fuzz-trace-") as tmp:
        folder = Path(tmp)
        seeds = prepare(folder)
        jobs = plan(args.cases, args.seed)
        results: list[dict] = []
        lock = threading.Lock()
        todo = iter(jobs)

        def worker() -> None:
            while True:
                with lock:
                    job = next(todo, None)
                if job is None or (args.budget and time.monotonic() - started > args.budget):
                    return
                number, seed_at, family, rng_seed = job
                result = run_isolated(seeds[seed_at], family, number, rng_seed, folder,
                                      args.timeout)
                with lock:
                    results.append(result)
                    if len(results) % 250 == 0:
                        print(f"  {len(results)} cases, {time.monotonic() - started:.0f} s",
                              file=sys.stderr, flush=True)

        threads = [threading.Thread(target=worker) for _ in range(args.workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    elapsed = time.monotonic() - started
    results.sort(key=lambda r: r["number"])
    print(report(results, args, elapsed))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 1 if any(r["outcome"] in BAD for r in results) else 0


def report(results: list[dict], args, elapsed: float) -> str:
    command = (f"python scripts/fuzz_trace.py --cases {args.cases} --seed {args.seed} "
               f"--workers {args.workers} --timeout {args.timeout:g}"
               + (f" --budget {args.budget:g}" if args.budget else ""))
    outcomes = ["refused", "passed-correctly", *BAD, "mutation-failed"]
    lines = [f"$ {command}", f"{len(results)} cases in {elapsed:.0f} s", ""]
    header = f"{'family':<16}" + "".join(f"{o[:10]:>11}" for o in outcomes)
    lines += [header, "-" * len(header)]
    by_family = collections.defaultdict(collections.Counter)
    for result in results:
        by_family[result["family"]][result["outcome"]] += 1
    total = collections.Counter(r["outcome"] for r in results)
    for family in [*FAMILIES, "all"]:
        counts = total if family == "all" else by_family[family]
        lines.append(f"{family:<16}" + "".join(f"{counts[o]:>11}" for o in outcomes))
    exceptions = [r for r in results if r["outcome"] == "exception"]
    if exceptions:
        lines += ["", "uncaught exceptions by type and place:"]
        places = collections.Counter((r["type"], r.get("where", "?")) for r in exceptions)
        for (kind, where), count in places.most_common(20):
            lines.append(f"  {count:>5}  {kind:<20} {where}")
    for outcome in BAD:
        bad = [r for r in results if r["outcome"] == outcome]
        if bad:
            lines += ["", f"first {outcome} cases:"]
            for r in bad[:args.examples]:
                lines.append(f"  #{r['number']} {r['seed']} {r['family']}: {r['what']}"[:160])
                if r.get("detail"):
                    lines.append(f"      {r.get('type', '')} {r['detail']}"[:160])
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
