"""pgqueuer's default worker on the peers benchmark's jobs: the other side of `queuebench --phases peers`.

Issue 35 compared the queues' defaults on jobs that each insert one row into
a table of the same database. On PostgreSQL, pgqueuer's was the one ahead of
ours; this script measures it again on the machine at hand, timed as
`queuebench --phases peers` times ours: from the first job's claim to the
last one's completion (pgqueuer's log: picked, then successful), and also
from starting the worker processes until every job's row is there. It
prints how the jobs split between the workers, and any row written twice.

It needs its own virtualenv (pgqueuer is no dependency of this project):

    python3 -m venv /tmp/pgq && /tmp/pgq/bin/pip install 'pgqueuer==1.6.0' asyncpg
    /tmp/pgq/bin/python scripts/peers/pgqueuer_drain.py --dsn postgres://postgres@127.0.0.1:5432/peers --workers 1

The database must exist; the script installs pgqueuer's schema there if it
is missing (and refuses an unlogged one), and its own table of rows, and
empties both, and pgqueuer's log, before each run. Each worker is one
process running ``pgqueuer.run()`` with its defaults (batches of 10, no
limit on concurrent jobs), as ``pgq run`` would.
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
from typing import Any

import asyncpg
import pgqueuer
from pgqueuer import AsyncpgDriver, Job, PgQueuer, Queries

ENTRYPOINT = "one_row"
TABLE = "peer_rows"


@contextlib.asynccontextmanager
async def worker() -> AsyncIterator[PgQueuer]:
    """The factory a worker process runs: one entrypoint whose job inserts one row (its job's id and the pid).

    The jobs write through a pool of ten connections: a choice of this
    harness, since pgqueuer leaves the job's own writes to the user; with no
    limit on concurrent jobs, the pool is what bounds how many commit at once.
    """
    dsn = os.environ["PEERS_DSN"]
    connection = await asyncpg.connect(dsn)
    pool = await asyncpg.create_pool(dsn, min_size=1, max_size=10)
    pgq = PgQueuer(AsyncpgDriver(connection))

    @pgq.entrypoint(ENTRYPOINT)
    async def one_row(job: Job) -> None:
        async with pool.acquire() as rows:
            await rows.execute(f"INSERT INTO {TABLE} (job, pid) VALUES ($1, $2)", job.id, os.getpid())

    try:
        yield pgq
    finally:
        await pool.close()
        await connection.close()


async def prepare(dsn: str, jobs: int) -> None:
    """pgqueuer's schema (installed where missing) and this harness's table, emptied; then the jobs."""
    connection = await asyncpg.connect(dsn)
    try:
        queries = Queries(AsyncpgDriver(connection))
        if not await queries.schema_is_installed():
            await queries.install()
        persistence = await connection.fetchval("SELECT relpersistence::text FROM pg_class WHERE relname = 'pgqueuer'")
        if persistence != "p":  # an unlogged queue would not pay for durable commits
            raise SystemExit(f"pgqueuer's table is not a logged one (relpersistence {persistence!r})")
        await connection.execute(f"DROP TABLE IF EXISTS {TABLE}")
        await connection.execute(f"CREATE TABLE {TABLE} (job bigint, pid integer)")
        await queries.clear_queue(None)
        await queries.clear_queue_log(None)
        await queries.enqueue([ENTRYPOINT] * jobs, [None] * jobs, [0] * jobs)
    finally:
        await connection.close()


async def watch(dsn: str, jobs: int, processes: list[subprocess.Popen[bytes]], timeout: float) -> dict[str, Any]:
    """Wait (polling one connection) until every job has its row and its completion logged; what they show."""
    started = time.perf_counter()
    connection = await asyncpg.connect(dsn)
    try:
        wall = None
        while True:
            if wall is None and await connection.fetchval(f"SELECT count(*) FROM {TABLE}") >= jobs:
                wall = time.perf_counter() - started
            done = await connection.fetchval("SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'")
            failed = await connection.fetchval("SELECT traceback FROM pgqueuer_log WHERE status = 'exception' LIMIT 1")
            if failed is not None:
                raise SystemExit(f"a job failed: {failed}")
            if wall is not None and done >= jobs:
                break
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"only {done} of {jobs} jobs finished in {timeout:g} s")
            if any(p.poll() is not None for p in processes):
                raise SystemExit("a pgqueuer worker exited before the jobs were done")
            await asyncio.sleep(0.02)
        # As queuebench times ours: from the first claim to the last acknowledgement.
        span = await connection.fetchval(
            "SELECT max(created) FILTER (WHERE status = 'successful') - min(created) FILTER (WHERE status = 'picked') "
            "FROM pgqueuer_log"
        )
        rows, distinct = await connection.fetchrow(f"SELECT count(*), count(DISTINCT job) FROM {TABLE}")
        split = [n for (n,) in await connection.fetch(f"SELECT count(*) FROM {TABLE} GROUP BY pid ORDER BY 1 DESC")]
        return {"rate": jobs / span.total_seconds(), "wall_rate": jobs / wall, "twice": rows - distinct, "split": split}
    finally:
        await connection.close()


def drain(dsn: str, workers: int, jobs: int, timeout: float) -> dict[str, Any]:
    """One run: the jobs enqueued, ``workers`` processes started, watched until done, stopped."""
    asyncio.run(prepare(dsn, jobs))
    env = {**os.environ, "PEERS_DSN": dsn}
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(workers):
            processes.append(subprocess.Popen([sys.executable, __file__, "--serve"], env=env))
        return asyncio.run(watch(dsn, jobs, processes, timeout))
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main() -> None:
    if sys.argv[1:] == ["--serve"]:  # one worker, as `pgq run` starts it: its defaults, on uvloop where installed
        # (a dependency of pgqueuer 1.6.0 on Linux); pgqueuer.run() is `pgq run` without the CLI, whose
        # option parsing fails in 1.6.0 with the typer it installs.
        try:
            import uvloop
        except ImportError:
            asyncio.run(pgqueuer.run(worker))
        else:
            uvloop.run(pgqueuer.run(worker))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", required=True, help="a PostgreSQL database of its own (postgres://...)")
    parser.add_argument("--workers", type=int, default=1, help="pgq run processes (default 1)")
    parser.add_argument("--jobs", type=int, default=5000, help="jobs, each inserting one row (default 5000)")
    parser.add_argument("--repeat", type=int, default=3, help="runs; medians are printed (default 3)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take (default 600)")
    options = parser.parse_args()
    runs = [drain(options.dsn, options.workers, options.jobs, options.timeout) for _ in range(options.repeat)]
    for run in runs:
        print(
            f"  first claim to last completion {run['rate']:,.0f} jobs/s; from the workers' start to the last row "
            f"{run['wall_rate']:,.0f} jobs/s; jobs per worker {run['split']}; rows written twice {run['twice']}"
        )
    print(
        f"pgqueuer, {options.workers} worker(s), {options.jobs} one-row jobs, medians of {options.repeat}: "
        f"{statistics.median(r['rate'] for r in runs):,.0f} jobs/s first claim to last completion, "
        f"{statistics.median(r['wall_rate'] for r in runs):,.0f} jobs/s from the workers' start"
    )


if __name__ == "__main__":
    main()
