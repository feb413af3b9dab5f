"""The split journal: which files of a partial split are finished, so ``--resume`` can reuse them.

``OUT.partial/journal.jsonl`` holds one JSON object per line: first ``{"key": ...}`` (the source
files' names, sizes and mtimes, the plan's hash, the ranks and the file size limit; a resume with
another key starts over), then ``{"file": path, "bytes", "xxh3_128", "tensors"}`` for each weight
file once written, hashed and fsynced, and ``{"source": name, "bytes", "xxh3_128"}`` for each
source shard once read through. Each line is flushed and fsynced; a torn last line is ignored.
Before reuse every journaled file is hashed again and dropped if it differs.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from shardsmith.pack.format import hash_file
from .stwriter import FileDigest

JOURNAL = "journal.jsonl"
JOURNAL_TMP = "journal.tmp"  # the journal being rewritten by :meth:`Journal.open`, renamed over JOURNAL


class Journal:
    """Append-only record of finished work in a partial pack directory.

    Attributes:
        files: finished weight files by pack-relative path.
        sources: finished source shards: name -> ``(bytes, xxh3_128)``.
    """

    def __init__(self, root: Path, key: dict) -> None:
        self.path = root / JOURNAL
        self.key = key
        self.files: dict[str, FileDigest] = {}
        self.sources: dict[str, tuple[int, str]] = {}
        self._lock = threading.Lock()
        self._fh = None

    @classmethod
    def resume(cls, root: Path, key: dict, *, workers: int = 2) -> tuple["Journal", list[str]]:
        """Load the journal in ``root`` if its key is ``key``; re-hash and keep the intact files.

        Returns:
            the journal (empty when absent or of another key) and notes on what was dropped.
        """
        j = cls(root, key)
        notes: list[str] = []
        if not j.path.exists():
            return j, ["no journal in the partial directory (interrupted before its first record): starting over"]
        lines = j.path.read_text().splitlines()
        recs = []
        for line in lines:
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line
        if not recs or recs[0].get("key") != key:
            return j, ["the partial split was for another source, plan or rank set: starting over"]
        files = {r["file"]: FileDigest(r["bytes"], r["xxh3_128"], r["tensors"]) for r in recs[1:] if "file" in r}
        j.sources = {r["source"]: (r["bytes"], r["xxh3_128"]) for r in recs[1:] if "source" in r}

        def check(item: tuple[str, FileDigest]) -> tuple[str, bool]:
            path, d = item
            p = root / path
            return path, p.is_file() and p.stat().st_size == d.size and hash_file(p) == (d.size, d.xxh3_128)

        with ThreadPoolExecutor(max(1, workers)) as ex:
            for path, ok in ex.map(check, files.items()):
                if ok:
                    j.files[path] = files[path]
                else:
                    notes.append(f"{path}: differs from its journal entry; rewriting it")
        return j, notes

    def open(self) -> None:
        """Rewrite the journal with the key and the records kept so far, then append from here."""
        tmp = self.path.with_name(JOURNAL_TMP)
        with open(tmp, "w") as fh:
            fh.write(json.dumps({"key": self.key}) + "\n")
            for name, (n, h) in self.sources.items():
                fh.write(json.dumps({"source": name, "bytes": n, "xxh3_128": h}) + "\n")
            for path, d in self.files.items():
                fh.write(json.dumps({"file": path, "bytes": d.size, "xxh3_128": d.xxh3_128, "tensors": d.tensors}) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)
        self._fh = open(self.path, "a")

    def _append(self, rec: dict) -> None:
        with self._lock:
            self._fh.write(json.dumps(rec) + "\n")
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def file_done(self, path: str, digest: FileDigest) -> None:
        """Record weight file ``path`` as finished with ``digest``."""
        self.files[path] = digest
        self._append({"file": path, "bytes": digest.size, "xxh3_128": digest.xxh3_128, "tensors": digest.tensors})

    def source_done(self, name: str, nbytes: int, xxh: str) -> None:
        """Record source shard ``name`` as read through, with its size and hash."""
        self.sources[name] = (nbytes, xxh)
        self._append({"source": name, "bytes": nbytes, "xxh3_128": xxh})

    def close(self) -> None:
        """Close the journal file (it stays on disk until the pack is renamed into place)."""
        if self._fh:
            self._fh.close()
            self._fh = None
