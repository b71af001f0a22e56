"""`ckptfs verify` compares a cached copy with its object only if the copy stayed the same
file while it was hashed (drain/verify.py)."""

from __future__ import annotations

import os

import blake3

from ckptfs.drain import verify


def test_an_unchanged_copy_is_hashed(tmp_path):
    path = tmp_path / "2a"
    path.write_bytes(b"checkpoint bytes")
    assert verify._cached_copy_blake3(str(path), 16) == blake3.blake3(b"checkpoint bytes").hexdigest()
    assert verify._cached_copy_blake3(str(path), 17) is None  # another size: not the copy
    assert verify._cached_copy_blake3(str(tmp_path / "gone"), 16) is None


def _during_the_hash(monkeypatch, action):
    real = verify.hash_file_sync

    def hash_then_act(fd, size):
        result = real(fd, size)
        action()
        return result

    monkeypatch.setattr(verify, "hash_file_sync", hash_then_act)


def test_a_copy_evicted_and_fetched_again_while_hashed_is_not_judged(tmp_path, monkeypatch):
    """Before, an eviction and a new fetch between the size check and the hash gave a false
    'cached copy mismatch'."""
    path = tmp_path / "2a"
    path.write_bytes(b"checkpoint bytes")

    def refetched():
        os.unlink(path)
        path.write_bytes(b"partial fetch...")

    _during_the_hash(monkeypatch, refetched)
    assert verify._cached_copy_blake3(str(path), 16) is None


def test_a_copy_emptied_while_hashed_is_not_judged(tmp_path, monkeypatch):
    path = tmp_path / "2a"
    path.write_bytes(b"checkpoint bytes")
    _during_the_hash(monkeypatch, lambda: os.truncate(path, 0))
    assert verify._cached_copy_blake3(str(path), 16) is None
