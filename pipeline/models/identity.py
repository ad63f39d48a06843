"""`FileIdentity`: whether a file may have changed, told without reading it.

The one notion of "the same file" that the watcher (has it settled?), the reload policy (has
this machine's copy changed since it failed?), the sessions (was it written while it was read?)
and the model cache's known hashes (may its recorded sha256 be trusted?) share. A write changes
the size or the modification time; a rename over it changes the inode; a touch, a chmod or a
link changes the change time, which cannot be set back. git's index trusts the same fields.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FileIdentity:
    """Where a file is and what its inode says about it: device, inode, size, mtime and ctime (ns)."""

    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str | Path) -> FileIdentity:
        """The identity of the file `path` names now (symlinks followed); OSError when it has none."""
        return cls.from_stat(path, os.stat(path))

    @classmethod
    def from_stat(cls, path: str | Path, st: os.stat_result) -> FileIdentity:
        return cls(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    @property
    def key(self) -> str:
        """The identity as a file name, whatever path led to the file (the known hashes' records)."""
        return f"{self.device:x}-{self.inode:x}-{self.size:x}-{self.mtime_ns:x}-{self.ctime_ns:x}"

    @property
    def last_change_ns(self) -> int:
        return max(self.mtime_ns, self.ctime_ns)

    def written_since(self, earlier: FileIdentity) -> bool:
        """Its bytes may differ from `earlier`'s: another size or modification time (a rename over
        the path sets only the old file's change time, so that alone says nothing about its bytes)."""
        return (self.size, self.mtime_ns) != (earlier.size, earlier.mtime_ns)
