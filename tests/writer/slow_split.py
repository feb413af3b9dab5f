"""``python tests/writer/slow_split.py SECONDS ARGS...``: ``shardsmith ARGS...`` with the split's
journal sleeping ``SECONDS`` before it records each finished weight file, so the interrupt tests can
stop a real split process between files (the product has no hook for it)."""

from __future__ import annotations

import sys
import time

from shardsmith.cli import main
from shardsmith.writer.journal import Journal


def _slowed(seconds: float):
    record = Journal.file_done

    def file_done(self, path, digest):
        time.sleep(seconds)
        return record(self, path, digest)

    return file_done


if __name__ == "__main__":
    Journal.file_done = _slowed(float(sys.argv[1]))
    sys.argv = ["shardsmith", *sys.argv[2:]]
    main()
