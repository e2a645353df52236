"""A compiler cache folder as an artifact's bytes and back (docs/compile.md): unpacked only as
regular files and folders, with relative names that stay inside, into a folder made fresh and
private, within bounds on its size and its number of files. Real tar archives, each attack built as
it is published."""

from __future__ import annotations

import gzip
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest

from lifecycle.runtime.artifacts.archive import (
    MAX_UNPACKED_FILES,
    MIN_UNPACKED_BOUND,
    pack,
    unpack,
    unpacked_bound,
)
from lifecycle.store.learned.artifactfiles import ArtifactUnusable


def packed(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """A gzip'd tar of `members`, each with its data (None for a member without any)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, None if data is None else io.BytesIO(data))
    return buffer.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def cve_2025_4517(outside: Path) -> bytes:
    """The symlink chain of CVE-2025-4517: links through folders whose names together pass
    PATH_MAX, where `os.path.realpath` stops resolving, so that tar's `data` filter takes a link
    to the root for one inside the folder; then a file written through it, into `outside`."""
    component = "d" * 247
    steps = "abcdefghijklmnop"
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    path = ""
    for step in steps:
        members.append((member(os.path.join(path, component), tarfile.DIRTYPE), None))
        members.append((member(os.path.join(path, step), tarfile.SYMTYPE, component), None))
        path = os.path.join(path, component)
    long_link = os.path.join(*steps, "l" * 254)
    members.append((member(long_link, tarfile.SYMTYPE, "../" * len(steps)), None))
    members.append((member("escape", tarfile.SYMTYPE, long_link + "/.." * (len(steps) + 1)), None))
    members.append((member("escape" + str(outside) + "/planted"), b"planted"))
    return packed(*members)


def bomb(*, unpacked: int, chunk: int = 16 << 20) -> bytes:
    """One tar member of `unpacked` zero bytes, gzip'd in repeated members of `chunk` zeros
    each (as gzip allows): a few MB that unpack to `unpacked` bytes."""
    header = tarfile.TarInfo("fxgraph/bomb")
    header.size = unpacked
    zeros = gzip.compress(bytes(chunk), compresslevel=9)
    assert unpacked % chunk == 0
    end = bytes(2 * tarfile.BLOCKSIZE)
    return b"".join(
        [gzip.compress(header.tobuf(format=tarfile.PAX_FORMAT))]
        + [zeros] * (unpacked // chunk)
        + [gzip.compress(end)]
    )


def test_what_is_packed_unpacks_into_a_new_private_folder(tmp_path: Path) -> None:
    """A packed folder unpacks, file for file, into a folder made for it (mode 0700) inside the
    parent given, never into one that exists."""
    source = tmp_path / "source"
    (source / "fxgraph" / "ab").mkdir(parents=True)
    (source / "fxgraph" / "ab" / "entry").write_bytes(b"graph" * 100)
    (source / "kernel.py").write_text("KERNEL = 1\n")
    parent = tmp_path / "parent"
    parent.mkdir()
    first = unpack(pack(source), parent=parent)
    second = unpack(pack(source), parent=parent)
    assert first != second and first.parent == second.parent == parent
    assert stat.S_IMODE(first.stat().st_mode) == 0o700
    assert (first / "fxgraph" / "ab" / "entry").read_bytes() == b"graph" * 100
    assert (first / "kernel.py").read_text() == "KERNEL = 1\n"


def test_pack_keeps_regular_files_only(tmp_path: Path) -> None:
    """A link in the compiler's folder is not packed: the archive holds its regular files."""
    source = tmp_path / "source"
    source.mkdir()
    (source / "entry").write_bytes(b"entry")
    (source / "link").symlink_to("/etc/passwd")
    with tarfile.open(fileobj=io.BytesIO(pack(source)), mode="r:gz") as tar:
        assert [(m.name, m.isreg()) for m in tar.getmembers()] == [("entry", True)]


def test_the_symlink_chain_of_cve_2025_4517_writes_nothing_outside(tmp_path: Path) -> None:
    """The published chain (links past PATH_MAX, then a file through them) is refused at its
    first link, and nothing is written outside the folder, nor is a partial folder left."""
    outside = tmp_path / "outside"
    outside.mkdir()
    parent = tmp_path / "parent"
    parent.mkdir()
    with pytest.raises(ArtifactUnusable, match="a symbolic link, not a regular file or folder"):
        unpack(cve_2025_4517(outside), parent=parent)
    assert list(outside.iterdir()) == []
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize(
    ("kind", "said"),
    [
        (tarfile.SYMTYPE, "a symbolic link"),
        (tarfile.LNKTYPE, "a hard link"),
        (tarfile.CHRTYPE, "a character device"),
        (tarfile.BLKTYPE, "a block device"),
        (tarfile.FIFOTYPE, "a FIFO"),
    ],
)
def test_a_member_that_is_not_a_file_or_folder_is_refused(
    tmp_path: Path, kind: bytes, said: str
) -> None:
    """A link of either kind pointing inside, a device or a FIFO: the artifact is refused
    whole, saying what the member is, and nothing of it is left."""
    data = packed(
        (member("fxgraph/entry"), b"entry"),
        (member("fxgraph/other", kind, "fxgraph/entry"), None),
    )
    with pytest.raises(ArtifactUnusable, match=f"fxgraph/other.* is {said}"):
        unpack(data, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["../escaped", "fxgraph/../../escaped", "/tmp/absolute", ""])
def test_a_name_that_is_not_relative_and_inside_is_refused(tmp_path: Path, name: str) -> None:
    """A name that climbs out, an absolute one or an empty one: refused, nothing written."""
    parent = tmp_path / "parent"
    parent.mkdir()
    with pytest.raises(ArtifactUnusable, match="not a relative name inside the folder"):
        unpack(packed((member(name), b"bad")), parent=parent)
    assert list(parent.iterdir()) == [] and not (tmp_path / "escaped").exists()


def test_a_tar_bomb_is_refused_at_the_bound(tmp_path: Path) -> None:
    """2 MB that unpack to 2 GiB: refused by the member's size, before it is written; a bomb of
    many files, each within the bound, stops once they pass it, its partial folder removed."""
    one = bomb(unpacked=2 << 30)
    assert len(one) < 3 << 20
    with pytest.raises(ArtifactUnusable, match="unpacks to more than"):
        unpack(one, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []
    many = packed(*((member(f"fxgraph/{n}"), bytes(4 << 20)) for n in range(40)))
    assert unpacked_bound(len(many)) == MIN_UNPACKED_BOUND < 40 * (4 << 20)
    with pytest.raises(ArtifactUnusable, match="unpacks to more than"):
        unpack(many, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_an_archive_of_too_many_files_is_refused(tmp_path: Path) -> None:
    """More files than MAX_UNPACKED_FILES, each empty: refused at the bound, nothing left."""
    data = packed(*((member(f"f{n}"), b"") for n in range(MAX_UNPACKED_FILES + 1)))
    with pytest.raises(ArtifactUnusable, match=f"more than {MAX_UNPACKED_FILES:,} files"):
        unpack(data, parent=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_garbage_does_not_unpack_and_leaves_nothing(tmp_path: Path) -> None:
    """Bytes that are not a gzip'd tar: refused in a line, nothing left behind."""
    with pytest.raises(ArtifactUnusable, match="does not unpack"):
        unpack(b"\x1f\x8b garbage", parent=tmp_path)
    assert list(tmp_path.iterdir()) == []
