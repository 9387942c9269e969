"""pgqueuer's default worker on the peers benchmark's jobs: the other side of `queuebench --phases peers`.

Issue 35 compared the queues' defaults on jobs that each insert one row into
a table of the same database. On PostgreSQL, pgqueuer's was the one ahead of
ours; this script measures it again on the machine at hand, timed as
`queuebench --phases peers` times ours: from the first job's row to the last
one's (the jobs write ``clock_timestamp()``), and also from starting the
worker processes until every row is there.

It needs its own virtualenv (pgqueuer is no dependency of this project):

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install 'pgqueuer==1.6.0' asyncpg
    /tmp/pgq/bin/python scripts/peers/pgqueuer_drain.py --dsn postgres://postgres@127.0.0.1:5432/peers --workers 1

The database must exist; the script installs pgqueuer's schema there if it
is missing, and its own table of rows, and empties both before each run.
Each worker is one process running ``pgqueuer.run()`` (``pgq run`` without its CLI) with its defaults (batch of 10,
no concurrency limit), its jobs writing through a pool of connections.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import asyncpg
import pgqueuer
from pgqueuer import AsyncpgDriver, PgQueuer, Queries

ENTRYPOINT = "one_row"
TABLE = "peer_rows"


@contextlib.asynccontextmanager
async def worker() -> AsyncIterator[PgQueuer]:
    """The factory `pgq run` starts: one entrypoint whose job inserts one row."""
    dsn = os.environ["PEERS_DSN"]
    connection = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=10)
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint(ENTRYPOINT)
    async def one_row(job: object) -> None:
        async with pool.acquire() as rows:
            await rows.execute(f"INSERT INTO {TABLE} (at) VALUES (clock_timestamp())")

    try:
        yield pgq
    finally:
        await pool.close()
        await connection.close()


async def prepare(dsn: str, jobs: int) -> None:
    connection = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(connection))
        if not await queries.schema_is_installed():
            await queries.install()
        await connection.execute(f"CREATE TABLE IF NOT EXISTS {TABLE} (id bigserial PRIMARY KEY, at timestamptz)")
        await connection.execute(f"TRUNCATE {TABLE}")
        await queries.clear_queue(None)
        await queries.enqueue([ENTRYPOINT] * jobs, [None] * jobs, [0] * jobs)
    finally:
        await connection.close()


async def rows(dsn: str) -> tuple[int, float]:
    """How many rows the jobs wrote, and the seconds from the first one's to the last one's."""
    connection = await asyncpg.connect(dsn)
    try:
        count, first, last = await connection.fetchrow(f"SELECT count(*), min(at), max(at) FROM {TABLE}")
        return count, (last - first).total_seconds() if count else 0.0
    finally:
        await connection.close()


def drain(dsn: str, workers: int, jobs: int, timeout: float) -> tuple[float, float]:
    """Jobs per second: from the first row to the last, and from starting the workers to the last row."""
    asyncio.run(prepare(dsn, jobs))
    env = {**os.environ, "PEERS_DSN": dsn}
    # pgqueuer.run() is `pgq run` without the CLI, whose option parsing fails in 1.6.0 with this typer.
    serve = [sys.executable, __file__, "--serve"]
    started = time.perf_counter()
    processes = [subprocess.Popen(serve, env=env) for _ in range(workers)]
    try:
        while True:
            count, span = asyncio.run(rows(dsn))
            if count >= jobs:
                return jobs / span, jobs / (time.perf_counter() - started)
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"only {count} of {jobs} jobs ran in {timeout:g} s")
            if any(p.poll() is not None for p in processes):
                raise SystemExit("a pgq worker exited before the jobs were done")
            time.sleep(0.01)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)


def main() -> None:
    if sys.argv[1:] == ["--serve"]:  # one worker, with pgq run's defaults
        asyncio.run(pgqueuer.run(worker))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True, help="a PostgreSQL database of its own (postgres://...)")
    parser.add_argument("--workers", type=int, default=1, help="pgq run processes (default 1)")
    parser.add_argument("--jobs", type=int, default=5000, help="jobs, each inserting one row (default 5000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; medians are printed (default 3)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    options = parser.parse_args()
    runs = [drain(options.dsn, options.workers, options.jobs, options.timeout) for _ in range(options.repeat)]
    for span_rate, wall_rate in runs:
        print(f"  first to last row {span_rate:,.0f} jobs/s; from the workers' start {wall_rate:,.0f} jobs/s")
    print(
        f"pgqueuer, {options.workers} worker(s), {options.jobs} one-row jobs, medians of {options.repeat}: "
        f"{statistics.median(r[0] for r in runs):,.0f} jobs/s first to last row, "
        f"{statistics.median(r[1] for r in runs):,.0f} jobs/s from the workers' start"
    )


if __name__ == "__main__":
    main()
