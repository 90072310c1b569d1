"""optuna-dashboard on a study storage (``quantspec dashboard``): the live web view of a search.

The storage is opened the way ``quantspec pareto`` opens it (``studies.storage.open_storage``, read-only: a
missing file, database or journal is a UserError, never created), so every URL the search takes works here,
``journal:///FILE.log`` included. What the dashboard shows comes from what the search stores: the objective
names (``study.set_metric_names``: ``tok_s``, and ``quality`` in pareto mode) and the flat user attributes of
``studies.search.flat_attrs`` (tok_s, speedup and its CI, noisy, alpha, tau, accuracy, delta, kl, passes_floor),
which its trial table, history and slice plots chart and filter.

Known limit (optuna-dashboard 0.21): its trial JSON reads constraints from the legacy system attribute
``constraints`` only, so the named ones ``Trial.set_constraint`` stores (``constraints:quality_floor`` ...) are not
shown; ``passes_floor`` carries the floor verdict instead.

The server is wsgiref's, one thread per request (the page loads its assets in parallel); ``DashboardServer`` runs
in the foreground (``serve_forever``) or, as a context manager, in a background thread (tests).
"""
from __future__ import annotations

import errno
import importlib.util
import logging
import socket
import threading
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import optuna

from runtime.errors import UserError
from studies.defaults import DEFAULT_STUDY_DIR
from studies.storage import open_storage, shown_url, storage_url

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080


def resolve_storage(storage: str | None, study_dir: Path) -> str:
    """The storage URL ``quantspec pareto`` would read; without ``--storage``, a missing default SQLite file is a
    UserError (``storage_url`` alone would create the study folder)."""
    if storage is None and not (Path(study_dir) / "study.db").exists():
        raise UserError(f"no study storage at {Path(study_dir) / 'study.db'}: pass --storage URL or run "
                        "`quantspec search`")
    return storage_url(storage, Path(study_dir))


def dashboard_app(url: str):
    """optuna-dashboard's WSGI application on the storage at ``url``, which must hold at least one study."""
    if importlib.util.find_spec("optuna_dashboard") is None:
        raise UserError("quantspec dashboard needs optuna-dashboard, which is not installed here: "
                        "`pip install optuna-dashboard` (`make setup` installs it)")
    import optuna_dashboard

    storage = open_storage(url, read_only=True)
    if not optuna.get_all_study_names(storage):
        raise UserError(f"no studies in {shown_url(url)}: run `quantspec search --storage URL --create` first or "
                        "fix the URL")
    return optuna_dashboard.wsgi(storage)


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a browser's open connection does not keep the process alive after Ctrl-C


class _IPv6Server(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):  # noqa: A002  (wsgiref's signature): one line per request is noise
        pass


class DashboardServer:
    """A bound server: ``url`` answers once ``serve_forever`` runs (or inside ``with``, in a thread)."""

    def __init__(self, app, storage: str, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT):
        if not 0 <= port <= 65535:
            raise UserError(f"--port {port}: use 0..65535 (0 picks a free one)")
        server_class = _IPv6Server if ":" in host else _ThreadingServer
        try:
            self.server = make_server(host, port, app, server_class=server_class, handler_class=_QuietHandler)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use: pass another --port (--port 0 picks a free "
                                "one) or stop what listens there") from None
            reason = exc.strerror or str(exc)
            raise UserError(f"cannot listen on {host}:{port} ({reason}): pass a local --host (e.g. 127.0.0.1) "
                            "and a free --port above 1023") from None
        self.storage, self.host, self.port = storage, host, self.server.server_port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/dashboard/"

    def serve_forever(self) -> None:
        """Serve until ``shutdown`` (another thread) or KeyboardInterrupt; the socket is closed afterwards."""
        try:
            self.server.serve_forever(poll_interval=0.2)
        finally:
            self.server.server_close()

    def shutdown(self) -> None:
        self.server.shutdown()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "DashboardServer":
        self._thread = threading.Thread(target=self.serve_forever, name="optuna-dashboard", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def open_dashboard(storage: str | None = None, study_dir: Path = DEFAULT_STUDY_DIR, host: str = DEFAULT_HOST,
                   port: int = DEFAULT_PORT) -> DashboardServer:
    """optuna-dashboard on the study storage (``--storage``, else SQLite in ``study_dir``), bound to host:port and
    not yet serving; bad storage or a busy port is a UserError."""
    url = resolve_storage(storage, study_dir)
    logging.getLogger("optuna_dashboard").setLevel(logging.WARNING)
    return DashboardServer(dashboard_app(url), url, host, port)
