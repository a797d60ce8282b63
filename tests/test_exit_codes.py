"""One exit-code policy for every command (cli/main.py `_exit_codes`): 0 ok, 1 flagged, 2 bad input
or environment, 3 an internal error (one line, the traceback saved to a file), 130 Ctrl-C.

Every command is run on one internal-error path (the library function it calls raises a
RuntimeError) and one bad-input path; neither may exit 1, which every script reads as "flagged"
(issue 34: a missing input, a full disk, a too-long file name or a deeply nested JSON line
printed a traceback and exited 1)."""

import errno
import re
from pathlib import Path

import pytest
import typer.main
from typer.testing import CliRunner

from verinfer.cli.main import app

runner = CliRunner()
MISSING = "/nonexistent/verinfer-test"

# command -> (the module attribute it calls, its arguments for the internal-error path, its
# arguments for a bad-input path)
COMMANDS = {
    ("demo",): ("verinfer.apps.demo.demo", [], ["--model", MISSING]),
    ("generate",): ("verinfer.apps.generate.generate", ["-o", "{tmp}/c.jsonl"], ["no-such-provider", "-o", "{tmp}/c.jsonl"]),
    ("score",): ("verinfer.apps.files.score_file", ["{tmp}/c.jsonl", "-o", "{tmp}/s.parquet"],
                 [f"{MISSING}.jsonl", "-o", "{tmp}/s.parquet"]),
    ("calibrate",): ("verinfer.apps.files.calibrate_files", ["{tmp}/s.parquet", "-o", "{tmp}/d.json"],
                     [f"{MISSING}.parquet", "-o", "{tmp}/d.json"]),
    ("audit",): ("verinfer.apps.files.audit_files", ["{tmp}/s.parquet", "-d", "{tmp}/d.json"],
                 ["nope.parquet", "-d", "det.json"]),
    ("report",): ("verinfer.apps.files.report_files", ["{tmp}/s.parquet", "-o", "{tmp}/r"],
                  [f"{MISSING}.parquet", "-o", "{tmp}/r"]),
    ("serve",): ("verinfer.server.app.serve", [], ["--model", MISSING]),
    ("audit-api",): ("verinfer.apps.audit_api.audit_api", ["--base-url", "http://127.0.0.1:1/v1", "--model", "m",
                                                             "-o", "{tmp}/a"],
                     ["--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--model-dir", MISSING]),
    ("audit-vendors",): ("verinfer.api.audit_vendors", ["{tmp}/v.toml"], [f"{MISSING}.toml"]),
    ("audit-log",): ("verinfer.api.audit_log", ["{tmp}/log.jsonl"], [f"{MISSING}.jsonl"]),
    ("testbed", "build"): ("verinfer.models.testbed.build", ["--out", "{tmp}/tb"], ["--budget", "no-such-budget"]),
    ("testbed", "build-draft"): ("verinfer.models.draft.build_draft", ["--model", "{tmp}"], ["--model", MISSING]),
    ("models", "build-draft"): ("verinfer.models.draft.build_draft", ["--model", "{tmp}"], ["--model", MISSING]),
    ("models", "build-head"): ("verinfer.speculative.head_build.build_head", ["--model", "{tmp}"], ["--model", MISSING]),
    ("testbed", "info"): ("verinfer.models.testbed.TESTBED_DIR", [], []),
    ("determinism", "calibrate"): ("verinfer.apps.determinism.run_calibrate", ["-o", "{tmp}/tau.json"],
                                   ["--model", MISSING]),
    ("determinism", "probe"): ("verinfer.apps.determinism_probe.run_probe",
                               ["--base-url", "http://127.0.0.1:1/v1", "--model", "m", "-o", "{tmp}/p"],
                               ["--base-url", "http://127.0.0.1:1/v1", "--model", "m", "--batch-sizes", "0,x"]),
    ("models", "get"): ("verinfer.models.catalog.get_model", ["smollm2-135m-instruct"], ["no-such-model"]),
    ("models", "list"): ("verinfer.models.catalog.list_models", [], []),
    ("speculative", "train-autojudge"): ("verinfer.apps.speculative.train_autojudge", ["-o", "{tmp}/j.json"],
                                         ["--model", MISSING, "-o", "{tmp}/j.json"]),
}


