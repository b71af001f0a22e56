"""Consistency checks of a cache directory: fsmeta's invariants and the cache files.

:func:`fsmeta_problems` lists violations of the invariants :mod:`.schema` states (any
committed state satisfies them); :func:`cache_file_findings` compares ``data/`` with the
inodes. Both only read. ``ckptfs fsck`` runs them (and, with ``--bucket``, the bucket
comparison of :mod:`ckptfs.drain.check`); the tests run them after every step.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from . import durability, schema
from .records import FileState, Inode
from .store import MetaStore
from .txn import Txn


# Kinds of finding (``Finding.kind``), documented in docs/OPERATIONS.md.
INVARIANT = "invariant"  # fsmeta contradicts its own schema (a bug or a corrupted database)
ORPHAN_CACHE_FILE = "orphan-cache-file"  # a data/ file no inode owns
MISSING_CACHE_FILE = "missing-cache-file"  # a pending file's content is gone: data loss
SHORT_CACHE_FILE = "short-cache-file"  # a pending file's cache file lacks bytes: data loss
LONG_CACHE_FILE = "long-cache-file"  # a pending file's cache file has bytes past its size


@dataclass
class Finding:
    kind: str
    detail: str
    path: str | None = None  # file system path (relative to the mount root)
    key: str | None = None  # bucket key (relative to the prefix)
    ino: int | None = None
    upload_id: str | None = None  # an unrecorded multipart upload's id
    cache_file: str | None = None  # relative to the cache directory, e.g. data/1f
    repaired: bool = False
    repairable: bool = False

    def to_json(self) -> dict:
        return asdict(self)


def fsmeta_problems_in(txn: Txn) -> list[str]:
    """Invariants of :mod:`.schema` that any committed state satisfies, violated in ``txn``."""
    problems = []
    inodes = {i.ino: i for i in txn.iter_inodes()}
    orphans = set(txn.iter_orphans())
    dirents: dict[int, list[tuple[int, bytes]]] = {}
    subdirs: dict[int, int] = {}
    for key, value in txn.raw.cursor(db=txn.dbs["dirents"]):
        parent, name = schema.split_dirent_key(key)
        child = schema.unpack_u64(value)
        dirents.setdefault(child, []).append((parent, name))
        p = inodes.get(parent)
        if p is None or not p.is_dir:
            problems.append(f"dirent {parent}/{name!r}: parent is not a directory")
        c = inodes.get(child)
        if c is None:
            problems.append(f"dirent {parent}/{name!r}: inode {child} does not exist")
            continue
        if c.is_dir:
            subdirs[parent] = subdirs.get(parent, 0) + 1
        if txn.raw.get(schema.link_key(child, parent, name), db=txn.dbs["links"]) is None:
            problems.append(f"dirent {parent}/{name!r}: no reverse link record")
    for key, _ in txn.raw.cursor(db=txn.dbs["links"]):
        ino, parent, name = schema.split_link_key(key)
        if txn.lookup(parent, name) != ino:
            problems.append(f"link record {ino} <- {parent}/{name!r} has no dirent")
    for ino, inode in inodes.items():
        names = dirents.get(ino, [])
        if ino == schema.ROOT_INO:
            if names:
                problems.append("the root has a dirent")
            if inode.nlink != 2 + subdirs.get(ino, 0):
                problems.append(f"root nlink {inode.nlink} != 2 + {subdirs.get(ino, 0)} subdirs")
            continue
        if inode.is_dir:
            if inode.nlink == 0:
                if names:
                    problems.append(f"removed dir {ino} still has names {names}")
                if ino not in orphans:
                    problems.append(f"removed dir {ino} is not an orphan")
                continue
            if len(names) != 1:
                problems.append(f"dir {ino} has {len(names)} names")
            elif inode.parent != names[0][0]:
                problems.append(f"dir {ino}: parent field {inode.parent} != dirent parent {names[0][0]}")
            if inode.nlink != 2 + subdirs.get(ino, 0):
                problems.append(f"dir {ino}: nlink {inode.nlink} != 2 + {subdirs.get(ino, 0)} subdirs")
        else:
            if inode.nlink != len(names):
                problems.append(f"inode {ino}: nlink {inode.nlink} but {len(names)} names")
            if inode.nlink == 0 and ino not in orphans:
                problems.append(f"inode {ino}: no name and not an orphan (leaked)")
        if inode.nlink > 0 and ino in orphans:
            problems.append(f"inode {ino}: orphan with nlink {inode.nlink}")
    for ino, inode in inodes.items():
        if inode.state == FileState.DURABLE and inode.nlink > 0 and not inode.is_dir:
            remote = txn.get_remote(ino)
            pending = txn.get_pending(ino)
            if inode.durable_generation != inode.generation or remote is None or remote.generation != inode.generation:
                problems.append(f"inode {ino}: DURABLE but the bucket does not hold generation {inode.generation}")
            elif pending is not None and pending.reason == durability.DATA:
                problems.append(f"inode {ino}: DURABLE but pending for its data")
    for ino in txn.pending_inos():
        if ino not in inodes:
            problems.append(f"pending record for missing inode {ino}")
    for ino, _ in txn.iter_uploads():
        if ino not in inodes:
            problems.append(f"upload record for missing inode {ino}")
    for ino in orphans:
        if ino not in inodes:
            problems.append(f"orphan record for missing inode {ino}")
    return problems


def fsmeta_problems(meta: MetaStore) -> list[str]:
    """:func:`fsmeta_problems_in` of one read transaction of ``meta``."""
    with meta.read() as txn:
        return fsmeta_problems_in(txn)


def _path(txn: Txn, ino: int) -> str | None:
    paths = txn.paths_of(ino)
    return paths[0].decode("utf-8", "surrogateescape") if paths else None


def _has_local_content(inode: Inode, pending: bool) -> bool:
    """Whether the cache must hold this inode's whole content (the bucket does not have it)."""
    return inode.is_reg and pending and inode.durable_generation != inode.generation


