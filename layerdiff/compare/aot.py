"""The metric kernel compiled ahead of time: a diff's first pair without numba's set-up.

A process's first compiled metric costs ~0.4 s before it reads a byte: ``import numba``, then
numba's CPU target registering its implementations (scipy's import among them) on the first
cached load of :mod:`layerdiff.compare.kernels`. The same ``fused`` kernel compiled ahead of
time with ``numba.pycc`` is a plain extension module: loading it takes ~2 ms and needs
neither numba nor scipy, and it runs the same LLVM code, so its results are the JIT's bit for
bit (``scripts/aot_kernel.py`` and tests/test_aot_kernel.py check that).

Where it is kept: ``$LAYERDIFF_KERNEL_CACHE`` (an absolute path; a relative one is refused, as
it would name a folder inside whatever folder the diff runs in), else
``$XDG_CACHE_HOME/layerdiff/kernels`` (an absolute ``XDG_CACHE_HOME`` only, as the XDG spec
says), else ``~/.cache/layerdiff/kernels``. It is named by the kernel's source, numba's and
numpy's versions, the Python ABI and this machine's CPU (it is compiled for the host CPU's
instructions), so an edit, an upgrade or another machine never loads a stale or foreign build.

What is trusted: loading an extension module runs its code, and its name is no secret, so
:func:`load` runs only what this user's layerdiff built (:func:`build` writes the module and
``<module>.sha256`` beside it). It loads nothing unless the cache folder and every folder
above it can be changed by this user (or root) alone, the module and its record are regular
files (no link) owned by this user that no one else can write, and the module's sha256 is its
record's. It hashes the bytes it read and loads those bytes (a private copy), not the path
again. On any doubt it says why in one line on stderr and the JIT serves, as it does where no
build exists. A cache folder shared with other users is therefore never used.

Where none is built, the first diff that would use it starts ``python -m layerdiff.compare.aot``
in the background (niced, its output discarded, at most one build per module at a time, the
diff never waits for it) when numba and a C compiler are installed: later diffs load it.
``LAYERDIFF_AOT=0`` neither loads nor builds; ``LAYERDIFF_AOT_BUILD=0`` loads but never starts
a build. ``python -m layerdiff.compare.aot`` builds it in the foreground (~13 s).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import importlib.machinery
import importlib.util
import math
import operator
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# (reference, port, bits) as PairMetrics passes them after widening float16: the bits of the
# stored values when ULPs are wanted (int16 for float16), else an empty int32 array
COMBINATIONS = (("float32", "float32", "int32"), ("float64", "float64", "int64"),
                ("float32", "float32", "int16"), ("float64", "float64", "int32"),
                ("float32", "float64", "int32"), ("float64", "float32", "int32"))
_KERNEL_SOURCE = Path(__file__).with_name("kernels.py")
# the tensor digest's block sums (trace/stats_kernel.py) are built into the same module: a diff
# verifies every byte it reads against its digest, which numpy computes at ~2.4 GB/s
_DIGEST_SOURCE = Path(__file__).parent.parent / "trace" / "stats_kernel.py"
DIGEST_EXPORT = "digest_block_sums"
RECORD_SUFFIX = ".sha256"   # <module file>.sha256: "<hex digest>  <module file name>"
_MAX_MODULE_BYTES = 64 << 20  # a built module is ~1 MiB: anything far larger is not ours
_BUILD_LIMIT_S = 30 * 60      # a background build still running after this is killed
_RETRY_FAILED_S = 24 * 3600   # a background build that failed is not tried again before this


class Distrust(Exception):
    """Why a cache path is not trusted (the tail of the one line said on stderr)."""


def cache_dir() -> Path:
    """Where built kernels are kept: an absolute path. Raises ValueError where
    ``LAYERDIFF_KERNEL_CACHE`` is relative (it would name a folder inside the working folder,
    which may be a folder of received traces) or no home folder can be found."""
    given = os.environ.get("LAYERDIFF_KERNEL_CACHE")
    if given:
        if not os.path.isabs(given):
            raise ValueError(f"LAYERDIFF_KERNEL_CACHE={given!r} is a relative path (it would "
                             "be inside whatever folder layerdiff runs in); give an absolute "
                             "one")
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):  # the XDG spec: a relative path is ignored
        home = os.path.expanduser("~")
        if not os.path.isabs(home):
            raise ValueError(f"the home folder {home!r} is not an absolute path")
        base = os.path.join(home, ".cache")
    return Path(base) / "layerdiff" / "kernels"


def module_file(name: str) -> str:
    """The built module's file name (in the cache folder)."""
    return name + importlib.machinery.EXTENSION_SUFFIXES[0]


