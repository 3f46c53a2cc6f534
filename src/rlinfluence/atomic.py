"""Files written whole or not at all: a temporary sibling, flushed to disk, renamed into place."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from rlinfluence.errors import UserError


def _process_umask() -> int:
    """The process's umask (read by setting it and setting it back: there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_UMASK = _process_umask()


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary sibling of ``path``, fsync it, then rename it onto
    ``path``; an ``OSError`` (full disk, read-only folder) is a ``UserError`` naming ``path``.

    The temporary file is created exclusively under an unpredictable name (``mkstemp``), so a
    link planted at a predictable name cannot redirect the write, and the rename replaces a link
    at ``path`` rather than writing through it; a folder that is a link (``audit/`` planted to
    point elsewhere) is refused. The file ends with the permissions an ordinary write would give it
    (0666 less the umask), not ``mkstemp``'s owner-only 0600, so that a shared run folder stays
    readable."""
    atomic_write_all([(path, write)])


def atomic_write_all(items: Sequence[tuple[Path, Callable[[Path], None]]]) -> None:
    """``atomic_write`` of several files that belong together (a table and the section that
    describes it): every temporary file is written first, and only once all are written are they
    renamed into place, so a full disk leaves none of them (and the previous versions) in place,
    never one without the other."""
    written: list[tuple[Path, Path]] = []
    try:
        for path, write in items:
            written.append((Path(path), _temporary(Path(path))))
            try:
                write(written[-1][1])
                _fsync(written[-1][1])
                os.chmod(written[-1][1], 0o666 & ~_UMASK)
            except OSError as exc:
                raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
        for path, tmp in written:
            try:
                os.replace(tmp, path)
                if os.name == "posix":  # the rename itself (Windows cannot open a folder to fsync it)
                    _fsync(path.parent)
            except OSError as exc:
                raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        for _, tmp in written:
            with contextlib.suppress(OSError):  # a read-only folder: nothing was written
                tmp.unlink(missing_ok=True)


def _temporary(path: Path) -> Path:
    """An exclusively created, unpredictably named empty file beside ``path`` (``UserError`` if
    ``path``'s folder is a link or cannot take it)."""
    if path.parent.is_symlink():
        raise UserError(f"cannot write {str(path)!r}: its folder is a link ({str(path.parent)!r} -> "
                        f"{os.readlink(path.parent)!r}); outputs go into real folders only")
    try:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(fd)
    except OSError as exc:
        raise UserError(f"cannot write {str(path)!r}: {exc.strerror or exc}") from None
    return Path(name)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
