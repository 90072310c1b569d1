"""Optuna storage for searches: any URL Optuna takes, plus ``journal:///path/file.log``; stale-trial recovery.

- default: ``sqlite:///<study dir>/study.db``
- ``postgresql://...`` / ``mysql://...`` / ``sqlite:///...``: ``RDBStorage`` with Optuna's heartbeat, so RUNNING
  trials of a worker that died anywhere are failed (and re-queued once) after the grace period
- ``journal:///path/file.log``: ``JournalStorage(JournalFileBackend)``, for several workers over a shared disk
A worker that was killed on this host is recognised at once (its pid is gone): ``recover_stale_trials`` marks
its RUNNING trials FAIL and re-queues their parameters, on every storage.
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
from optuna.storages import JournalStorage, RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from runtime.errors import UserError

RDB_SCHEMES = ("sqlite", "postgresql", "mysql")
JOURNAL_PREFIX = "journal://"
HEARTBEAT_S = 20
GRACE_S = 60
SCHEMA_RACE_RETRIES = 5
SCHEMA_RACE_MARKS = ("UNIQUE constraint", "locked", "already exists", "duplicate key")
WORKER_ATTR = "worker"
STALE_ATTR = "stale"


def storage_url(url: str | None, study_dir: Path) -> str:
    """The URL to use: ``url`` itself, or SQLite inside the study folder."""
    if url:
        return url
    study_dir.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{(study_dir / 'study.db').resolve()}"


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Open ``url``; an unknown scheme, a missing driver or an unreachable database is a UserError."""
    scheme = url.split(":", 1)[0].split("+", 1)[0].lower()
    if url.startswith(JOURNAL_PREFIX):
        path = Path(url[len(JOURNAL_PREFIX):]).expanduser()
        if not path.parent.is_dir():
            raise UserError(f"journal storage {url}: folder {path.parent} does not exist; create it or fix the path")
        return JournalStorage(JournalFileBackend(str(path)))
    if scheme not in RDB_SCHEMES or "://" not in url:
        raise UserError(f"unknown storage {url!r}: use sqlite:///FILE.db, postgresql://..., mysql://... "
                        "or journal:///FILE.log")
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg2://" + url[len("postgresql://"):]  # the driver requirements.txt installs
    for attempt in range(SCHEMA_RACE_RETRIES):
        try:
            with _sqlite_schema_lock(url):
                return _rdb_storage(url, scheme)
        except ImportError as exc:
            raise UserError(f"storage {url}: no database driver for {scheme} ({exc.__cause__ or exc}); "
                            "pip install psycopg2-binary (PostgreSQL) or pymysql (MySQL)") from None
        except Exception as exc:  # sqlalchemy OperationalError / ArgumentError and friends
            text = str(exc).strip()
            if attempt + 1 < SCHEMA_RACE_RETRIES and any(m in text for m in SCHEMA_RACE_MARKS):
                time.sleep(0.2 * (attempt + 1))  # another worker is creating the schema right now
                continue
            first = text.splitlines()[0] if text else type(exc).__name__
            raise UserError(f"cannot open storage {url}: {first}; check the URL and that the database is reachable") from None


@contextlib.contextmanager
def _sqlite_schema_lock(url: str):
    """Workers opening one new SQLite file take turns, so only one of them creates Optuna's schema."""
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


def _rdb_storage(url: str, scheme: str) -> RDBStorage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RDBStorage(url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S,
                          heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
                          engine_kwargs={"connect_args": {"connect_timeout": 10}} if scheme != "sqlite" else None)


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
        requeue = RetryHeartbeatStaleTrialCallback(max_retry=1)
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
