"""The cache directory: the LMDB store (key schema in :mod:`.schema`), the layout of the
directory (:mod:`.layout`), the remembered settings (:mod:`.settings`) and the durability
state machine (:mod:`.durability`). The bottom layer: imports no FUSE, S3 or other ckptfs code.
"""

if __name__ != "ckptfs.fsmeta":  # e.g. a source tree on sys.path: one module under two names breaks state
    raise ImportError("ckptfs's fsmeta package is ckptfs.fsmeta; import that instead of fsmeta")

from .records import FileState, Inode, PartRecord, PendingRecord, RemoteRecord, UploadPhase, UploadRecord
from .schema import ROOT_INO
from .store import MetaStore
from .txn import Txn

__all__ = [
    "FileState",
    "Inode",
    "MetaStore",
    "PartRecord",
    "PendingRecord",
    "RemoteRecord",
    "ROOT_INO",
    "Txn",
    "UploadPhase",
    "UploadRecord",
]
