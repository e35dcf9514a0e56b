"""An output that cannot be written is one sentence and exit 2, never a traceback (issue 28).

On a read-only file system even removing a temporary file that was never created fails (EROFS),
and that second error used to escape the one the user needs. Root writes through permission
bits, so a real read-only folder here is a read-only tmpfs mount where this process may mount
one (else the test skips), and a folder without write permission for other users.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from layerdiff import TraceWriter
from layerdiff.errors import OutputError
from layerdiff.outputs import replacing, write_text
from layerdiff.trace.manifest import rank_path, write_manifest

MLP, MLP_PORT = "reference_models.mlp:reference", "reference_models.mlp_port:port"
X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


def _write(path, meta=None) -> Path:
    with TraceWriter(path, meta=meta or {}) as writer, writer.site("fc") as site:
        writer.record(site, "output", X)
    return Path(path)


@pytest.fixture
def traces(tmp_path):
    reference = _write(tmp_path / "ref.h5")
    port = tmp_path / "port.h5"
    for rank in range(2):
        _write(rank_path(port, rank), {"rank": rank, "world_size": 2})
    write_manifest(port, [rank_path(port, rank) for rank in range(2)])
    return reference, port


@pytest.fixture
def read_only_folder(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mount = shutil.which("mount")
    made = mount and subprocess.run([mount, "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs",
                                     str(folder)], capture_output=True, check=False)
    if not made or made.returncode != 0:
        pytest.skip("running as root (which writes through permission bits) and cannot mount "
                    "a read-only tmpfs here")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def _one_sentence(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    for word in words:
        assert word in result.output, result.output


def test_a_temporary_that_cannot_even_be_removed_leaves_the_writes_own_error(tmp_path,
                                                                            monkeypatch):
    # what a read-only file system does: open fails, and so does unlinking the missing file
    def read_only(self, missing_ok=False):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))

    monkeypatch.setattr(Path, "unlink", read_only)
    target = tmp_path / "report.json"
    said = r"cannot write .*report\.json: Read-only file system"
    with pytest.raises(OutputError, match=said), replacing(target) as temporary:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(temporary))


def test_the_longest_name_the_file_system_takes_is_written(tmp_path):
    # the temporary name beside it must fit the file system's 255 bytes too
    target = tmp_path / ("r" * 250 + ".json")
    assert write_text(target, "{}").read_text(encoding="utf-8") == "{}"
    assert [p.name for p in tmp_path.iterdir()] == [target.name]


@pytest.mark.parametrize("command", [
    ["diff", "{ref}", "{ref}", "--json", "{out}/d.json"],
    ["diff", "{ref}", "{ref}", "--csv", "{out}/d.csv"],
    ["diff", "{ref}", "{ref}", "--html", "{out}/d.html"],
    ["diff", "{ref}", "{port}", "--json", "{out}/d.json"],
    ["show", "{ref}", "--html", "{out}/s.html"],
    ["ranks", "{port}", "--json", "{out}/r.json"],
    ["gather", "{port}", "-o", "{out}/g.h5"],
    ["map-check", "{mlp}", MLP_PORT, "--json", "{out}/m.json"],
    ["map-suggest", "{mlp}", MLP_PORT, "-o", "{out}/m.toml"],
    ["check", MLP, "{mlp}", "--junit", "{out}/j.xml"],
    ["demo", "-o", "{out}/demo"],
], ids=lambda command: " ".join(c for c in command if "{" not in c))
def test_writing_into_a_read_only_folder_is_one_sentence(traces, read_only_folder, run,
                                                         reference_traces, command):
    reference, port = traces
    places = {"ref": reference, "port": port, "out": read_only_folder,
              "mlp": reference_traces(MLP) if "{mlp}" in command else ""}
    result = run(*(part.format(**places) for part in command))
    _one_sentence(result, str(read_only_folder))
    assert not any(read_only_folder.iterdir())


@pytest.mark.parametrize("command", [
    ["demo", "-o", "{blocker}/demo"],
    ["determinism", MLP, "--keep", "{blocker}/kept"],
    ["diverge", MLP, MLP_PORT, "--steps", "1", "-o", "{blocker}/kept"],
], ids=lambda command: command[0])
def test_a_folder_that_cannot_be_made_is_one_sentence(tmp_path, run, command):
    blocker = tmp_path / "a-file"  # a file where a folder should be: refused even for root
    blocker.write_text("mine", encoding="utf-8")
    result = run(*(part.format(blocker=blocker) for part in command))
    _one_sentence(result, "cannot create the", str(blocker))
    assert blocker.read_text(encoding="utf-8") == "mine"


def test_determinism_keeps_an_existing_run_unless_forced(tmp_path, run):
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "run1.h5").write_text("an earlier run", encoding="utf-8")
    result = run("determinism", MLP, "--steps", "1", "--keep", kept)
    _one_sentence(result, "run1.h5 already exists", "--force")
    assert (kept / "run1.h5").read_text(encoding="utf-8") == "an earlier run"
    # --json onto a kept run is refused before any run, forced or not
    refused = run("determinism", MLP, "--steps", "1", "--keep", kept, "--force", "--json",
                  kept / "run2.h5")
    _one_sentence(refused, "trace of run 2 kept in --keep")
    done = run("determinism", MLP, "--steps", "1", "--keep", kept, "--force", "--json",
               tmp_path / "d.json")
    assert done.exit_code == 0, done.output
    assert json.loads((tmp_path / "d.json").read_text(encoding="utf-8"))["traces"] == [
        str(kept / "run1.h5"), str(kept / "run2.h5")]
    assert (kept / "run1.h5").read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"
