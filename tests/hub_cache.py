"""A Hugging Face cache made by the tests, laid out as huggingface_hub writes a download (and reads it back):

  <cache>/models--ORG--NAME/blobs/<sha256>                      each file's content, named by its hash
  <cache>/models--ORG--NAME/snapshots/<commit>/<path>           a relative link to its blob
  <cache>/models--ORG--NAME/refs/<branch or tag>                the commit it points to

so that `HF_HUB_CACHE=<cache> HF_HUB_OFFLINE=1` resolves ORG/NAME (and ORG/NAME@<ref>) with no network, as on a
host whose cache `hf download`, transformers or sentence-transformers filled.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from model.export_format import sha256_file


def add_revision(cache: Path, repo_id: str, checkpoint: Path, ref: str = "main") -> str:
    """The files of directory `checkpoint` as one commit of `repo_id` in `cache`, `ref` pointing to it; returns the
    commit (40 hex digits, derived from the files: the same files give the same commit)."""
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    files = sorted(p for p in checkpoint.rglob("*") if p.is_file())
    hashes = {p: sha256_file(p) for p in files}
    commit = hashlib.sha1("".join(f"{p.relative_to(checkpoint)}:{h}" for p, h in hashes.items()).encode()).hexdigest()
    for path, digest in hashes.items():
        blob = folder / "blobs" / digest
        blob.parent.mkdir(parents=True, exist_ok=True)
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = folder / "snapshots" / commit / path.relative_to(checkpoint)
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            os.symlink(os.path.relpath(blob, link.parent), link)
    (folder / "refs").mkdir(parents=True, exist_ok=True)
    (folder / "refs" / ref).write_text(commit)
    return commit
