"""Writing outputs without losing work: atomic files, an exclusive lock per output, resumable parts.

Every writer in verinfer goes through this module:
- `atomic_write(path, write_fn)`: `write_fn(tmp)` writes a temp file beside `path`, which is then
  fsynced and renamed over `path` (os.replace): a reader never sees half a file, and a crash
  leaves the old file (or none). `atomic_write_text` and `atomic_save_safetensors` write text and
  weights; scores Parquet goes through `verinfer.scores.write_scores`, which calls `atomic_write`.
- `exclusive_lock(path)`: an advisory lock (fcntl.flock) on `<path>.lock`, held while a job writes
  `path` and its parts; a second writer of the same output gets an `OutputBusyError` at once
  instead of mixing its work with the first one's.
- `ResumableParts`: a job's finished pieces in `<out>.parts/` next to a manifest of what the job is
  (inputs' hashes, settings). A rerun with the same manifest skips finished parts; with another
  manifest it starts over (or refuses, `on_mismatch="error"`). Held under `exclusive_lock(out)`.
- `check_writable(path, what, directory=False, inputs=())`: fail before any compute when an output
  file (or directory) cannot be written, exists and is not a regular file (a device, FIFO or socket:
  os.replace would swap it for a file), or is one of the command's inputs (same inode).
- `output(path, what, inputs=(), directory=False)`: check_writable, then hold the output's lock
  while the command writes it (every writer of a named output goes through it or ResumableParts).

The progress display of long jobs is verinfer.progress.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterable, Iterator


from verinfer.errors import VerinferError


class OutputBusyError(VerinferError):
    """Another process is writing the same output."""


def chunked(items: Iterable, n: int) -> Iterator[list]:
    """Lists of n consecutive items (the last may be shorter), read lazily from any iterable."""
    it = iter(items)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def _blocks(paths) -> Iterator[bytes]:
    """The files' bytes in order, 1 MiB at a time."""
    for p in paths:
        with open(p, "rb") as f:
            yield from iter(lambda: f.read(1 << 20), b"")


def sha256_files(paths, digits: int = 16) -> str:
    """sha256 of the files' bytes in order (first `digits` hex digits)."""
    h = hashlib.sha256()
    for block in _blocks(paths):
        h.update(block)
    return h.hexdigest()[:digits]


def sha256_and_lines(path, digits: int = 16) -> tuple[str, int]:
    """`sha256_files([path])` and the file's line count, in one read (a JSONL file's job key and
    progress total)."""
    h, lines = hashlib.sha256(), 0
    for block in _blocks([path]):
        h.update(block)
        lines += block.count(b"\n")
    return h.hexdigest()[:digits], lines