def module_name() -> str | None:
    """The built module's name for this source, these versions and this CPU; None where the
    CPU cannot be told (not Linux) or numba is not installed."""
    numba_spec = importlib.util.find_spec("numba")
    if numba_spec is None or numba_spec.origin is None:
        return None
    cpu = _cpu()
    if cpu is None:
        return None
    digest = hashlib.sha256(_KERNEL_SOURCE.read_bytes() + _DIGEST_SOURCE.read_bytes())
    version = Path(numba_spec.origin).with_name("_version.py")
    digest.update(version.read_bytes() if version.is_file() else b"?")
    for part in (np.__version__, sys.implementation.cache_tag, sys.platform, cpu):
        digest.update(b"\0" + part.encode())
    return "layerdiff_kernels_" + digest.hexdigest()[:20]


def _cpu() -> str | None:
    """The first processor's model and instruction-set flags (the code uses the host's)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    first = text.split("\n\n", 1)[0]
    keep = [line for line in first.splitlines()
            if line.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features",
                                               "CPU implementer", "CPU part")]
    return "\n".join(keep) or None


class Compiled:
    """The built module's functions, reachable only through checked calls: an exported
    function does not check what it is given (a float64 array where it takes float32, or a
    batch row past the end of ``batch_ratio``, would read or write outside the arrays), so
    :meth:`fused` and ``digest.fold_lanes`` hand it only arguments of exactly the types and
    sizes it was built for and answer None (nothing ran) otherwise."""

    def __init__(self, functions: dict[tuple[str, str, str], Callable[..., Any]],
                 digest_sums: Callable[..., Any] | None = None) -> None:
        self._functions = dict(functions)
        self.digest = _DigestSums(digest_sums) if digest_sums is not None else None

    @property
    def combinations(self) -> tuple[tuple[str, str, str], ...]:
        return tuple(self._functions)

    def fused(self, ref: Any, port: Any, ref_bits: Any, port_bits: Any, ulp_width: Any,
              rtol: Any, atol: Any, start: Any, per_element: Any, batch_ratio: Any,
              known_ratio: Any, known_finite: Any, known_rel: Any) -> tuple | None:
        """``kernels.fused`` of these arguments by the built function, or None where they
        are not what it was built for (the JIT then serves them)."""
        arrays = (ref, port, ref_bits, port_bits, batch_ratio)
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous
                   and a.flags.aligned and a.dtype.isnative for a in arrays):
            return None
        if ref_bits.dtype != port_bits.dtype or batch_ratio.dtype != np.float64:
            return None
        function = self._functions.get((ref.dtype.name, port.dtype.name, ref_bits.dtype.name))
        if function is None or port.size != ref.size:
            return None
        try:
            ulp_width, start, per_element = (operator.index(ulp_width), operator.index(start),
                                             operator.index(per_element))
            rtol, atol = float(rtol), float(atol)
            known = (float(known_ratio), float(known_finite), float(known_rel))
        except (TypeError, ValueError, OverflowError):
            return None
        if ulp_width and (ulp_width != 8 * ref_bits.itemsize or ref_bits.size != ref.size
                          or port_bits.size != ref.size):
            return None
        if not (math.isfinite(rtol) and math.isfinite(atol) and rtol >= 0 and atol >= 0):
            return None
        if start < 0 or per_element < 0 or start + ref.size >= 1 << 62:
            return None
        if per_element and ref.size and (start + ref.size - 1) // per_element >= batch_ratio.size:
            return None
        return function(ref, port, ref_bits, port_bits, ulp_width, rtol, atol, start,
                        per_element, batch_ratio, *known)


class _DigestSums:
    """The built digest block sums with the compiled statistics module's ``fold_lanes``
    (what trace/digest.py's Digester calls): whole 4 KiB blocks of bytes go to the built
    function, anything else to numpy's definition (the same numbers)."""

    def __init__(self, sums: Callable[..., Any]) -> None:
        self._sums = sums

    def fold_lanes(self, data: np.ndarray, weights: np.ndarray, first_block: int, a: int,
                   b: int) -> tuple[int, int]:
        from layerdiff.trace import digest

        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        if data.size % digest.BLOCK_BYTES or not data.size:
            return digest.fold(digest.block_sums(digest.padded(data)), first_block, (a, b))
        words = data.view(np.int32)
        if not words.flags.aligned:
            words = words.copy()
        out = np.empty((words.size // digest.BLOCK, 2), dtype=np.int64)
        lane_a, lane_b = digest.lanes()  # the definition's weights, whatever was passed
        self._sums(words, lane_a, lane_b, out)
        return digest.fold(out, first_block, (a, b))


@functools.cache
def load() -> Compiled | None:
    """The built kernel for this machine and source, or None: not built (a build is then
    started in the background, see :func:`start_build`), ``LAYERDIFF_AOT=0``, or not
    trusted or not loadable (one line on stderr says why); the JIT then serves."""
    if os.environ.get("LAYERDIFF_AOT") == "0":
        return None
    name = module_name()
    if name is None:
        return None
    try:
        folder = cache_dir()
    except ValueError as error:
        _say(f"layerdiff: not using the kernel cache: {error}; using the JIT")
        return None
    path = folder / module_file(name)
    if not os.path.lexists(path):
        start_build(folder, name)
        return None
    try:
        module = _load_verified(folder, name)
    except Distrust as doubt:
        _say(f"layerdiff: not loading the built kernel {path}: {doubt}; using the JIT")
        return None
    except Exception as error:  # a damaged build: the JIT instead
        _say(f"layerdiff: cannot load the built kernel {path} ({type(error).__name__}: "
             f"{error}); using the JIT")
        return None
    functions = {combination: getattr(module, export_name(combination))
                 for combination in COMBINATIONS if hasattr(module, export_name(combination))}
    return Compiled(functions, getattr(module, DIGEST_EXPORT, None)) if functions else None


def _say(line: str) -> None:
    """One line on stderr (load() is cached: once per process)."""
    with contextlib.suppress(OSError, ValueError):  # no stderr to speak to
        print(line, file=sys.stderr, flush=True)


# ------------------------------------------------------------------- what is trusted

def trusted_folder(folder: Path) -> str:
    """The real path of ``folder`` once it is known that only this user (or root) can change
    what it holds or what its path leads to; raises :class:`Distrust` saying why not.

    The path is resolved one component at a time from ``/``: every folder passed through,
    including those holding a symbolic link on the way, must be owned by this user or root
    and writable by no one else unless it is sticky (``/tmp``: others cannot rename what is
    ours in it); ``folder`` itself must be owned by this user and writable by no one else.
    A folder another user can write lets them rename a planted file into it."""
    path = os.fspath(folder)
    if not os.path.isabs(path):
        raise Distrust("it is a relative path")
    me = os.geteuid()
    pending = list(reversed(Path(path).parts[1:]))
    current = "/"
    _check_above(current, os.lstat(current), me)
    links = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            current = os.path.dirname(current)
            continue
        step = os.path.join(current, part)
        try:
            status = os.lstat(step)
        except FileNotFoundError:
            raise Distrust(f"{step} does not exist") from None
        if stat.S_ISLNK(status.st_mode):  # its folder was checked: only we or root made it
            links += 1
            if links > 40:
                raise Distrust("too many symbolic links")
            target = os.readlink(step)
            if os.path.isabs(target):
                current = "/"
            pending.extend(reversed(Path(target).parts[1 if os.path.isabs(target) else 0:]))
            continue
        if not stat.S_ISDIR(status.st_mode):
            raise Distrust(f"{step} is not a folder")
        _check_above(step, status, me)
        current = step
    status = os.lstat(current)
    if status.st_uid != me:
        raise Distrust(f"{current} belongs to another user (uid {status.st_uid})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise Distrust(f"{current} is writable by {_whom(status.st_mode)}")
    return current


def _check_above(path: str, status: os.stat_result, me: int) -> None:
    if status.st_uid not in (me, 0):
        raise Distrust(f"{path} belongs to another user (uid {status.st_uid})")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not status.st_mode & stat.S_ISVTX:
        raise Distrust(f"{path} is writable by {_whom(status.st_mode)}")


def _whom(mode: int) -> str:
    return " and ".join(who for bit, who in ((stat.S_IWGRP, "its group"),
                                             (stat.S_IWOTH, "others")) if mode & bit)


def _read_own_file(folder_fd: int, name: str, limit: int, what: str) -> bytes:
    """The bytes of ``name`` in the open folder: a regular file (not a link: O_NOFOLLOW)
    owned by this user and writable by no one else, read from the descriptor it was checked
    on. Raises FileNotFoundError where it is absent, Distrust where it is not trusted."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=folder_fd)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise Distrust(f"{what} is a symbolic link") from None
        raise
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise Distrust(f"{what} is not a regular file")
        if status.st_uid != os.geteuid():
            raise Distrust(f"{what} belongs to another user (uid {status.st_uid})")
        if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise Distrust(f"{what} is writable by {_whom(status.st_mode)}")
        if status.st_size > limit:
            raise Distrust(f"{what} is {status.st_size} bytes, more than a build makes")
        return handle.read(limit + 1)


def _load_verified(folder: Path, name: str) -> Any:
    """The module ``name`` from ``folder`` once folder, file and record are trusted and the
    file's sha256 is its record's (raises Distrust otherwise).

    The bytes are read once, from the descriptor whose owner and mode were checked, hashed,
    and those same bytes are written into a fresh private folder (0700, made by mkdtemp in
    the checked cache folder, else in a temporary folder that passes the same checks) that
    the module is loaded from, then removed. Loading the cache
    path itself would open it a second time: whatever it held by then would run, unhashed
    (another build of ours replacing it, at the least). The copy costs ~1 ms."""
    real = trusted_folder(folder)
    file = module_file(name)
    folder_fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not os.path.samestat(os.fstat(folder_fd), os.lstat(real)):
            raise Distrust(f"{real} changed while it was checked")
        try:
            data = _read_own_file(folder_fd, file, _MAX_MODULE_BYTES, "it")
        except FileNotFoundError:
            raise Distrust("it went away while it was checked") from None
        try:
            record = _read_own_file(folder_fd, file + RECORD_SUFFIX, 4096,
                                    f"its record {file}{RECORD_SUFFIX}")
        except FileNotFoundError:
            raise Distrust(f"it has no record of its sha256 ({file}{RECORD_SUFFIX}) beside "
                           "it (python -m layerdiff.compare.aot builds it again)") from None
    finally:
        os.close(folder_fd)
    if record.decode("ascii", "replace").split() != [hashlib.sha256(data).hexdigest(), file]:
        raise Distrust(f"its sha256 is not the one in {file}{RECORD_SUFFIX} (python -m "
                       "layerdiff.compare.aot builds it again)")
    try:
        private = tempfile.mkdtemp(dir=real, prefix=".load-")
    except OSError:  # a cache folder we cannot write (read-only): the temporary folder,
        private = tempfile.mkdtemp(prefix="layerdiff-load-")  # if only we can change it
        try:
            trusted_folder(Path(private))
        except Distrust:
            shutil.rmtree(private, ignore_errors=True)
            raise
    try:
        copy = os.path.join(private, file)
        fd = os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o500)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        spec = importlib.util.spec_from_file_location(name, copy)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        shutil.rmtree(private, ignore_errors=True)  # the loaded library stays mapped
    return module


def export_name(combination: tuple[str, str, str]) -> str:
    return "fused_" + "_".join(combination)


def arguments(ref: np.ndarray, port: np.ndarray, bits: str, batch: int = 0) -> tuple:
    """The kernel's arguments for one pair as PairMetrics builds them (for the build and the
    tests): the stored values' bits when ``bits`` matches their width (int16: stored as
    float16, then widened), else none."""
    if bits == "int16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as it would be stored
            ref, port = ref.astype(np.float16), port.astype(np.float16)
        ref_bits, port_bits = ref.view(np.int16), port.view(np.int16)
        ref, port, width = ref.astype(np.float32), port.astype(np.float32), 16
    elif ref.dtype == port.dtype and np.dtype(bits).itemsize == ref.dtype.itemsize:
        ref_bits, port_bits, width = ref.view(bits), port.view(bits), 8 * ref.dtype.itemsize
    else:
        ref_bits = port_bits = np.zeros(0, np.int32)
        width = 0
    per_element = ref.size // batch if batch else 0
    ratios = np.zeros(batch) if batch else np.zeros(0)
    return (ref, port, ref_bits, port_bits, width, 1.3e-6, 1e-5, 0, per_element, ratios, -1.0,
            0.0, 0.0)


def build(directory: Path | None = None,
          combinations: tuple[tuple[str, str, str], ...] = COMBINATIONS) -> Path:
    """Compile the kernel for ``combinations`` into ``directory`` (default: the cache) and
    return the module's path. The folder (and any missing folder above it) is made with mode
    0700 and must pass :func:`trusted_folder` (a diff would not load from it otherwise); the
    module is compiled in a private folder inside it, its sha256 written beside it as
    ``<module>.sha256``, and both renamed into place, so a reader never finds half a module.
    Raises RuntimeError where it cannot be built there."""
    name = module_name()
    if name is None:
        raise RuntimeError("the kernel cannot be compiled ahead of time here: its build is "
                           "keyed by /proc/cpuinfo (Linux) and needs numba")
    directory = Path(os.path.abspath(directory if directory is not None else cache_dir()))
    make_folder(directory)
    try:
        real = trusted_folder(directory)
    except Distrust as doubt:
        raise RuntimeError(f"not building the kernel into {directory}: {doubt} (a diff would "
                           "not load it from there)") from None
    import numba
    from numba.pycc import CC

    from layerdiff.compare import kernels
    _sweep(real)
    with tempfile.TemporaryDirectory(dir=real, prefix=".build-") as scratch:
        compiler = CC(name)
        compiler.output_dir = scratch
        compiler.target_cpu = "host"
        compiler.verbose = False
        for combination in combinations:  # the JIT's own signature of each combination
            args = arguments(np.ones(8, combination[0]), np.ones(8, combination[1]),
                             combination[2])
            kernels.fused(*args)
            overload = kernels.fused.overloads[tuple(numba.typeof(a) for a in args)]
            compiler.export(export_name(combination), overload.signature)(
                kernels.fused.py_func)
        from layerdiff.trace import digest, stats_kernel
        sums_args = (np.zeros(digest.BLOCK, np.int32), *digest.lanes(),
                     np.zeros((1, 2), np.int64))
        stats_kernel._block_sums(*sums_args)
        overload = stats_kernel._block_sums.overloads[tuple(numba.typeof(a) for a in sums_args)]
        compiler.export(DIGEST_EXPORT, overload.signature)(stats_kernel._block_sums.py_func)
        with _as_jitted():
            compiler.compile()
        built = next(Path(scratch).glob(name + "*"))
        file = module_file(name)
        record = Path(scratch) / (file + RECORD_SUFFIX)
        record.write_text(f"{hashlib.sha256(built.read_bytes()).hexdigest()}  {file}\n",
                          encoding="ascii")
        for made in (built, record):  # whatever the umask: writable by no one else
            os.chmod(made, 0o644)
        # the record first: a diff that finds the module then finds its record too (the
        # first build: a record alone is no module, nothing is said)
        os.replace(record, os.path.join(real, file + RECORD_SUFFIX))
        os.replace(built, os.path.join(real, file))
    return directory / file


def _sweep(folder: str) -> None:
    """Remove the private folders of builds and loads that ended without removing them
    (killed) more than a day ago."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if (entry.name.startswith((".build-", ".load-")) and entry.is_dir(follow_symlinks=False)
                    and time.time() - entry.stat(follow_symlinks=False).st_mtime > 86400):
                shutil.rmtree(entry.path, ignore_errors=True)


def make_folder(folder: Path) -> None:
    """``folder`` and any missing folder above it, each made with mode 0700."""
    missing = []
    while not os.path.lexists(folder) and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    for each in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(each, 0o700)


@contextlib.contextmanager
def _as_jitted():
    """numba.pycc compiles an export with default flags; give it the JIT's own for ``fused``
    (kernels._JIT): the numpy error model, and the GIL released while it runs, so that the
    diff's reading thread keeps going during the metrics."""
    from numba.pycc import compiler

    plain = compiler.Flags

    def flags():
        made = plain()
        made.release_gil = True
        made.error_model = "numpy"
        return made

    compiler.Flags = flags
    try:
        yield
    finally:
        compiler.Flags = plain


# ------------------------------------------------------------------- the background build

def start_build(folder: Path, name: str, *,
                spawn: Callable[[str, str, int], Any] | None = None) -> bool:
    """Start building module ``name`` into ``folder`` in the background; True when started.

    Not where ``LAYERDIFF_AOT=0`` or ``LAYERDIFF_AOT_BUILD=0``, no C compiler is found, the
    folder cannot be made or is not trusted (one line on stderr), a build of this module is
    running (it holds an flock on ``<module>.lock`` for its whole life, released by the
    kernel however it ends, so a crashed build leaves no stale lock), or one failed in the
    last day. ``spawn(real_folder, name, lock_fd)`` starts it (default :func:`_spawn`); the
    lock passes to the build through the inherited descriptor, and this returns at once."""
    if os.environ.get("LAYERDIFF_AOT") == "0" or os.environ.get("LAYERDIFF_AOT_BUILD") == "0":
        return False
    if _c_compiler() is None:
        return False
    try:
        make_folder(folder)
        real = trusted_folder(folder)
    except Distrust as doubt:
        _say(f"layerdiff: not building the kernel into {folder}: {doubt}; using the JIT")
        return False
    except OSError:  # a read-only home, say: no build, as before
        return False
    import fcntl
    try:
        fd = os.open(os.path.join(real, module_file(name) + ".lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a build of this module is running
            return False
        state = os.pread(fd, 64, 0).split()
        if state[:1] == [b"failed"] and time.time() - status.st_mtime < _RETRY_FAILED_S:
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"building {os.getpid()}\n".encode(), 0)
        (spawn or _spawn)(real, name, fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # the build keeps the lock through its own descriptor


def _c_compiler() -> str | None:
    for given in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc"):
        found = shutil.which(given.split()[0]) if given and given.split() else None
        if found:
            return found
    return None


def _spawn(folder: str, name: str, lock_fd: int) -> None:
    """``python -m layerdiff.compare.aot --background``: this layerdiff (its folder first on
    PYTHONPATH), in a new session, reading nothing and writing nowhere visible, in the cache
    folder (never the working folder, which ``-m`` would put on sys.path: -P too)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding this layerdiff
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "LAYERDIFF_AOT_BUILD": "0",
           "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    subprocess.Popen([sys.executable, *safe_path, "-m", "layerdiff.compare.aot",
                      "--background", folder, name, str(lock_fd)],
                     cwd=folder, env=env, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     pass_fds=(lock_fd,), start_new_session=True)


def _background(folder: str, name: str, lock_fd: int) -> int:
    """The background build (main() lowers its priority and limits its time first): says in
    the lock file whether it failed (then no diff starts another for a day)."""
    state = b"built\n"
    try:
        if module_name() == name:  # else the source changed since: a later diff starts one
            build(Path(folder))
        else:
            state = b"stale\n"
    except BaseException:
        state = b"failed\n"
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, state, 0)
    return 1 if state == b"failed\n" else 0


def main(argv: list[str] | None = None) -> int:
    import warnings

    argv = sys.argv[1:] if argv is None else argv
    warnings.simplefilter("ignore")  # numba.pycc's pending deprecation, once per build
    if argv[:1] == ["--background"] and len(argv) == 4:
        import signal
        with contextlib.suppress(OSError):
            os.nice(19)  # the lowest priority: the diff that started it comes first
        signal.alarm(_BUILD_LIMIT_S)  # a build hung this long ends (and frees its lock)
        return _background(argv[1], argv[2], int(argv[3]))
    try:
        print(f"built {build()}")
    except (RuntimeError, ValueError) as error:
        print(f"layerdiff: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
