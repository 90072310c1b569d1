"""A throwaway PostgreSQL server for tests, from Debian's packages (`make pg` installs them).

``initdb`` into a temp dir, ``pg_ctl start`` on a free 127.0.0.1 port with password (scram) auth over TCP, one
password-protected role; ``new_database()`` hands out fresh empty databases owned by it. As root the server runs
as the ``postgres`` system user (PostgreSQL refuses root). ``stop()`` stops it and removes the dir.
"""
from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

ROLE, PASSWORD = "quantspec", "qs-test-pw"
SUPERUSER, SUPERPASSWORD = "postgres", "qs-super-pw"


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be started here (binaries or the postgres user missing); the text says why."""


def find_bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if not found:
        raise PgUnavailable("PostgreSQL server binaries not found (/usr/lib/postgresql/*/bin/initdb): run `make pg`")
    return Path(found[-1]).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self):
        self.bindir = find_bindir()
        self.as_user = []
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                raise PgUnavailable("running as root without runuser: cannot start PostgreSQL as another user")
            try:
                import pwd
                pwd.getpwnam("postgres")
            except KeyError:
                raise PgUnavailable("running as root and no `postgres` system user (Debian's postgresql package "
                                    "creates it): run `make pg`") from None
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self.root = Path(tempfile.mkdtemp(prefix="quantspec-pg-"))
        self.data, self.port, self.started = self.root / "data", _free_port(), False
        self._databases = 0

    def _run(self, *args: str) -> None:
        proc = subprocess.run([*self.as_user, *args], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise PgUnavailable(f"{Path(args[0]).name} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-800:]}")

    def start(self) -> "PgServer":
        pwfile = self.root / "pw"
        pwfile.write_text(SUPERPASSWORD + "\n")
        if self.as_user:
            shutil.chown(self.root, "postgres")
            shutil.chown(pwfile, "postgres")
        self._run(str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER, f"--pwfile={pwfile}",
                  "--auth-local=scram-sha-256", "--auth-host=scram-sha-256", "-E", "UTF8", "--no-sync")
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={self.root} "
                   "-c fsync=off -c max_connections=100")
        self._run(str(self.bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data), "-l",
                  str(self.root / "log"), "-o", options)
        self.started = True
        self._admin(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}'")
        return self

    def _admin(self, sql: str, database: str = "postgres"):
        import psycopg2

        conn = psycopg2.connect(host="127.0.0.1", port=self.port, user=SUPERUSER, password=SUPERPASSWORD,
                                dbname=database)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall() if cur.description else None
        finally:
            conn.close()

    def url(self, database: str, password: str = PASSWORD) -> str:
        return f"postgresql://{ROLE}:{password}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh empty database owned by the test role; returns its URL."""
        self._databases += 1
        name = f"t{self._databases}"
        self._admin(f"CREATE DATABASE {name} OWNER {ROLE}")
        return self.url(name)

    def databases(self) -> set[str]:
        return {row[0] for row in self._admin("SELECT datname FROM pg_database")}

    def tables(self, database: str) -> set[str]:
        return {row[0] for row in self._admin(
            "SELECT table_name FROM information_schema.tables WHERE table_schema NOT IN "
            "('pg_catalog', 'information_schema')", database)}

    def stop(self) -> None:
        try:
            if self.started:
                self._run(str(self.bindir / "pg_ctl"), "stop", "-m", "immediate", "-w", "-D", str(self.data))
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
