"""The interactive session, driven through its standard input, and the Session object."""

from __future__ import annotations

import pytest

from layerdiff import DiffError
from layerdiff.replay import Session


@pytest.fixture(autouse=True)
def _history(tmp_path, monkeypatch):
    monkeypatch.setattr("layerdiff.cli.session.HISTORY", tmp_path / "history")


BUG = "reference_models.mlp_port:bug_weight_not_transposed"


def test_a_session_swaps_runs_shows_and_survives_errors(run):
    script = "\n".join(["sites fc*", "swap fc2", "run", "swap no.such.layer", "unswap",
                        "run", "show fc2#0", "frobnicate", "quit"]) + "\n"
    result = run("session", "reference_models.mlp:reference", BUG, input=script)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "swapped: fc2" in out
    assert "BREAKS  with fc2 swapped in" in out
    assert "error: site 'no.such.layer' has no layer in both models" in out
    assert "WITHIN  with nothing swapped in" in out
    assert "ORIGIN" in out  # show: the diff's rows of fc2
    assert "unknown command 'frobnicate'" in out


def test_a_session_bisects_and_ends_at_end_of_input(run):
    result = run("session", "reference_models.mlp:reference", BUG, input="bisect\n")
    assert result.exit_code == 0
    assert "culprits: fc2" in result.output


def test_a_layer_that_raises_is_named_and_the_session_goes_on(run, tmp_path, monkeypatch):
    (tmp_path / "raising.py").write_text(
        "from reference_models import mlp_port\n"
        "def port():\n"
        "    case = mlp_port.port()\n"
        "    def broken(*a, **k):\n"
        "        raise RuntimeError('kernel not implemented')\n"
        "    case.model.act2.forward = broken\n"
        "    return case\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = run("session", "reference_models.mlp:reference", "raising:port",
                 input="swap act2\nrun\nsites act*\nquit\n")
    said = " ".join(result.output.split())
    assert "CANNOT JUDGE" in said  # a layer that raises is never within tolerance
    assert "act2 cannot be judged" in said
    assert "raised RuntimeError: kernel not implemented" in said
    assert " * act2" in result.output  # still there, still swapped


def test_the_session_object_for_notebooks():
    session = Session("reference_models.mlp:reference", BUG)
    try:
        assert ("fc2", "fc2") in session.sites()
        session.swap("fc2#0")
        assert session.run().breaks
        with pytest.raises(DiffError, match="not swapped in"):
            session.unswap("head")
        session.unswap()
        assert not session.run().breaks
        assert session.diff().origin.site == "fc2#0"
        assert not session.show("fc2").empty
    finally:
        session.close()


def test_help_lists_the_commands_to_type_and_not_eof():
    import cmd
    import io

    from layerdiff.cli.session import SessionShell

    shell = SessionShell.__new__(SessionShell)  # help needs no session
    cmd.Cmd.__init__(shell, stdout=io.StringIO())
    shell.do_help("")
    listed = shell.stdout.getvalue().split()
    assert {"swap", "unswap", "run", "diff", "bisect", "quit"} <= set(listed)
    assert "EOF" not in listed
