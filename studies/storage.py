"""Optuna storage for searches: any URL Optuna takes, plus ``journal:///path/file.log``; stale-trial recovery.

- default: ``sqlite:///<study dir>/study.db``
- ``postgresql://...`` / ``mysql://...`` / ``sqlite:///...``: ``RDBStorage`` with Optuna's heartbeat, so RUNNING
  trials of a worker that died anywhere are failed (and re-queued once) after the grace period
- ``journal:///path/file.log``: ``JournalStorage(JournalFileBackend)``, for several workers over a shared disk
A worker that was killed on this host is recognised at once (its pid is gone): ``recover_stale_trials`` marks
its RUNNING trials FAIL and re-queues their parameters, on every storage.
Read-only opens (``quantspec pareto``) never create a file, database or schema they did not find.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
import warnings
from pathlib import Path

import optuna
import sqlalchemy
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.storages._heartbeat import is_heartbeat_enabled
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from runtime.errors import UserError
from studies.defaults import GRACE_S, HEARTBEAT_S

RDB_SCHEMES = ("sqlite", "postgresql", "mysql")
JOURNAL_PREFIX = "journal://"
SCHEMA_RACE_RETRIES = 5
SCHEMA_RACE_MARKS = ("UNIQUE constraint", "locked", "already exists", "duplicate key")
WORKER_ATTR = "worker"
STALE_ATTR = "stale"
REQUEUE_S = 10  # how long a dead worker's failed trial holds its place until its re-queued copy appears


def storage_url(url: str | None, study_dir: Path) -> str:
    """The URL to use: ``url`` itself, or SQLite inside the study folder."""
    if url:
        return url
    study_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(study_dir / 'study.db').resolve()}"


def shown_url(url: str) -> str:
    """``url`` with its password replaced by ***, for messages and logs."""
    if "://" not in url or url.startswith(JOURNAL_PREFIX):
        return url
    head, rest = url.split("://", 1)
    netloc, sep, tail = rest.partition("/")
    user, at, host = netloc.rpartition("@")
    if at and ":" in user:
        netloc = f"{user.split(':', 1)[0]}:***@{host}"
    return f"{head}://{netloc}{sep}{tail}"


def open_storage(url: str, *, read_only: bool = False, heartbeat_s: int = HEARTBEAT_S,
                 grace_s: int = GRACE_S) -> optuna.storages.BaseStorage:
    """Open ``url``; an unknown scheme, a missing driver or an unreachable database is a UserError.

    ``read_only``: a file, database or Optuna schema that is not there already is a UserError, not created."""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if url.startswith(JOURNAL_PREFIX):
        path = Path(url[len(JOURNAL_PREFIX):]).expanduser()
        if not path.parent.is_dir():
            raise UserError(f"journal storage {url}: folder {path.parent} does not exist; create it or fix the path")
        if read_only and not path.is_file():
            raise UserError(f"journal storage {url}: no file {path}; run `quantspec search` first or fix the path")
        return JournalStorage(JournalFileBackend(str(path)))
    if scheme not in RDB_SCHEMES or "://" not in url:
        raise UserError(f"unknown storage {shown_url(url)!r}: use sqlite:///FILE.db, postgresql://..., mysql://... "
                        "or journal:///FILE.log")
    sqlite_path = url.split(":///", 1)[1] if url.startswith("sqlite:///") else ""
    if read_only and sqlite_path and not sqlite_path.startswith(":memory:") and not Path(sqlite_path).is_file():
        raise UserError(f"no SQLite study file {sqlite_path}: run `quantspec search` first or fix the path")
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://"):]  # the driver requirements.txt installs
    for attempt in range(SCHEMA_RACE_RETRIES):
        try:
            with contextlib.nullcontext() if read_only else _sqlite_lock(url):
                return _rdb_storage(url, scheme, read_only, heartbeat_s, grace_s)
        except UserError:
            raise
        except ImportError as exc:
            raise UserError(f"storage {shown_url(url)}: no database driver for {scheme} ({exc.__cause__ or exc}); "
                            "pip install psycopg2-binary (PostgreSQL) or pymysql (MySQL)") from None
        except Exception as exc:  # sqlalchemy OperationalError / ArgumentError and friends
            text = str(exc).strip()
            if attempt + 1 < SCHEMA_RACE_RETRIES and any(m in text for m in SCHEMA_RACE_MARKS):
                time.sleep(0.2 * (attempt + 1))  # another worker is creating the schema right now
                continue
            first = " ".join(text.splitlines()[0].split()) if text else type(exc).__name__
            raise UserError(f"cannot open storage {shown_url(url)}: {first}; check the URL, the credentials and "
                            "that the database is reachable") from None


@contextlib.contextmanager
def _sqlite_lock(url: str):
    """Workers of one SQLite file take turns (a lock file beside it): only one creates Optuna's schema, only one
    re-queues a stale trial. A no-op for other storages, whose databases lock rows themselves."""
    path = url.split(":///", 1)[1] if url.startswith("sqlite:///") else ""
    if not path or path.startswith(":memory:") or not Path(path).parent.is_dir():
        yield
        return
    with open(f"{path}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class RequeueOnce(RetryHeartbeatStaleTrialCallback):
    """Optuna's retry callback (one retry) that re-queues a failed trial at most once: SQLite has no row locks, so
    two workers can both fail the same stale trial; under the lock only the first finds no copy and adds one."""

    def __init__(self, url: str):
        super().__init__(max_retry=1)
        self.url = url

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        with _sqlite_lock(self.url):
            if not any(t.system_attrs.get("failed_trial") == trial.number for t in study.get_trials(deepcopy=False)):
                super().__call__(study, trial)


def _rdb_storage(url: str, scheme: str, read_only: bool, heartbeat_s: int, grace_s: int) -> RDBStorage:
    engine_kwargs = {"connect_args": {"connect_timeout": 10}} if scheme != "sqlite" else {}
    if read_only:  # look before Optuna's create_all would make the tables
        engine = sqlalchemy.create_engine(url, **engine_kwargs)
        try:
            found = sqlalchemy.inspect(engine).has_table("studies")
        finally:
            engine.dispose()
        if not found:
            raise UserError(f"no Optuna study in {shown_url(url)} (the database has no Optuna tables): run "
                            "`quantspec search --storage URL --create` first or fix the URL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, heartbeat_interval=heartbeat_s, grace_period=grace_s,
                          heartbeat_stale_trial_callback=RequeueOnce(url),
                          engine_kwargs=engine_kwargs or None, skip_table_creation=read_only)


def worker_id() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_stale_trials(study: optuna.Study) -> list[int]:
    """Fail RUNNING trials whose worker is gone and re-queue their parameters; returns their numbers.

    Dead local workers are detected by pid; remote ones by Optuna's heartbeat (RDB storages only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)
        requeue = RequeueOnce(_url_of(study._storage))
    host, failed = socket.gethostname(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = trial.user_attrs.get(WORKER_ATTR) or {}
        if worker.get("host") != host or worker.get("pid") == os.getpid() or _pid_alive(int(worker.get("pid", 0))):
            continue
        try:
            study._storage.set_trial_user_attr(trial._trial_id, STALE_ATTR, f"worker {worker} died")
            if not study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        failed.append(trial.number)
        requeue(study, study._storage.get_trial(trial._trial_id))
    return failed


def _url_of(storage) -> str:
    """The database URL of an RDB storage (also behind Optuna's cache wrapper); "" for other storages."""
    return getattr(storage, "url", None) or getattr(getattr(storage, "_backend", None), "url", "") or ""


def in_flight(study: optuna.Study, trials: list[optuna.trial.FrozenTrial] | None = None) -> list[optuna.trial.FrozenTrial]:
    """RUNNING trials whose death would be noticed: all of them on a heartbeat storage; elsewhere those of this
    host (pid check), since a remote worker that died on a journal file would otherwise be waited for forever.
    ``trials``: a snapshot already read, so that counts taken together come from one read."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    running = [t for t in trials if t.state == TrialState.RUNNING]
    if is_heartbeat_enabled(study._storage):
        return running
    host = socket.gethostname()
    return [t for t in running if (t.user_attrs.get(WORKER_ATTR) or {}).get("host", host) == host]


def awaiting_trials(study: optuna.Study, now: float | None = None,
                    trials: list[optuna.trial.FrozenTrial] | None = None) -> list[optuna.trial.FrozenTrial]:
    """Trials that will still run: ``in_flight`` ones, WAITING (re-queued) ones, and those failed for a dead worker
    in the last REQUEUE_S whose re-queued copy is not there yet (failing and re-queueing are two steps).
    ``trials``: a snapshot already read (see ``in_flight``)."""
    trials = study.get_trials(deepcopy=False) if trials is None else trials
    requeued = {t.system_attrs.get("failed_trial") for t in trials}
    now = time.time() if now is None else now
    orphans = [t for t in trials if t.state == TrialState.FAIL and t.number not in requeued
               and not ({"error", "surplus"} & set(t.user_attrs)) and "failed_trial" not in t.system_attrs
               and t.datetime_complete is not None and now - t.datetime_complete.timestamp() < REQUEUE_S]
    return in_flight(study, trials) + [t for t in trials if t.state == TrialState.WAITING] + orphans