def cache_file_findings(txn: Txn, data_dir: str, *, skip_open: bool = False) -> list[Finding]:
    """``data/`` against the inodes: orphan files, and pending files whose content is not whole.

    A pending file whose cache file is missing or shorter than its size has lost data that the
    bucket never received; one longer than its size has bytes a crash left past the last
    recorded size (the drain would upload the wrong length). ``skip_open``: leave files a live
    gateway has open for writing alone, and its spare files (``Txn.spare_inos``).
    """
    findings = []
    try:
        names = os.listdir(data_dir)
    except FileNotFoundError:
        names = []
    present: dict[int, int] = {}
    spares = txn.spare_inos()
    for name in names:
        path = os.path.join(data_dir, name)
        try:
            ino = int(name, 16)
        except ValueError:
            ino = None
        if ino is None or format(ino, "x") != name:
            findings.append(Finding(ORPHAN_CACHE_FILE, "not named after an inode",
                                    cache_file=f"data/{name}", repairable=True))
            continue
        inode = txn.get_inode(ino)
        if inode is None and skip_open and ino in spares:
            continue  # a live gateway's spare, named for the inode a create will make
        if inode is None or not inode.is_reg:
            findings.append(Finding(ORPHAN_CACHE_FILE, f"no inode {ino} owns it",
                                    ino=ino, cache_file=f"data/{name}", repairable=True))
            continue
        try:
            present[ino] = os.stat(path).st_size
        except FileNotFoundError:
            pass
    for inode in txn.iter_inodes():
        if not inode.is_reg:
            continue
        pending = txn.get_pending(inode.ino) is not None
        if not _has_local_content(inode, pending):
            continue
        if skip_open and txn.writer_count(inode.ino):
            continue  # a live gateway's open file: its size in fsmeta lags its writes
        size = present.get(inode.ino)
        where = _path(txn, inode.ino)
        if size is None:
            if inode.size > 0:
                findings.append(Finding(MISSING_CACHE_FILE,
                                        f"no cache file for {inode.size} bytes not yet in the bucket (data lost)",
                                        path=where, ino=inode.ino))
        elif size < inode.size:
            findings.append(Finding(SHORT_CACHE_FILE,
                                    f"cache file has {size} of {inode.size} bytes not yet in the bucket (data lost)",
                                    path=where, ino=inode.ino))
        elif size > inode.size:
            findings.append(Finding(LONG_CACHE_FILE,
                                    f"cache file has {size} bytes, fsmeta records {inode.size}",
                                    path=where, ino=inode.ino, cache_file=f"data/{inode.ino:x}",
                                    repairable=True))
    return findings


def repair_cache_file(finding: Finding, meta: MetaStore, data_dir: str) -> bool:
    """Fix one repairable cache-file finding (only while no gateway runs); True when done."""
    if finding.kind == ORPHAN_CACHE_FILE:
        name = os.path.basename(finding.cache_file or "")
        with meta.read() as txn:  # still nobody's?
            if finding.ino is not None and txn.get_inode(finding.ino) is not None:
                return False
        try:
            os.unlink(os.path.join(data_dir, name))
        except FileNotFoundError:
            pass
        return True
    if finding.kind == LONG_CACHE_FILE and finding.ino is not None:
        with meta.read() as txn:
            inode = txn.get_inode(finding.ino)
            if inode is None or txn.get_pending(inode.ino) is None:
                return False
            size = inode.size
        os.truncate(os.path.join(data_dir, format(finding.ino, "x")), size)
        return True
    return False
