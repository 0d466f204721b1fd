"""Documents on the local file system: files, folders (recursive) and glob patterns."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlparse

from connectors.base import (
    SIDECAR_SUFFIXES,
    SourceError,
    is_hidden,
    is_sidecar,
    parse_sidecar,
)
from operators.core.document import Document

GLOB_CHARS = ("*", "?", "[")


class Listed(NamedTuple):
    path: Path
    # The folder walked or the pattern's fixed part, links resolved; None: a file named itself.
    root: Path | None


def expand_paths(paths: Sequence[str]) -> Iterator[Path]:
    """The files that paths name, once each, in order: every argument in turn, and within a
    folder or a glob sorted by path. Hidden files and folders are skipped inside folders and
    globs, and so are sidecar question files."""
    for listed in list_files(paths):
        yield listed.path


def list_files(paths: Sequence[str]) -> Iterator[Listed]:
    """expand_paths, with the root each file was found under, for `link_outside`."""
    seen: set[Path] = set()
    for pattern in paths:
        for listed in _expand_one(pattern):
            if listed.path not in seen and not is_sidecar(listed.path.name):
                seen.add(listed.path)
                yield listed


def link_outside(path: Path, root: Path | None) -> bool:
    """Whether a symbolic link on the way from `root` (resolved) to `path` leads out of it.

    A folder of untrusted documents may hold a link to `~/.aws/credentials`: what a walk or a
    pattern finds is read only when it really lies under the folder. A file named itself is the
    user's choice and is followed."""
    return root is not None and not path.resolve().is_relative_to(root)


def _expand_one(pattern: str) -> Iterator[Listed]:
    pattern = os.path.expanduser(_strip_file_scheme(pattern))
    if any(char in pattern for char in GLOB_CHARS):
        root = _fixed_part(pattern).resolve()
        for match in sorted(glob.iglob(pattern, recursive=True)):
            path = Path(match).absolute()
            if path.is_dir():
                yield from _walk(path, root)
            elif path.is_file():
                yield Listed(path, root)
        return
    path = Path(pattern).absolute()
    if path.is_dir():
        yield from _walk(path, path.resolve())
    elif path.is_file():
        yield Listed(path, None)


def _fixed_part(pattern: str) -> Path:
    """The folder a glob pattern cannot leave: its parts before the first wildcard."""
    fixed = []
    for part in Path(pattern).parts:
        if any(char in part for char in GLOB_CHARS):
            break
        fixed.append(part)
    return Path(*fixed).absolute() if fixed else Path.cwd()


def _walk(folder: Path, root: Path) -> Iterator[Listed]:
    for top, dirnames, filenames in os.walk(folder):
        visible = sorted(name for name in dirnames if not is_hidden(name))
        # os.walk does not enter linked folders; one that leads out is listed, to be refused.
        dirnames[:] = visible
        linked_out = [
            name
            for name in visible
            if Path(top, name).is_symlink() and link_outside(Path(top, name), root)
        ]
        for name in sorted(filenames + linked_out):
            if not is_hidden(name):
                yield Listed(Path(top, name), root)


def _strip_file_scheme(path: str) -> str:
    return unquote(urlparse(path).path) if path.startswith("file://") else path


def path_of(uri: str) -> Path:
    """The local path of a file:// URI."""
    return Path(_strip_file_scheme(uri))


class LocalSource:
    """Files named by paths: each a file, a folder (read recursively) or a glob pattern.

    One shard walks all the paths (so a file named twice is listed once): the walk is lazy and
    runs in a Ray read task, which also reads the files' bytes."""

    read_threads = 1

    def __init__(self, paths: Sequence[str] | str) -> None:
        self.paths = [paths] if isinstance(paths, str) else list(paths)

    def __repr__(self) -> str:
        return f"LocalSource({self.paths!r})"

    def check(self) -> None:
        if not self.paths:
            raise SourceError("no input path given: name files, folders or glob patterns")
        for pattern in self.paths:
            if next(_expand_one(pattern), None) is None:
                raise SourceError(
                    f"no input files at {pattern!r}: check that the path exists and is readable"
                )

    def documents(self) -> Iterator[Document]:
        for shard in self.shards(1):
            yield from self.shard_documents(shard)

    def shards(self, parallelism: int) -> list[Any]:
        return [tuple(self.paths)]

    def shard_documents(self, shard: Any) -> Iterator[Document]:
        for path, root in list_files(shard):
            if link_outside(path, root):
                yield Document(
                    path.as_uri(),
                    path.name,
                    error=f"{path.name} is a symbolic link that leads out of {root}: not read "
                    "(name the file itself to read it)",
                )
                continue
            try:
                stat = path.stat()
            except OSError as e:  # gone since the walk saw it
                yield Document(path.as_uri(), path.name, error=f"cannot read {path}: {e}")
                continue
            try:
                questions, error = _sidecar_questions(path, root), None
            except (SourceError, OSError, UnicodeDecodeError) as e:
                questions, error = (), f"questions beside {path.name}: {e}"
            yield Document(
                uri=path.as_uri(),
                name=path.name,
                size=stat.st_size,
                metadata={"mtime": stat.st_mtime},
                questions=questions,
                error=error,
            )

    def sizes(self) -> Iterator[int]:
        for path, root in list_files(self.paths):
            if link_outside(path, root):
                continue
            try:
                yield path.stat().st_size
            except OSError:
                continue

    def read_bytes(self, item: Document) -> bytes:
        path = path_of(item.uri)
        try:
            return path.read_bytes()
        except OSError as e:
            raise SourceError(f"cannot read {path}: {e.strerror or e}") from None


def _sidecar_questions(path: Path, root: Path | None) -> tuple[str, ...]:
    questions: tuple[str, ...] = ()
    for suffix in SIDECAR_SUFFIXES:
        sidecar = path.with_name(path.name + suffix)
        if sidecar.is_file():
            if link_outside(sidecar, root or path.parent.resolve()):
                raise SourceError(f"{sidecar.name} is a symbolic link that leads out of the folder")
            questions += parse_sidecar(sidecar.name, sidecar.read_bytes())
    return questions
