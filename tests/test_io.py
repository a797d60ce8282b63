"""verinfer.io: atomic writes, the output lock, resumable parts, output checks."""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
from pathlib import Path

import pytest

from verinfer.errors import VerinferError
from verinfer.progress import ProgressBar
from verinfer.io import (OutputBusyError, ResumableParts, atomic_write, atomic_write_json,
                         atomic_write_text, check_writable, exclusive_lock, update_json_section)


def test_atomic_write_replaces_whole_file_and_leaves_no_temp_on_failure(tmp_path):
    p = tmp_path / "sub" / "out.txt"
    atomic_write_text(p, "first")
    assert p.read_text() == "first"

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(p, half_then_fail)
    assert p.read_text() == "first"                       # the old file survives
    assert [q.name for q in p.parent.iterdir()] == ["out.txt"]  # no temp file left behind


def test_atomic_parquet_and_json_round_trip(tmp_path):
    t = pa.table({"a": [1, 2, 3]})
    atomic_write(tmp_path / "t.parquet", lambda tmp: pq.write_table(t, tmp))
    assert pq.read_table(tmp_path / "t.parquet").equals(t)
    atomic_write_json(tmp_path / "m.json", {"x": 1})
    assert json.loads((tmp_path / "m.json").read_text()) == {"x": 1}


def test_update_json_section_keeps_the_other_sections(tmp_path):
    p = tmp_path / "r.json"
    assert update_json_section(p, "ray", {"speedup": 1.8}) == {"ray": {"speedup": 1.8}}
    update_json_section(p, "remote", {"equal": True})
    assert update_json_section(p, "ray", {"speedup": 1.9}) == {"ray": {"speedup": 1.9}, "remote": {"equal": True}}
    assert json.loads(p.read_text()) == {"ray": {"speedup": 1.9}, "remote": {"equal": True}}


HOLD = """
import sys, time
from verinfer.io import exclusive_lock
with exclusive_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def test_second_writer_of_the_same_output_is_refused(tmp_path):
    out = tmp_path / "scores.parquet"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusyError, match="another verinfer process is writing this output") as e:
            with exclusive_lock(out):
                pass
        assert str(out) in str(e.value)
    finally:
        proc.kill()
        proc.wait()
    with exclusive_lock(out):  # the holder died: the lock is free again
        pass
    assert not out.with_name(out.name + ".lock").exists()


def test_lock_is_not_reentrant_within_one_process(tmp_path):
    with exclusive_lock(tmp_path / "o"):
        with pytest.raises(OutputBusyError):
            with exclusive_lock(tmp_path / "o"):
                pass


def test_resumable_parts_resume_restart_and_refuse(tmp_path):
    out = tmp_path / "s.parquet"
    with ResumableParts(out, {"job": 1}) as parts:
        parts.write(0, lambda tmp: tmp.write_text("zero"))
    # the same job resumes: part 0 is kept
    with ResumableParts(out, {"job": 1}) as parts:
        assert parts.done(0) and not parts.done(1)
        assert parts.path(0).read_text() == "zero"
    # another job's parts are discarded ...
    with ResumableParts(out, {"job": 2}) as parts:
        assert not parts.done(0)
        parts.write(0, lambda tmp: tmp.write_text("new"))
    # ... or refused, naming the field that differs
    with pytest.raises(VerinferError, match=r"holds the work of another job \(different job\)"):
        with ResumableParts(out, {"job": 3}, on_mismatch="error"):
            pass
    with ResumableParts(out, {"job": 2}) as parts:
        parts.finish()
    assert not parts.dir.exists()


def test_check_writable_refuses_before_any_compute(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "f").write_text("x")
    with pytest.raises(VerinferError, match="is a directory"):
        check_writable(tmp_path / "d")
    with pytest.raises(VerinferError, match="lies under a file"):
        check_writable(tmp_path / "f" / "out.parquet")
    assert check_writable(tmp_path / "new" / "out.parquet") == tmp_path / "new" / "out.parquet"



def test_check_writable_directories(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(VerinferError, match="is a file, not a directory"):
        check_writable(tmp_path / "f", directory=True)
    with pytest.raises(VerinferError, match="lies under a file"):
        check_writable(tmp_path / "f" / "sub", directory=True)
    assert check_writable(tmp_path, directory=True) == tmp_path
    assert check_writable(tmp_path / "new" / "dir", directory=True) == tmp_path / "new" / "dir"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_check_writable_refuses_a_read_only_directory(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(VerinferError, match="is not writable"):
            check_writable(ro / "out.json")
        with pytest.raises(VerinferError, match="is not writable"):
            check_writable(ro / "report", directory=True)
    finally:
        ro.chmod(0o755)

def test_check_writable_probes_with_a_real_write_so_root_is_refused_too(tmp_path):
    """os.access says yes to root on every directory; sysfs refuses even root's writes: the check
    must find that out before any compute (it passed /sys before and failed only at the end)."""
    if not Path("/sys").is_dir():
        pytest.skip("no /sys here: test_check_writable_refuses_a_read_only_directory covers non-root users")
    with pytest.raises(VerinferError, match="is not writable"):
        check_writable(Path("/sys") / "verinfer-out.json")
    with pytest.raises(VerinferError, match="is not writable"):
        check_writable(Path("/sys") / "report", directory=True)
    assert check_writable(tmp_path / "ok.json") == tmp_path / "ok.json"
    assert not list(tmp_path.glob(".verinfer-probe.*"))  # the probe leaves nothing behind


def test_two_score_runs_on_one_output_one_is_refused(tmp_path):
    """The issue-16 scenario at the level of score_claims: while one run holds the output, a second
    run gets OutputBusyError before computing anything, and the first run's parts are untouched."""
    out = tmp_path / "scores.parquet"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), "30"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusyError):
            with ResumableParts(out, {"claims": "other"}):
                pass
        assert not out.with_name(out.name + ".parts").exists()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o002])
