"""Model ids: `ORG/NAME[@REVISION]` resolved to a checkpoint directory by huggingface_hub, wherever a directory
is taken (`python -m export --from-pretrained`, `python -m serve --model`). No torch here: the server reads it.

  parse_spec("bge=BAAI/bge-base-en-v1.5@main")  ModelSpec(name, source, revision, options): the name to serve
                                                under (default: the id's last part, lowercased), an id or a
                                                directory, and the model's own export options, if any
                                                ("rr=Qwen/Qwen3-Reranker-0.6B --reranker-template qwen3")
  split_revision("BAAI/bge-base-en-v1.5@main") ("BAAI/bge-base-en-v1.5", "main")
  resolve(source, revision)                    Resolved(source, revision, commit, directory): a directory as
                                                is; an id through huggingface_hub's snapshot_download, which
                                                reads its cache (HF_HOME / HF_HUB_CACHE), HF_HUB_OFFLINE and
                                                HF_TOKEN and downloads when a network is there
  HubError                                     one line naming the id, the cache and what to do

huggingface_hub is the library every tool of the user's shares a cache with (transformers,
sentence-transformers, `hf download`): a model they already fetched is not fetched again, and no HTTP is
written here.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

# what a checkpoint directory needs from a repository (weights in either format, the tokenizer, the
# sentence-transformers modules and their subfolders); not the other frameworks' weights (onnx/, tf, flax)
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.bin", "*.txt", "*.model", "*/*.json", "*/*.safetensors",
                       "*/*.bin", "*/*.txt")
IGNORED_PATTERNS = ("onnx/*", "openvino/*", "*.onnx", "*.h5", "*.msgpack", "*.ot", "tf_model*", "flax_model*",
                    "rust_model*", "coreml/*")
ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # the hub's ORG/NAME


class HubError(ValueError):
    """A model id that cannot be resolved; the message is one line: the id, the cache, what to do."""


# the exporter's options that whoever exports a model by id sets itself: not a spec's to give
SET_BY_THE_SERVER = ("--from-pretrained", "--out-dir", "--name")


@dataclass(frozen=True)
class ModelSpec:
    """One model to serve: `name` it is served under, `source` an id or a directory, `revision` of an id, `options`
    of `python -m export` for its export (e.g. `--reranker-template qwen3`; part of the export cache's key)."""

    name: str
    source: str
    revision: str | None = None
    options: tuple[str, ...] = ()


@dataclass(frozen=True)
class Resolved:
    source: str  # as given: an id or a directory
    revision: str | None  # as given (None: the default branch)
    commit: str | None  # the commit an id resolved to (None for a directory)
    directory: Path  # the checkpoint: a snapshot folder of the hub cache, or the directory given

    @property
    def is_id(self) -> bool:
        return self.commit is not None


def is_id(source: str) -> bool:
    """An ORG/NAME id rather than a path: not an existing path, and shaped as the hub's ids are."""
    return not Path(source).exists() and ID.match(source) is not None


def parse_spec(text: str) -> ModelSpec:
    """`[NAME=]ID[@REVISION] [EXPORT OPTIONS]` or `[NAME=]DIRECTORY [EXPORT OPTIONS]` (words as a shell splits them);
    the name defaults to the id's (or directory's) last part, lowercased. Raises HubError on an empty part, or an
    option the server sets itself (SET_BY_THE_SERVER)."""
    try:
        words = shlex.split(text)
    except ValueError as error:
        raise HubError(f"model {text!r}: {error}") from None
    text, options = (words[0], tuple(words[1:])) if words else ("", ())
    taken = [o for o in options if o.split("=", 1)[0] in SET_BY_THE_SERVER]
    if taken:
        raise HubError(f"model {text!r}: {taken[0].split('=', 1)[0]} is set by the server for a model it exports; "
                       "give only the export's other options")
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = "", text
    source, revision = split_revision(rest)
    if not source or (sep and not name) or revision == "":
        raise HubError(f"model {text!r}: expected [NAME=]ORG/NAME[@REVISION] or [NAME=]DIRECTORY")
    return ModelSpec(name or Path(source.rstrip("/")).name.lower(), source, revision, options)


def split_revision(text: str) -> tuple[str, str | None]:
    """`ID@REVISION` -> (ID, REVISION); an existing path, or text without @, -> (text, None)."""
    if Path(text).exists() or "@" not in text:
        return text, None
    source, _, revision = text.rpartition("@")
    return source, revision


def cache_dir() -> str:
    """Where huggingface_hub keeps what it fetched (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def resolve(source: str, revision: str | None = None) -> Resolved:
    """A directory as is; an id (with `revision`: a branch, tag or commit) as a snapshot folder of the hub's cache,
    downloaded first when it is not there and a network is. Raises HubError (one line) when it cannot."""
    if not is_id(source):
        directory = Path(source)
        if not directory.is_dir():
            raise HubError(f"model {source!r} is neither a directory nor a model id (ORG/NAME[@REVISION])")
        if revision:
            raise HubError(f"model {source!r} is a directory: a revision (@{revision}) applies to model ids only")
        return Resolved(source, None, None, directory)
    try:
        from huggingface_hub import errors, snapshot_download
    except ImportError:
        raise HubError(f"model {source}: model ids need huggingface_hub, which this installation lacks (pip install "
                       "'.[serve]'); or pass a checkpoint or export directory") from None

    where = f"{source}@{revision}" if revision else source
    cache = cache_dir()
    try:
        path = Path(snapshot_download(source, revision=revision, allow_patterns=list(CHECKPOINT_PATTERNS),
                                      ignore_patterns=list(IGNORED_PATTERNS)))
    except errors.GatedRepoError:
        raise HubError(f"model {where}: gated on the Hugging Face Hub; accept its terms on its page and set HF_TOKEN "
                       f"(cache {cache})") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"model {where}: no such model on the Hugging Face Hub (or it is private: set HF_TOKEN); "
                       f"check the id (cache {cache})") from None
    except errors.RevisionNotFoundError:
        raise HubError(f"model {where}: no revision {revision!r} (a branch, tag or commit of {source}); "
                       f"check the revision (cache {cache})") from None
    except errors.LocalEntryNotFoundError:
        raise HubError(f"model {where}: not in the Hugging Face cache {cache} and the Hub cannot be reached "
                       "(HF_HUB_OFFLINE, or no network); fetch it where there is one (`hf download "
                       f"{source}`) into that cache, or point HF_HOME / HF_HUB_CACHE at a cache that has it") from None
    except errors.HfHubHTTPError as error:
        raise HubError(f"model {where}: the Hugging Face Hub answered {str(error).splitlines()[0]} "
                       f"(cache {cache})") from None
    return Resolved(source, revision, path.name, path)
