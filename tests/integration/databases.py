"""PostgreSQL and MariaDB databases of the tests' own, a way to take one offline, and tables
as earlier versions made them."""

from __future__ import annotations

import uuid

import sqlalchemy as sa

from tests.services import require

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def pg_url(database: str) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"


def _admin() -> sa.Engine:
    require("PostgreSQL")
    return sa.create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")


def fresh_pg_database(name: str) -> str:
    """Drop and create PostgreSQL database ``name``; its URL."""
    engine = _admin()
    with engine.connect() as connection:
        connection.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        connection.execute(sa.text(f'CREATE DATABASE "{name}"'))
    engine.dispose()
    return pg_url(name)


def dead_letter_database(name: str) -> str:
    """A fresh PostgreSQL database holding the dead-letter tables; its URL."""
    from idempotent_tasks.dlq import DeadLetterQueue

    url = fresh_pg_database(name)
    queue = DeadLetterQueue(url)
    queue.ensure_schema()
    queue.dispose()
    return url


def set_pg_database_online(name: str, online: bool) -> None:
    """Let connections into ``name``, or refuse new ones and cut the open ones."""
    engine = _admin()
    with engine.connect() as connection:
        connection.execute(
            sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(online).lower()}')
        )
        if not online:
            connection.execute(
                sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name"
                ),
                {"name": name},
            )
    engine.dispose()


def fresh_mariadb_database(name: str, charset: str | None = None) -> str:
    """Drop and create MariaDB database ``name`` (with ``charset`` as its default character set,
    else the server's); its URL."""
    require("MariaDB")
    engine = sa.create_engine("mysql+pymysql://root@127.0.0.1:3306/test")
    with engine.begin() as connection:
        connection.execute(sa.text(f"DROP DATABASE IF EXISTS `{name}`"))
        character_set = f" CHARACTER SET {charset}" if charset else ""
        connection.execute(sa.text(f"CREATE DATABASE `{name}`{character_set}"))
    engine.dispose()
    return f"mysql+pymysql://root@127.0.0.1:3306/{name}"


def set_schema_version(url: str, component: str, version: int) -> None:
    """Record ``component``'s tables at ``url`` as schema ``version`` (as an upgrade would)."""
    from idempotent_tasks.dlq.schema import schema_versions

    engine = sa.create_engine(url)
    with engine.begin() as connection:
        connection.execute(
            schema_versions.update()
            .where(schema_versions.c.component == component)
            .values(version=version)
        )
    engine.dispose()


def version_one_dead_letter(engine: sa.Engine, failure_id: str, task_id: str) -> None:
    """Create the dead-letter table as version 1 made it (``failure_id`` compared by the
    database's default collation and in its default character set) and record that version,
    with one failure in it."""
    from datetime import datetime, timezone

    from idempotent_tasks.dlq.schema import dead_letters, schema_versions

    old = sa.MetaData()
    old_table = sa.Table(
        dead_letters.name,
        old,
        *(
            sa.Column("failure_id", sa.String(300), nullable=False, unique=True)
            if column.name == "failure_id"
            else column._copy()
            for column in dead_letters.columns
        ),
    )
    now = datetime.now(timezone.utc)
    with engine.begin() as connection:
        old.create_all(connection)
        schema_versions.create(connection, checkfirst=True)
        connection.execute(schema_versions.insert().values(component="dead_letters", version=1))
        connection.execute(
            old_table.insert().values(
                id=str(uuid.uuid4()),
                task_name="tasks.charge",
                task_id=task_id,
                framework="celery",
                failure_id=failure_id,
                idempotency_key=None,
                args=[],
                kwargs={},
                options={},
                error_type="RuntimeError",
                error_message="boom",
                traceback=None,
                retry_count=0,
                max_retries=0,
                next_retry_at=None,
                status="permanent_failure",
                created_at=now,
                updated_at=now,
            )
        )