def test_atomic_writes_get_the_umask_mode_not_0600(tmp_path, mask):
    """Outputs are shared like any file the user writes: mode 0o666 less the umask (mkstemp
    alone made every output 0600)."""
    import os

    old = os.umask(mask)
    try:
        for name, write in (("a.txt", lambda p: atomic_write_text(p, "x")),
                            ("a.json", lambda p: atomic_write_json(p, {"a": 1})),
                            ("a.parquet", lambda p: atomic_write(p, lambda tmp: pq.write_table(pa.table({"a": [1]}), tmp)))):
            write(tmp_path / name)
            assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~mask, name
    finally:
        os.umask(old)


def test_a_run_that_fails_before_any_part_leaves_no_parts_folder(tmp_path):
    """A failed run with nothing finished removes its `<out>.parts/` (it used to leave an empty
    folder holding only the manifest); one with finished parts keeps them for the resume."""
    out = tmp_path / "s.parquet"
    with pytest.raises(RuntimeError):
        with ResumableParts(out, {"job": 1}) as parts:
            assert parts.dir.is_dir()
            raise RuntimeError("the replay failed")
    assert not parts.dir.exists() and not (tmp_path / "s.parquet.lock").exists()
    with pytest.raises(KeyboardInterrupt):
        with ResumableParts(out, {"job": 1}) as parts:
            parts.write(0, lambda tmp: tmp.write_text("zero"))
            raise KeyboardInterrupt
    assert parts.path(0).read_text() == "zero"


def test_progress_bar_logs_first_and_last_counts_and_grows_its_total(capsys):
    """Off a terminal: the first count and the last (at close) are logged, and a count past the
    total raises the total (a widened tau sweep showed 36/22 and a negative eta)."""
    bar = ProgressBar("job", 2, log_every=1e9)
    for k in (1, 2, 3):
        bar.update(k)
    bar.close()
    lines = capsys.readouterr().err.splitlines()
    assert [x.split()[1] for x in lines] == ["1/2", "3/3"] and "eta -" not in lines[-1]


def test_sha256_and_lines_reads_once_what_sha256_files_gives(tmp_path):
    from verinfer.io import sha256_and_lines, sha256_files

    p = tmp_path / "c.jsonl"
    p.write_bytes(b'{"a": 1}\n' * 300_000 + b'{"b": 2}')   # > 1 MiB: several blocks, no final newline
    assert sha256_and_lines(p) == (sha256_files([p]), 300_000)


@pytest.mark.parametrize("length", [242, 250, 255])
def test_an_output_name_up_to_the_file_name_limit_is_written(tmp_path, length):
    """Issue 45 (hostile-input 7): names of 242-255 bytes were refused because the side files (the
    lock, the temp file, the parts directory, a detector's .meta.json) passed the 255-byte limit."""
    from verinfer.detect.cache import DetectorCache
    from verinfer.io import NAME_MAX, ResumableParts, atomic_write_text, check_writable, exclusive_lock, output

    out = tmp_path / ("n" * (length - 8) + ".parquet")
    assert len(out.name) == length <= NAME_MAX
    with output(out, "scores file"):
        atomic_write_text(out, "x")
    with exclusive_lock(out):
        with pytest.raises(OutputBusyError):
            with exclusive_lock(out):  # the hashed lock name is the same for the same output
                pass
    with ResumableParts(out, {"a": 1}, suffix=".txt") as parts:
        parts.write(0, lambda tmp: tmp.write_text("part"))
        assert parts.path(0).read_text() == "part"
        parts.finish()
    assert DetectorCache(out).meta_path.parent == tmp_path
    assert out.read_text() == "x"
    assert all(len(p.name.encode()) <= NAME_MAX for p in tmp_path.rglob("*"))
    check_writable(out)
    with pytest.raises(VerinferError, match="256 bytes long, more than a file name may be"):
        check_writable(tmp_path / ("n" * 248 + ".parquet"))