def _umask() -> int:
    """The process umask, read without changing it where Linux tells it (os.umask can only be
    read by setting it, which other threads would see for a moment)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


NAME_MAX = 255  # bytes in one file name (Linux, macOS)


def side_path(path: str | Path, suffix: str, prefix: str = "") -> Path:
    """A side file of `path` (its lock, a temp file, its parts): prefix + name + suffix beside it, or,
    where that would pass the file-name limit, prefix + "." + the first 16 hex digits of the name's
    sha256 + suffix (the same for the same name: a lock still meets its other holders)."""
    p = Path(path)
    name = f"{prefix}{p.name}{suffix}"
    if len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX:
        return p.with_name(name)
    digest = hashlib.sha256(p.name.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return p.with_name(f"{prefix}.{digest}{suffix}")


def atomic_write(path: str | Path, write_fn: Callable[[Path], None]) -> Path:
    """Write `path` through a temp file in its directory, then os.replace it into place. The file
    gets the mode a plain open() would give it (0o666 less the umask; mkstemp makes it 0600)."""
    p = Path(path)
    refuse_special(p, "output")
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=side_path(p, ".XXXXXXXX.tmp", ".").name[:-12], suffix=".tmp")
    os.close(fd)
    try:
        write_fn(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        refuse_special(p, "output")  # created while we wrote: still never replaced
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return p


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def atomic_write_json(path: str | Path, obj, indent: int | None = 1) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent) + "\n")


def update_json_section(path: str | Path, section: str, value) -> dict:
    """Set doc[section] = value in the JSON object at `path` (a new one where there is none), the
    other sections kept; written atomically. Returns the whole document (a results file whose
    sections are rerun one at a time)."""
    p = Path(path)
    doc = json.loads(p.read_text()) if p.is_file() else {}
    doc[section] = value
    atomic_write_json(p, doc)
    return doc


def atomic_save_safetensors(tensors: dict, path: str | Path, metadata: dict[str, str] | None = None) -> Path:
    from safetensors.torch import save_file  # torch: imported only where weights are written

    return atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))


def refuse_special(path: str | Path, what: str = "output") -> None:
    """A VerinferError when `path` exists and is not a regular file (or a link to one): a device
    node, FIFO or socket that os.replace would swap for a regular file (`-o /dev/null`)."""
    p = Path(path)
    try:
        st = os.stat(p)
    except (FileNotFoundError, NotADirectoryError):
        return
    if stat.S_ISDIR(st.st_mode):
        raise VerinferError(f"the {what} path is a directory", where=str(p), fix="name a file in it, or another path")
    if not stat.S_ISREG(st.st_mode):
        kind = ("a character device" if stat.S_ISCHR(st.st_mode) else "a block device" if stat.S_ISBLK(st.st_mode)
                else "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a regular file")
        raise VerinferError(f"the {what} path exists and is {kind}: verinfer writes outputs by replacing the file, "
                            "which would replace it", where=str(p), fix="name a new file path (or a regular file)")


def refuse_inputs(path: str | Path, inputs: Iterable[str | Path], what: str = "output") -> None:
    """A VerinferError when the output `path` is one of `inputs` (the same file, by inode: a link
    or another spelling of the path counts): writing it would destroy the input before it is read."""
    p = Path(path)
    if not p.exists():
        return
    for i in inputs:
        try:
            same = os.path.samefile(p, i)
        except OSError:
            continue
        if same:
            raise VerinferError(f"the {what} is also an input of this command ({i}): writing it would destroy the "
                                "input", where=str(p), fix="write the output to another path")


def check_writable(path: str | Path, what: str = "output", *, directory: bool = False,
                   inputs: Iterable[str | Path] = ()) -> Path:
    """Refuse, before any compute, an output path that is a directory (a file when `directory`:
    an output directory), exists and is not a regular file (`refuse_special`), is one of the
    command's `inputs` (`refuse_inputs`), lies under a file, or whose directory cannot be created
    or written."""
    p = Path(path)
    if len(p.name.encode("utf-8", "surrogateescape")) > NAME_MAX:
        raise VerinferError(f"the {what} name is {len(p.name.encode('utf-8', 'surrogateescape'))} bytes long, more "
                            f"than a file name may be ({NAME_MAX})", where=str(p), fix="choose a shorter name")
    if directory and p.exists() and not p.is_dir():
        raise VerinferError(f"the {what} path is a file, not a directory", where=str(p),
                            fix="name a directory (it is created if missing)")
    if not directory:
        refuse_special(p, what)
        refuse_inputs(p, inputs, what)
    for a in ((p,) if directory else ()) + (p.parent, *p.parent.parents):
        if a.exists():
            if not a.is_dir():
                raise VerinferError(f"the {what} path lies under a file ({a})", where=str(p),
                                    fix="choose an output path in a directory")
            try:  # a real write: os.access says yes to root everywhere, even on a read-only mount
                fd, probe = tempfile.mkstemp(dir=a, prefix=".verinfer-probe.")
            except OSError as e:
                raise VerinferError(f"cannot write the {what}: {a} is not writable ({e.strerror})", where=str(p),
                                    fix="choose a writable directory") from None
            os.close(fd)
            os.unlink(probe)
            break
    if not directory and p.exists() and not os.access(p, os.W_OK):
        raise VerinferError(f"cannot overwrite the {what}", where=str(p), fix="check its permissions")
    return p


@contextmanager
def output(path: str | Path, what: str = "output", *, inputs: Iterable[str | Path] = (),
           directory: bool = False) -> Iterator[Path]:
    """`check_writable`, then `exclusive_lock(path)` held while the body writes the output: a second
    command writing the same output at the same time is refused (OutputBusyError) instead of the
    last writer silently winning."""
    p = check_writable(path, what, directory=directory, inputs=inputs)
    with exclusive_lock(p):
        yield p


@contextmanager
def exclusive_lock(path: str | Path) -> Iterator[Path]:
    """Hold `<path>.lock` exclusively (non-blocking); OutputBusyError if another process holds it."""
    p = Path(path)
    lock = side_path(p, ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputBusyError(f"another verinfer process is writing this output (lock {lock.name} is held)",
                                  where=str(p), fix="wait for it to finish, or choose another output path") from None
        try:  # the holder before us may have unlinked the file we opened: lock the current one
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        yield lock
    finally:
        try:
            os.unlink(lock)
        finally:
            os.close(fd)


def check_manifest(mpath: Path, manifest: dict, *, on_mismatch: str, where: Path,
                   what: str = "the work of another job") -> bool:
    """True when `mpath` holds exactly `manifest`. A different (or missing) manifest raises
    (on_mismatch='error') naming the fields that differ, or returns False (on_mismatch='restart')."""
    try:
        old = json.loads(mpath.read_text())
    except (OSError, json.JSONDecodeError):
        old = None
    if old == manifest:
        return True
    if on_mismatch == "error":
        old = old if isinstance(old, dict) else {}
        diff = sorted(k for k in set(manifest) | set(old) if old.get(k) != manifest.get(k))
        raise VerinferError(f"{where} holds {what} (different {', '.join(diff)})", where=str(where),
                            fix="use a new output path, or delete this one to start over")
    return False


class ResumableParts:
    """Finished pieces of one job in `<out>.parts/part-00000<suffix>`, ..., with manifest.json.

    with ResumableParts(out, manifest) as parts:
        for k, chunk in enumerate(chunks):
            if not parts.done(k):
                parts.write(k, lambda tmp: ...)   # atomic
        ... read parts.path(k) ...; write `out`; parts.finish()   # removes the parts directory
    """

    def __init__(self, out: str | Path, manifest: dict, *, suffix: str = ".parquet", on_mismatch: str = "restart"):
        if on_mismatch not in ("restart", "error"):
            raise ValueError(f"on_mismatch must be 'restart' or 'error', got {on_mismatch!r}")
        self.out = Path(out)
        self.dir = side_path(self.out, ".parts")
        self.manifest, self.suffix, self.on_mismatch = manifest, suffix, on_mismatch
        self._lock = None

    def __enter__(self) -> "ResumableParts":
        self._lock = exclusive_lock(self.out)
        self._lock.__enter__()
        try:
            mpath = self.dir / "manifest.json"
            if self.dir.is_dir() and not check_manifest(mpath, self.manifest, on_mismatch=self.on_mismatch,
                                                        where=self.dir):
                shutil.rmtree(self.dir)  # another job's parts: start over
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(mpath, self.manifest)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:  # a run that failed before finishing any part leaves nothing behind to resume
            if self.dir.is_dir() and not any(self.dir.glob(f"part-*{self.suffix}")):
                shutil.rmtree(self.dir, ignore_errors=True)
        finally:
            self._lock.__exit__(*exc)

    def path(self, k: int) -> Path:
        return self.dir / f"part-{k:05d}{self.suffix}"

    def done(self, k: int) -> bool:
        return self.path(k).is_file()

    def write(self, k: int, write_fn: Callable[[Path], None], meta: dict | None = None) -> Path:
        """Part k, written atomically; `meta` (what the part holds, e.g. its inputs' key) beside it,
        written first so that a part on disk always has the meta it was made with."""
        if meta is not None:
            atomic_write_json(self._meta_path(k), meta)
        return atomic_write(self.path(k), write_fn)

    def meta(self, k: int) -> dict | None:
        """The meta written with part k (None: no such part, or one written without meta)."""
        if not self.done(k) or not self._meta_path(k).is_file():
            return None
        try:
            return json.loads(self._meta_path(k).read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _meta_path(self, k: int) -> Path:
        return self.dir / f"part-{k:05d}.meta.json"

    def discard(self, k: int) -> None:
        """Forget a part that turned out unreadable (a killed run's leftovers are never half files,
        but a disk fault can still leave one)."""
        self.path(k).unlink(missing_ok=True)
        self._meta_path(k).unlink(missing_ok=True)

    def discard_from(self, k: int) -> None:
        """Forget part k and every later one (their inputs no longer follow the finished parts)."""
        for p in self.dir.glob(f"part-*{self.suffix}"):
            i = int(p.name[len("part-"):len("part-") + 5])
            if i >= k:
                self.discard(i)

    def finish(self) -> None:
        """The job's output is written: remove the parts."""
        shutil.rmtree(self.dir, ignore_errors=True)