def _all_commands(group=None, prefix=()):
    group = group or typer.main.get_command(app)
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _all_commands(cmd, prefix + (name,))
        else:
            yield prefix + (name,)


def test_the_table_names_every_command():
    assert sorted(_all_commands()) == sorted(COMMANDS)


class _Boom:
    """Stands in for a function (or a path) and raises when used: an internal error."""

    def __call__(self, *a, **k):
        raise RuntimeError("boom: an invariant broke")

    def __truediv__(self, other):
        self()


def _args(args, tmp_path):
    return [a.format(tmp=tmp_path) for a in args]


def _invoke(command, args):
    return runner.invoke(app, [*command, *args])


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_an_internal_error_exits_3_with_one_line_and_a_saved_traceback(command, tmp_path, monkeypatch):
    target, args, _ = COMMANDS[command]
    (tmp_path / "c.jsonl").write_text("{}\n")
    monkeypatch.setattr(target, _Boom())
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # where the traceback is saved
    r = _invoke(command, _args(args, tmp_path))
    assert r.exit_code == 3, (command, r.exit_code, r.output)
    assert "internal error (RuntimeError: boom" in r.output and "not a verdict" in r.output
    assert "Traceback" not in r.output  # one message, not a traceback
    saved = Path(re.search(r"traceback saved to (\S+)", r.output).group(1))
    assert saved.parent == tmp_path and "RuntimeError: boom" in saved.read_text()


@pytest.mark.parametrize("command", sorted(COMMANDS), ids=" ".join)
def test_bad_input_exits_2_with_what_to_do(command, tmp_path, monkeypatch):
    target, _, args = COMMANDS[command]
    if command == ("testbed", "info"):  # a testbed directory without its model card
        monkeypatch.setattr(target, tmp_path)
    if command == ("models", "list"):  # the cache cannot be read
        def unreadable(cache):
            raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "cache"))
        monkeypatch.setattr(target, unreadable)
    r = _invoke(command, _args(args, tmp_path))
    assert r.exit_code == 2, (command, r.exit_code, r.output)
    assert "Traceback" not in r.output


@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device", "out.parquet"), "the disk is full"),
    (OSError(errno.ENAMETOOLONG, "File name too long", "x" * 300), "a file name is too long"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "nope.parquet"), "check the path"),
    (RecursionError("maximum recursion depth exceeded"), "nested too deeply"),
    (MemoryError(), "out of memory"),
])
def test_environment_errors_exit_2_saying_what_to_do(error, words, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise error
    monkeypatch.setattr("verinfer.apps.files.score_file", fail)
    r = _invoke(("score",), [str(tmp_path / "c.jsonl"), "-o", str(tmp_path / "s.parquet")])
    assert r.exit_code == 2 and words in r.output and "Traceback" not in r.output, r.output
    if isinstance(error, OSError):
        assert str(error.filename) in r.output


def test_flagged_and_usage_errors_keep_their_codes(monkeypatch, tmp_path):
    """typer's own exits pass through the handler: 1 from a command that flags, 2 for bad usage."""
    class Flagged:
        flagged, notes, verdicts = True, [], []
    monkeypatch.setattr("verinfer.apps.files.audit_files", lambda *a, **k: Flagged())
    monkeypatch.setattr("verinfer.cli.render.verdicts", lambda rows: None)
    assert _invoke(("audit",), ["s.parquet", "-d", "d.json"]).exit_code == 1
    assert _invoke(("audit",), ["s.parquet"]).exit_code == 2  # --detector missing
