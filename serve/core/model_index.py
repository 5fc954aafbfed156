"""The models a server knows and the state of each, as Triton's model repository lists them (its
RepositoryIndex), and the three calls a repository answers: what the protocols (Triton's repository
extension, encoder.v1.AdminService) call down to, and serve/assembly/repository.py implements.

  READY        served
  UNAVAILABLE  not served, with the reason: "not loaded", "unloaded", or why its load was refused
  LOADING      being built (its calls get UNAVAILABLE "loading" meanwhile)
  UNLOADING    being taken down once the calls admitted to it are answered
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from serve.core.engine import Reloaded

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"  # Triton's states


@dataclass(frozen=True)
class IndexEntry:
    """One model of the repository as Triton's RepositoryIndex lists it."""

    name: str
    version: str
    state: str  # READY | UNAVAILABLE | LOADING | UNLOADING
    reason: str  # why it is not READY ("" when it is)


class Repository(Protocol):
    def index(self) -> list[IndexEntry]:
        """Every model of the repository, served or not, with its state."""

    def load(self, name: str) -> Reloaded:
        """Loads `name` and serves it, or rebuilds and swaps it in when it is served."""

    def unload(self, name: str) -> None:
        """Stops serving `name` once every call admitted to it is answered."""
