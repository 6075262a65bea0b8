"""File helpers shared by every writer: nothing gymv writes is ever left half-written."""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from gymv.errors import GymvError, WriteError


def current_umask() -> int:
    """The process umask, read without changing it where the OS allows (Linux /proc), else by a quick swap."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a plain `open()` would give a new file (0o644 under umask 022): teammates can read runs."""
    return 0o666 & ~current_umask()


def dir_mode() -> int:
    """The mode a plain `mkdir` would give a new folder (0o755 under umask 022)."""
    return 0o777 & ~current_umask()


def follow_umask(path: str | os.PathLike) -> None:
    """Give a folder written by a library that creates private files (safetensors writes 0600, mkdtemp makes
    0700) the modes a plain write would have had, recursively; call it before the folder is renamed into place."""
    path = Path(path)
    fmode, dmode = file_mode(), dir_mode()
    os.chmod(path, dmode if path.is_dir() else fmode)
    for root, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(root, d), dmode)
        for f in files:
            if not os.path.islink(os.path.join(root, f)):
                os.chmod(os.path.join(root, f), fmode)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs: Any) -> Iterator[IO]:
    """Write to a temporary file beside `path`, fsync, then rename over it; on error the target is untouched.

    A target that exists and is neither a file nor a folder (a device such as /dev/null, a named pipe) is
    written into, as a shell's `>` would: renaming over it would replace the device itself."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():
        with _straight_into(path, mode, **kwargs) as f:
            yield f
        return
    try:
        if path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a directory")
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name[:200]}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise write_error(path, e) from None
    try:
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; the finished file follows the umask like any other
        with os.fdopen(fd, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.errno in _FILE_ERRNOS:
            raise write_error(path, e) from None
        raise


_FILE_ERRNOS = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG,
                errno.EACCES, errno.EPERM, errno.EROFS, errno.EEXIST}
_FIXES = {errno.ENOSPC: "free disk space", errno.EDQUOT: "free disk space (quota)",
          errno.EFBIG: "the file outgrew the size limit (ulimit -f); raise it", errno.EISDIR: "pass a file path",
          errno.ENAMETOOLONG: "use a shorter path", errno.EROFS: "write to a writable disk"}


# how writers without an errno say a write came short: torch.save ("file write failed"; its zip writer's
# "unexpected pos" when a write it did not check came short), safetensors' "failed writing"
_WRITE_FAILED = ("file write failed", "failed writing", "unexpected pos")
# a disk with less free than this after such a failure was filled by it (the writer's partial files are still
# there when it is asked); a large file that came short leaves at most its last write's size
LOW_SPACE_BYTES = 64 * 2**20


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path`, or its nearest ancestor that exists: the folder whose disk a path not yet written lands on."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return folder


def as_write_failure(e: BaseException, path: str | os.PathLike) -> OSError | None:
    """The disk's refusal behind `e`, as an OSError, or None when `e` is something else. Writers report it
    their own ways: an OSError; safetensors as text ending "(os error 28)"; torch.save as "file write failed",
    with no errno at all (then the disk holding `path` is asked: read-only, or under LOW_SPACE_BYTES free)."""
    if isinstance(e, OSError):
        return e if is_write_failure(e) else None
    text = str(e)
    m = re.search(r"\(os error (\d+)\)", text)
    code = int(m.group(1)) if m else None
    if code is None and any(mark in text for mark in _WRITE_FAILED):
        try:
            st = os.statvfs(nearest_existing(path))
        except OSError:
            return None
        low = st.f_bavail * st.f_frsize < LOW_SPACE_BYTES
        code = errno.EROFS if st.f_flag & os.ST_RDONLY else errno.ENOSPC if low else None
    if code is None:
        return None
    err = OSError(code, os.strerror(code), str(path))
    return err if is_write_failure(err) else None


def is_write_failure(e: BaseException) -> bool:
    """An OSError that says the disk or folder refused the write (not a bug of the writer)."""
    return isinstance(e, OSError) and e.errno in _FILE_ERRNOS


def write_error(path: Path | str, e: OSError) -> WriteError:
    """One line naming the file being written (never its temporary name) and what to do."""
    return WriteError(f"cannot write: {e.strerror or e}", where=str(path),
                      fix=_FIXES.get(e.errno, "check the path and its folder's permissions"))



@contextmanager
def _straight_into(path: Path, mode: str, **kwargs: Any) -> Iterator[IO]:
    try:
        with open(path, mode, **kwargs) as f:
            yield f
    except OSError as e:
        if e.errno in _FILE_ERRNOS:
            raise write_error(path, e) from None
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def write_jsonl(path: str | os.PathLike, rows: Iterable[dict]) -> int:
    """Atomically write rows as compact JSON lines; returns the row count."""
    n = 0
    with atomic_open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, separators=(",", ":")))
            f.write("\n")
            n += 1
    return n


def parse_json_line(line: bytes | str) -> dict:
    """One JSONL line as a dict; anything else (bytes that are not UTF-8, bad JSON, nesting too deep for
    the parser, integers too long to convert, a non-object) is a ValueError saying which."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"not UTF-8 text (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None
    try:
        row = json.loads(line)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    return row


def iter_jsonl(path: str | os.PathLike, *, on_error: str = "fail", errors: list | None = None,
               skip_option: str | None = None) -> Iterator[tuple[int, dict]]:
    """Yield (line_number, row) for each non-blank line.

    A malformed line raises a GymvError naming the file and line (on_error="fail"), or is skipped and
    recorded in `errors` as (line_number, message) (on_error="skip"). `skip_option` is the caller's own way
    to skip bad lines (a command's `--on-error skip`), offered in the error; without one, none is offered.
    """
    if on_error not in ("fail", "skip"):
        raise GymvError(f"unknown on_error mode {on_error!r}", fix="use 'skip' or 'fail'")
    path = Path(path)
    try:
        f = path.open("rb")
    except FileNotFoundError:
        raise GymvError("file not found", where=str(path), fix="check the path") from None
    except OSError as e:
        raise GymvError(f"cannot read: {e.strerror}", where=str(path), fix="check the file's permissions") from None
    except ValueError:  # a NUL byte in the path
        raise GymvError("the path holds a NUL byte (\\0)", where=repr(str(path)), fix="remove the \\0 from the path") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = parse_json_line(line)
            except ValueError as e:
                msg = f"malformed JSON line: {e}"
                if on_error == "fail":
                    fix = "repair or delete the line" + (f", or pass {skip_option}" if skip_option else "")
                    raise GymvError(msg, where=f"{path}:{lineno}", fix=fix) from None
                if errors is not None:
                    errors.append((lineno, msg))
                continue
            yield lineno, row
