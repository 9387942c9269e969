"""A private, throwaway MariaDB server for tests that restart their database.

Restarting the shared server would disturb every other test (and other
projects on the machine), so the restart test runs its own ``mariadbd`` on
a free port with a data directory in a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])


def find(program: str) -> str | None:
    return shutil.which(program, path=SBIN)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MariaDBServer:
    def __init__(self, base: Path) -> None:
        self.datadir = base / "data"
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None
        self.log = base / "server.log"
        subprocess.run(
            [
                find("mariadb-install-db") or "mariadb-install-db",
                "--no-defaults",
                f"--datadir={self.datadir}",
                "--user=root",
                "--auth-root-authentication-method=normal",
                "--skip-test-db",
            ],
            check=True,
            capture_output=True,
        )

    @property
    def url(self) -> str:
        return f"mysql://root@127.0.0.1:{self.port}/queue"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                find("mariadbd") or "mariadbd",
                "--no-defaults",
                f"--datadir={self.datadir}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--socket={self.datadir / 'mysqld.sock'}",
                f"--pid-file={self.datadir / 'mysqld.pid'}",
                "--user=root",
                "--skip-grant-tables",
                "--innodb-buffer-pool-size=64M",
                f"--log-error={self.log}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self.execute("SELECT 1")
                return
            except Exception:
                if self.process.poll() is not None:
                    raise RuntimeError(f"mariadbd exited: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)
        raise RuntimeError("mariadbd did not answer within 60 s")

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)

    def execute(self, sql: str, database: str | None = None) -> list[tuple]:
        import MySQLdb

        connection = MySQLdb.connect(host="127.0.0.1", port=self.port, user="root", database=database or "")
        try:
            cursor = connection.cursor()
            cursor.execute(sql)
            rows = list(cursor.fetchall())
            connection.commit()
            return rows
        finally:
            connection.close()
