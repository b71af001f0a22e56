"""fsmeta: the LMDB store of ckptfs (namespace, attributes, durability state, drain queue).

The key schema is documented in :mod:`fsmeta.schema`. This package imports no
FUSE or S3 code.
"""

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
