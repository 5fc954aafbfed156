"""A front-end process (`--front-ends N`; the design: serve/assembly/front_ends.py): the server's whole request
path (EncoderServer: its transports on the server's shared ports, the protocols, admission, tokenization,
every check, the answers) over models that run in the engine process.

  RemoteRepository  the engine's repository, called over the wire (load, unload, index, reload)
  Mirror            the engine's news, applied here: the served models (an Engine each, whose rows run in the
                    engine: serve/core/remote.py), the models loading or unloading, the drain delay, the drain
  serve_front_end   the process: its models told by the engine, then listening (so a front end started again
                    takes no connection before it can serve), told the engine; it drains when the engine drains
                    (or on its own SIGTERM) and exits 0; when the engine is gone (its pipe closed) it answers
                    every call it holds UNAVAILABLE and exits 1, the last of them removing the engine's folder
  EngineFolder      that folder (its sockets, every process's metrics files), which a killed engine cannot remove
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import signal
import threading

from serve import logs
from serve.config import ServerConfig
from serve.core.engine import Engine, Reloaded
from serve.core.model_index import IndexEntry
from serve.core.remote import EngineLink, remote_engine
from serve.errors import ServeError, Unavailable

log = logging.getLogger("serve.assembly.front_end")

MODELS_TIMEOUT_S = 300.0  # the engine tells a new front end its models at once; this bounds a lost message
ORPHAN_GRACE_S = 2.0  # the engine gone: what a front end still answers (UNAVAILABLE) before it stops listening


class RemoteRepository:
    """The engine's model repository, as serve/core/model_index.py's Repository (and the reload calls)."""

    def __init__(self, link: EngineLink, mirror: "Mirror") -> None:
        self._link, self._mirror = link, mirror

    def load_all(self) -> dict[str, Engine]:
        """The models the engine serves, once it has told them (a front end starts after its engine loaded)."""
        if not self._mirror.told.wait(MODELS_TIMEOUT_S):
            raise Unavailable(f"the engine did not tell its models within {MODELS_TIMEOUT_S:g} s")
        return self._mirror.engines()

    def index(self) -> list[IndexEntry]:
        return [IndexEntry(**entry) for entry in self._link.call("index")]

    def load(self, name: str) -> Reloaded:
        return Reloaded(**self._link.call("load", name=name))

    def unload(self, name: str) -> None:
        self._link.call("unload", name=name)

    def reload(self, model: str = "", export_dir: str = "", graph: str = "") -> Reloaded:
        return Reloaded(**self._link.call("reload", model=model, export_dir=export_dir, graph=graph))

    def reload_all(self) -> list[Reloaded]:
        return [Reloaded(**r) for r in self._link.call("reload_all")]


class Mirror:
    """Applies the engine's "models" messages to this front end's admission (module docstring)."""

    def __init__(self, link: EngineLink, config: ServerConfig) -> None:
        self._link, self._config = link, config
        self.server = None  # the EncoderServer, set once it is made
        self.told = threading.Event()
        self.drain = threading.Event()  # the engine drains: so does this front end
        self._built: dict[tuple, Engine] = {}  # (name, sha256, path, graph) -> its engine here
        self._current: dict[str, Engine] = {}

    def engines(self) -> dict[str, Engine]:
        return dict(self._current)

    def __call__(self, header: dict) -> None:
        engines = {}
        for spec in header["models"]:
            key = (spec["name"], spec["sha256"], spec["path"], spec["graph"])
            engine = self._built.get(key)
            if engine is None:
                try:
                    engine = self._built[key] = remote_engine(spec, self._link, self._config)
                except ServeError as error:  # the export changed on disk since the engine read it: skip it
                    logs.event(log, "model_view_failed", logging.ERROR, model=spec["name"], error=error.message)
                    continue
            engines[spec["name"]] = engine
        self._built = {key: engine for key, engine in self._built.items() if engines.get(key[0]) is engine}
        self._current = engines
        server = self.server
        if server is not None:
            server.admission.mirror(header["leaving"], engines, header["changing"])
            if header["leaving"]:
                server.not_ready()
        self.told.set()
        if header["state"] in ("draining", "stopped"):
            self.drain.set()


class EngineFolder:
    """The engine's folder (its sockets, every process's metrics files), which a killed engine (SIGKILL, the OOM
    killer) cannot remove: its last orphan does, so a server restarted after each kill leaves none behind. Each
    front end holds a shared lock on one file there for its life; an orphan that ends drops its own and removes
    the folder only if it can then lock that file alone, i.e. when no other front end still runs (one in its
    grace may yet write a metrics file there)."""

    LOCK = "front-ends.lock"

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(os.path.join(path, self.LOCK), os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_SH)

    def leave(self) -> bool:
        """The engine gone, this front end ends: True when it was the last and removed the folder."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            return False  # another front end still runs: it ends later, and removes the folder then
        shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        return True


def serve_front_end(config: ServerConfig) -> int:
    """A front-end process's life (module docstring); its exit code."""
    from serve.assembly.app import create_server

    logs.setup(config.log_level)
    logs.event(log, "front_end", index=config.front_end_index)
    folder = EngineFolder(config.ipc_dir)
    link = EngineLink(config.ipc_dir, config.front_end_index)
    mirror = Mirror(link, config)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the engine, which drains us
    signal.signal(signal.SIGTERM, lambda signum, frame: mirror.drain.set())
    link.on("models", mirror)
    engine_gone = threading.Event()

    def watch_engine() -> None:  # the engine never writes our stdin: its end is the engine's end
        while os.read(0, 4096):
            pass
        engine_gone.set()
        mirror.drain.set()

    try:
        server, _ = create_server(config, link=link, mirror=mirror)
    except (RuntimeError, ServeError) as error:
        logs.event(log, "startup_failed", logging.ERROR, error=getattr(error, "message", str(error)))
        return 1
    mirror.server = server
    link.start()
    threading.Thread(target=watch_engine, name="engine-watch", daemon=True).start()
    link.tell("hello")
    try:
        server.load()  # before listening: a front end started again takes no connection it cannot serve yet
    except ServeError as error:
        logs.event(log, "startup_failed", logging.ERROR, error=error.message)
        return 1  # never listened: nothing to drain
    server.start()
    link.tell("listening", transport=server.transport.name, port=server.port,
              http_port=server.http.port if server.http is not None else None)
    mirror.drain.wait()
    if engine_gone.is_set():
        failed = link.fail_all(Unavailable("the server's engine process ended; retry on another replica"))
        logs.event(log, "engine_gone", logging.ERROR, failed=failed)
        server.shutdown(ORPHAN_GRACE_S)  # new calls meanwhile: UNAVAILABLE (admission), never a dropped connection
        folder.leave()
        return 1
    drained = server.shutdown()
    link.stop()
    return 0 if drained else 1
