"""The export cache: one validated export per (checkpoint files, exporter format, export options), made on
first use and reused after. No torch here: the server reads it, and runs the exporter as a process of its own.

  key(directory, options)             the cache key: sha256 over the checkpoint's file hashes (a hub snapshot's
                                      blob names are its hashes; other files are hashed), the export format
                                      (model/export_format.py FORMAT) and the exporter's options
  ExportCache(root).get(files, ...)   the entry's export directory, exported first when it is not there

An entry is `ROOT/<key>/` holding `model/` (the export) and `source.json` (what it was made from). It appears
whole or not at all: the exporter writes into a hidden scratch folder that is renamed to the entry once the
export validated (a rename within one file system is atomic), under an exclusive lock on `ROOT/<key>.lock`,
so two servers starting at once export once (the second waits, then finds the entry). Scratch folders of an
exporter that died are removed by the next holder of the lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

from model.export_format import FORMAT, sha256_file

ENTRY_EXPORT = "model"  # the export's folder within an entry
SOURCE_FILE = "source.json"


def default_root() -> Path:
    """$XDG_CACHE_HOME/onnx-encoder/exports, else ~/.cache/onnx-encoder/exports."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnx-encoder" / "exports"


def file_hash(path: Path) -> str:
    """A hub cache file's blob name (the hub names blobs by their hash: sha256 for LFS files, the git blob id
    otherwise), else the file's sha256."""
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        if target.parent.name == "blobs":
            return target.name
    return sha256_file(path)


def checkpoint_files(directory: Path) -> dict[str, str]:
    """{path relative to `directory`: hash} of every file in it (subfolders included, hidden ones not)."""
    files = {}
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if path.is_file() and not any(part.startswith(".") for part in relative.parts):
            files[relative.as_posix()] = file_hash(path)
    return files


def key(files: dict[str, str], options: Sequence[str]) -> str:
    """The entry of a checkpoint with these file hashes exported with these options by this export format."""
    blob = json.dumps({"format": FORMAT, "options": list(options), "files": files}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class ExportCache:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def entry(self, entry_key: str) -> Path:
        return self.root / entry_key

    def _complete(self, entry_key: str) -> Path | None:
        entry = self.entry(entry_key)
        if (entry / SOURCE_FILE).is_file() and (entry / ENTRY_EXPORT / "metadata.json").is_file():
            return entry / ENTRY_EXPORT
        return None

    def lookup(self, files: dict[str, str], options: Sequence[str]) -> Path | None:
        """The export directory of the entry for these checkpoint files and options when it is there, else None."""
        return self._complete(key(files, options))

    def get(self, files: dict[str, str], options: Sequence[str], source: dict,
            export: Callable[[Path, str], None]) -> tuple[Path, bool]:
        """(the export directory of the checkpoint with `files` (checkpoint_files) exported with `options`, whether
        this call exported it). `export(out_dir, name)` writes the export as out_dir/name (the exporter's --out-dir
        and --name) and raises when it fails: nothing of it is then left. `source` (the id, revision, commit) goes
        to source.json."""
        entry_key = key(files, options)
        found = self._complete(entry_key)
        if found is not None:
            return found, False
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{entry_key}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held until the entry is whole; another server waits here
            found = self._complete(entry_key)
            if found is not None:  # exported by the holder we waited for
                return found, False
            for stale in self.root.glob(f".{entry_key}.*"):  # an exporter that died holding the lock
                shutil.rmtree(stale, ignore_errors=True)
            scratch = Path(tempfile.mkdtemp(prefix=f".{entry_key}.", dir=self.root))
            try:
                export(scratch, ENTRY_EXPORT)
                (scratch / SOURCE_FILE).write_text(json.dumps(
                    {**source, "format": FORMAT, "options": list(options), "files": files}, indent=2))
                entry = self.entry(entry_key)
                if entry.exists():  # an incomplete entry (not ours to have made): replaced whole
                    shutil.rmtree(entry)
                os.rename(scratch, entry)
            except BaseException:
                shutil.rmtree(scratch, ignore_errors=True)
                raise
        return entry / ENTRY_EXPORT, True
