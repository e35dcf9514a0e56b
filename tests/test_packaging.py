"""What installing layerdiff does to a user's environment: it keeps their torch (a range, never
a pin) and claims no top-level name but its own, while the bundled cases stay reachable by the
names every document uses (``reference_models.X``)."""

from __future__ import annotations

import email
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from layerdiff import bundled, load_case

ROOT = Path(__file__).resolve().parent.parent


def _torch_requirement() -> Requirement:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    found = [Requirement(d) for d in project["dependencies"] if Requirement(d).name == "torch"]
    assert len(found) == 1
    return found[0]


def test_torch_is_a_range_of_at_least_two_minor_versions_never_a_pin():
    spec = _torch_requirement().specifier
    assert not any(s.operator in ("==", "===") for s in spec), spec
    assert "2.13.0" in spec and "2.14.1" in spec, spec  # the two the whole suite passed on


def test_the_install_commands_put_the_cpu_torch_in_before_the_package():
    """The package no longer pins torch, so the README's first command and .ci/run must: a
    fresh machine then still takes the CPU wheel instead of resolving the newest CUDA build."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    first = next(line for line in readme.splitlines() if "layerdiff demo" in line
                 and "pip install" in line)
    assert first.index("torch==2.13.0") < first.index("pip install -e .")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert ci.index("torch==2.13.0") < ci.index('"$test_command"')


@pytest.mark.slow
def test_the_wheel_holds_only_layerdiff_and_its_bundled_cases(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True,
                          timeout=300, check=False)
    if done.returncode != 0 and "No module named" in done.stderr:
        pytest.skip(f"cannot build a wheel here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    wheel = next(tmp_path.glob("layerdiff-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(
            next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert {n.split("/")[0] for n in names if not n.startswith("layerdiff-")} == {"layerdiff"}
    assert "layerdiff/reference_models/transformer_port.py" in names
    assert "layerdiff/reference_models/transformer_port.map.toml" in names
    torch = [Requirement(r) for r in metadata.get_all("Requires-Dist")
             if Requirement(r).name == "torch"]
    assert torch and str(torch[0].specifier) == str(_torch_requirement().specifier)


def _users_package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A package of the user's own named ``reference_models``, first on the path, and the
    bundle's modules forgotten so that they import again."""
    mine = tmp_path / "reference_models"
    mine.mkdir()
    for name, text in files.items():
        (mine / name).write_text(text, encoding="utf-8")
    for name in [m for m in sys.modules if bundled._names_bundled(m)]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_users_own_reference_models_package_does_not_hide_the_bundled_cases(tmp_path,
                                                                              monkeypatch):
    """A user's top-level ``reference_models`` (a plausible name for the models they port)
    comes first, as Python would have it; a bundled case it lacks is still found."""
    _users_package(tmp_path, monkeypatch, {"__init__.py": "MINE = True\n",
                                           "cases.py": "from reference_models import MINE\n"})
    monkeypatch.chdir(tmp_path)

    assert bundled.import_module("reference_models.cases").MINE
    mlp = bundled.import_module("reference_models.mlp")
    assert mlp.__name__ == "layerdiff.reference_models.mlp"
    assert type(load_case("reference_models.mlp:reference").model).__module__ == mlp.__name__
    with pytest.raises(ModuleNotFoundError, match=r"reference_models\.no_such"):
        bundled.import_module("reference_models.no_such")


def test_an_error_inside_a_module_is_not_taken_for_its_absence(tmp_path, monkeypatch):
    """Only the bundled name itself missing falls back; a module that exists and fails to
    import says its own error."""
    _users_package(tmp_path, monkeypatch, {"__init__.py": "",
                                           "mlp.py": "import no_such_dependency_xyz\n"})

    with pytest.raises(ModuleNotFoundError) as raised:
        bundled.import_module("reference_models.mlp")
    assert raised.value.name == "no_such_dependency_xyz"
