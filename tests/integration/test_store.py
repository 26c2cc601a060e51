"""The store on a real Postgres: migrations, the migration check, the schema, API keys, `rein keys`."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import func, inspect, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import IntegrityError, OperationalError
from sqlalchemy.pool import NullPool

from rein.cli.main import main
from rein.core.settings import Settings
from rein.store import keys
from rein.store.db import (
    DatabaseNotMigratedError,
    HeldConnections,
    check_migrations_current,
    make_engine,
    session_scope,
)
from rein.store.migrate import current_revision, head_revision, upgrade
from rein.store.tables import ApiKey, Base, Job, Result, Usage

TABLES = {"api_keys", "jobs", "results", "usage", "alembic_version", "files", "batches", "lora_adapters",
          "webhook_endpoints", "webhook_events", "webhook_attempts", "stored_images"}
HEAD = "0017"   # the newest migration


def engine_for(url: str):
    return make_engine(url, poolclass=NullPool)


# --- migrations


def test_migrate_creates_database_and_tables_and_is_idempotent(make_database):
    url = make_database(create=False)
    first = upgrade(Settings(database_url=url))
    assert first.created_database and first.before is None and first.after == head_revision() == HEAD
    engine = engine_for(url)
    try:
        assert set(inspect(engine).get_table_names()) == TABLES
        assert current_revision(engine) == HEAD
        second = upgrade(Settings(database_url=url))
        assert not second.created_database and second.before == second.after == HEAD
        assert set(inspect(engine).get_table_names()) == TABLES
    finally:
        engine.dispose()


def test_migrate_cli(make_database, capsys):
    url = make_database(create=False)
    assert main(["migrate", "--database-url", url, "--check"]) == 1
    assert "does not exist" in capsys.readouterr().out
    assert main(["migrate", "--database-url", url]) == 0
    out = capsys.readouterr().out
    name = url.rsplit("/", 1)[1]
    assert f"database {name}: created" in out and f"upgraded from revision (none) to {HEAD}" in out
    assert main(["migrate", "--database-url", url]) == 0
    assert f"already at revision {HEAD}" in capsys.readouterr().out
    assert main(["migrate", "--database-url", url, "--check"]) == 0
    assert f"at revision {HEAD} (latest)" in capsys.readouterr().out


def test_migrate_cli_unreachable_server(capsys):
    assert main(["migrate", "--database-url", "postgresql+psycopg://postgres@127.0.0.1:1/rein"]) == 2
    assert "cannot connect to Postgres at 127.0.0.1:1" in capsys.readouterr().err


def test_check_migrations_current(make_database):
    url = make_database()
    name = url.rsplit("/", 1)[1]
    engine = engine_for(url)
    try:
        with pytest.raises(DatabaseNotMigratedError) as error:
            check_migrations_current(engine)
        assert str(error.value) == (f"database {name} is not migrated (at revision None, need {HEAD}): "
                                    "run `rein migrate`")
        upgrade(Settings(database_url=url))
        assert check_migrations_current(engine) == HEAD
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
        with pytest.raises(DatabaseNotMigratedError, match="revision ffff, which this version of rein does not know"):
            check_migrations_current(engine)
    finally:
        engine.dispose()


def test_check_migrations_on_missing_database(make_database):
    url = make_database(create=False)
    engine = engine_for(url)
    with pytest.raises(DatabaseNotMigratedError, match=rf"does not exist \(need revision {HEAD}\): run `rein migrate`"):
        check_migrations_current(engine)


def _schema_diff(conn):
    context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
    return compare_metadata(context, Base.metadata)


def test_models_match_the_migrated_schema(db_engine):
    with db_engine.connect() as conn:
        assert _schema_diff(conn) == []
        conn.rollback()
        # the comparison does see a difference when there is one (DDL rolls back in Postgres)
        with conn.begin() as transaction:
            conn.execute(text("ALTER TABLE results DROP COLUMN logprobs"))
            conn.execute(text("DROP INDEX ix_jobs_tenant_created_at"))
            diff = _schema_diff(conn)
            transaction.rollback()
    assert {entry[0] for entry in diff} == {"add_column", "add_index"}


# --- models


def make_key(session, tenant: str, **kwargs) -> keys.CreatedKey:
    return keys.create_key(session, name=kwargs.pop("name", f"{tenant} key"), tenant=tenant,
                           scopes=kwargs.pop("scopes", "inference,batch,usage"), **kwargs)


def make_job(key: keys.KeyInfo, **kwargs) -> Job:
    values = dict(tenant=key.tenant, key_id=key.key_id, model="tiny", endpoint="/v1/completions",
                  params={"body": {"prompt": "hi", "max_tokens": 4}, "sampling": {"temperature": 0.0}},
                  prompt_token_ids=[1, 2, 3], prompt_tokens=3)
    return Job(**(values | kwargs))


def test_job_result_usage_round_trip(db_sessionmaker, tenant):
    with session_scope(db_sessionmaker) as session:
        key = make_key(session, tenant).info
        job = make_job(key, metadata_={"custom_id": "a"}, idempotency_key="idem-1", priority=5)
        session.add(job)
        session.flush()
        job_id = job.id
        session.add(Result(job_id=job_id, text="héllo 👋", finish_reason="stop", token_ids=[7, 8, 9],
                           logprobs={"content": [{"token": "h", "logprob": -0.5}]}))
        session.add(Usage(job_id=job_id, tenant=tenant, key_id=key.key_id, model="tiny",
                          prompt_tokens=3, completion_tokens=3, cached_tokens=2))
    assert job_id.startswith("job_") and len(job_id) == 36

    with db_sessionmaker() as session:
        job = session.get(Job, job_id)
        assert (job.status, job.attempt, job.priority, job.worker) == ("queued", 0, 5, None)
        assert job.params["sampling"] == {"temperature": 0.0} and job.prompt_token_ids == [1, 2, 3]
        assert job.metadata_ == {"custom_id": "a"} and job.idempotency_key == "idem-1"
        assert job.created_at.tzinfo is not None and job.queued_at is not None
        assert job.started_at is job.first_token_at is job.finished_at is job.error is None
        assert job.result.text == "héllo 👋" and job.result.token_ids == [7, 8, 9]
        assert job.result.logprobs["content"][0]["logprob"] == -0.5
        assert (job.usage.prompt_tokens, job.usage.completion_tokens, job.usage.cached_tokens) == (3, 3, 2)

        job.status, job.error = "failed", {"message": "engine error", "type": "server_error", "code": None}
        session.commit()
        assert session.scalar(select(Job.error["type"].astext).where(Job.id == job_id)) == "server_error"

        # defaults: an empty metadata object, no result or usage yet
        bare = make_job(key)
        session.add(bare)
        session.commit()
        session.refresh(bare)
        assert bare.metadata_ == {} and bare.result is None and bare.usage is None


def test_job_status_is_checked(db_sessionmaker, tenant):
    with db_sessionmaker() as session:
        key = make_key(session, tenant).info
        session.add(make_job(key, status="done"))
        with pytest.raises(IntegrityError, match="ck_jobs_status_valid"):
            session.flush()


def test_usage_is_unique_per_job(db_sessionmaker, tenant):
    with session_scope(db_sessionmaker) as session:
        key = make_key(session, tenant).info
        job = make_job(key)
        session.add(job)
        session.flush()
        job_id = job.id
    row = dict(job_id=job_id, tenant=tenant, key_id=key.key_id, model="tiny", prompt_tokens=3,
               completion_tokens=5)
    with session_scope(db_sessionmaker) as session:
        session.add(Usage(**row))
    with db_sessionmaker() as session:
        session.add(Usage(**row | {"completion_tokens": 6}))
        with pytest.raises(IntegrityError, match="uq_usage_job_id"):
            session.flush()
    # the worker's idempotent write: a redelivered job's second insert changes nothing
    with session_scope(db_sessionmaker) as session:
        result = session.execute(insert(Usage).values(**row | {"completion_tokens": 6})
                                 .on_conflict_do_nothing(index_elements=["job_id"]).returning(Usage.id))
        assert result.first() is None
    with db_sessionmaker() as session:
        rows = session.scalars(select(Usage).where(Usage.job_id == job_id)).all()
        assert [u.completion_tokens for u in rows] == [5]


def test_idempotency_key_is_unique_per_tenant(db_sessionmaker, tenant):
    with session_scope(db_sessionmaker) as session:
        key = make_key(session, tenant).info
        other = make_key(session, tenant + "-other").info
        session.add_all([make_job(key, idempotency_key="same"), make_job(other, idempotency_key="same"),
                         make_job(key), make_job(key)])      # NULL keys never clash
    with db_sessionmaker() as session:
        session.add(make_job(key, idempotency_key="same"))
        with pytest.raises(IntegrityError, match="uq_jobs_tenant_idempotency_key"):
            session.flush()


# --- keys


def test_key_create_and_authenticate(db_sessionmaker, tenant):
    with session_scope(db_sessionmaker) as session:
        created = keys.create_key(session, name="my app", tenant=tenant, scopes="inference, batch",
                                  rpm=60, tpm=10_000)
    key_id, secret = keys.parse_key(created.key)
    assert created.key == f"rein_{key_id}_{secret}" and len(secret) == 43
    assert created.info.key_id == key_id and created.info.scopes == ("inference", "batch")

    with db_sessionmaker() as session:
        info = keys.authenticate(session, created.key)
        assert (info.tenant, info.name, info.scopes, info.rpm_limit, info.tpm_limit) == \
            (tenant, "my app", ("inference", "batch"), 60, 10_000)
        row = session.get(ApiKey, key_id)
        assert row.secret_hash == hashlib.sha256(secret.encode()).digest()
        stored = session.execute(text("SELECT CAST(t AS text) FROM api_keys t WHERE key_id = :k"),
                                 {"k": key_id}).scalar_one()
        assert secret not in stored and secret.encode().hex() not in stored


def test_rejected_keys(db_sessionmaker, tenant):
    with session_scope(db_sessionmaker) as session:
        created = make_key(session, tenant)
    key_id, secret = keys.parse_key(created.key)
    wrong_secret = keys.format_key(key_id, ("A" if secret[0] != "A" else "B") + secret[1:])
    unknown_id = keys.format_key("0" * 12 if key_id != "0" * 12 else "1" * 12, secret)
    with db_sessionmaker() as session:
        for bad in (wrong_secret, unknown_id):
            with pytest.raises(keys.InvalidKeyError, match="^invalid API key$"):
                keys.authenticate(session, bad)
        for malformed in ("", "Bearer x", created.key + "x", created.key.replace("rein_", "sk_")):
            with pytest.raises(keys.InvalidKeyError, match="expected 'rein_<key id>_<secret>'"):
                keys.authenticate(session, malformed)
    with session_scope(db_sessionmaker) as session:
        revoked = keys.revoke_key(session, key_id)
        assert revoked.revoked
    with session_scope(db_sessionmaker) as session:
        assert keys.revoke_key(session, key_id).revoked_at == revoked.revoked_at   # idempotent
    with db_sessionmaker() as session:
        with pytest.raises(keys.InvalidKeyError, match="revoked"):
            keys.authenticate(session, created.key)
        with pytest.raises(keys.InvalidKeyError, match="^invalid API key$"):   # no hint without the secret
            keys.authenticate(session, wrong_secret)
        with pytest.raises(keys.KeyNotFoundError):
            keys.revoke_key(session, "ffffffffffff")


def test_unknown_id_and_wrong_secret_take_the_same_path(db_sessionmaker, tenant, monkeypatch):
    with session_scope(db_sessionmaker) as session:
        created = make_key(session, tenant)
    key_id, secret = keys.parse_key(created.key)
    with db_sessionmaker() as session:
        stored_hash = session.get(ApiKey, key_id).secret_hash

    compared: list[bytes] = []
    real_compare = keys.hmac.compare_digest

    def spy(a, b):
        compared.append(b)
        return real_compare(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    with db_sessionmaker() as session:
        for presented in (keys.format_key("0" * 12, secret), keys.format_key(key_id, "x" * 43)):
            with pytest.raises(keys.InvalidKeyError):
                keys.authenticate(session, presented)
        keys.authenticate(session, created.key)
    # one 32-byte comparison each: the unknown id against the dummy hash, the others against the row's
    assert compared == [keys._DUMMY_HASH, stored_hash, stored_hash]
    assert len(keys._DUMMY_HASH) == len(stored_hash) == 32


def test_secret_check_is_fast():
    _, secret = keys.generate_key()
    stored = keys.hash_secret(secret)
    start = time.perf_counter()
    for _ in range(1000):
        assert keys.secret_matches(secret, stored)
        assert not keys.secret_matches(secret, None)
    assert (time.perf_counter() - start) / 2000 < 1e-3


def test_key_input_errors(db_session):
    with pytest.raises(ValueError, match="unknown scope 'root'"):
        keys.create_key(db_session, name="x", scopes="inference,root")
    with pytest.raises(ValueError, match="at least one scope"):
        keys.create_key(db_session, name="x", scopes=" , ")
    with pytest.raises(ValueError, match="must be 1 to 128 letters"):
        keys.create_key(db_session, name="my app", scopes="inference", tenant="my app")


def test_keys_of_one_name_share_a_tenant_only_when_told(db_session):
    first = keys.create_key(db_session, name="my app", scopes="inference").info
    second = keys.create_key(db_session, name="my app", scopes="inference").info
    assert first.tenant != second.tenant and first.tenant.startswith("t-")
    shared = keys.create_key(db_session, name="my app", scopes="inference", tenant=first.tenant).info
    assert shared.tenant == first.tenant
    with pytest.raises(ValueError, match="rpm must be a positive number"):
        keys.create_key(db_session, name="x", scopes="inference", rpm=0)


# --- `rein keys`


def test_keys_cli(settings, tenant, db_sessionmaker, capsys):
    db = ["keys", "--database-url", settings.database_url]
    assert main([*db, "create", "--name", "ci bot", "--tenant", tenant, "--scopes", "inference,usage",
                 "--rpm", "5"]) == 0
    out = capsys.readouterr().out
    key = out.rstrip("\n").splitlines()[-1]
    key_id, secret = keys.parse_key(key)
    assert out.count(secret) == 1 and f"key id:  {key_id}" in out
    with db_sessionmaker() as session:
        assert keys.authenticate(session, key).scopes == ("inference", "usage")

    assert main([*db, "create", "--name", "ci bot", "--tenant", tenant, "--scopes", "batch"]) == 0
    second = capsys.readouterr().out.splitlines()[-1]
    assert main([*db, "create", "--name", "ci bot", "--scopes", "batch"]) == 0   # no tenant: a new one
    apart = capsys.readouterr().out
    assert f"tenant:  {tenant}" not in apart and "tenant:  t-" in apart

    assert main([*db, "list", "--tenant", tenant]) == 0
    listing = capsys.readouterr().out
    assert key_id in listing and "ci bot" in listing and "inference,usage" in listing
    assert keys.parse_key(second)[0] in listing
    assert secret not in listing and keys.parse_key(second)[1] not in listing

    assert main(["keys", "revoke", key_id, "--database-url", settings.database_url]) == 0
    assert f"revoked key {key_id} (ci bot, tenant {tenant})" in capsys.readouterr().out
    assert main([*db, "list", "--tenant", tenant, "--active"]) == 0
    assert key_id not in capsys.readouterr().out
    with db_sessionmaker() as session, pytest.raises(keys.InvalidKeyError, match="revoked"):
        keys.authenticate(session, key)

    assert main([*db, "revoke", "ffffffffffff"]) == 1
    assert "no API key with id 'ffffffffffff'" in capsys.readouterr().err
    assert main([*db, "create", "--name", "x", "--scopes", "inference,root"]) == 2
    assert "unknown scope 'root'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*db, "create", "--name", "x", "--scopes", "inference", "--tpm", "0"])
    assert "must be at least 1" in capsys.readouterr().err


def test_keys_cli_refuses_an_unmigrated_database(make_database, capsys):
    url = make_database()
    assert main(["keys", "--database-url", url, "list"]) == 2
    assert f"is not migrated (at revision None, need {HEAD}): run `rein migrate`" in capsys.readouterr().err


def test_keys_create_last_line_in_a_shell(settings, tenant):
    """What a deployment script does: capture the key from the last line of stdout."""
    command = (f"{sys.executable} -m rein.cli.main keys --database-url '{settings.database_url}' "
               f"create --name {tenant} --scopes inference | tail -n 1")
    key = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=True,
                         timeout=60).stdout
    assert keys.parse_key(key) is not None and key.endswith("\n") and key.count("\n") == 1


# --- Redis fixture


def test_redis_client_is_namespaced(redis_client, redis_prefix, settings):
    key = redis_prefix + "probe"
    redis_client.set(key, "1", ex=60)
    assert redis_client.get(key) == b"1"
    assert redis_prefix.startswith("rein_test_") and settings.redis_key_prefix == redis_prefix


# --- held connections (the API committer's statements)


def _backend_pid(held: HeldConnections) -> int:
    return held.execute_all("SELECT pg_backend_pid()", ())[0][0]


def test_held_connection_is_kept_while_busy_and_returned_when_idle(db_engine, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("rein.store.db.time.monotonic", lambda: clock[0])
    held = HeldConnections(db_engine, idle_seconds=1.0)
    first = _backend_pid(held)
    clock[0] += 0.5
    assert _backend_pid(held) == first, "a busy thread keeps its connection"
    assert db_engine.pool.checkedout() == 1
    clock[0] += 5
    _backend_pid(held)   # idle too long: back to the pool (pre-pinged) before this statement
    assert db_engine.pool.checkedout() == 1
    held.close()
    assert db_engine.pool.checkedout() == 0


def test_held_connection_writes_are_committed(db_engine, tenant):
    table = f"held_probe_{tenant.replace('-', '_')}"
    with db_engine.begin() as other:
        other.execute(text(f"CREATE TABLE {table} (x int)"))
    held = HeldConnections(db_engine)
    try:
        assert held.execute_all(f"INSERT INTO {table} VALUES (%s), (%s) RETURNING x", (1, 2)) == [(1,), (2,)]
        with db_engine.connect() as other:   # autocommitted: another connection sees the rows at once
            assert other.execute(text(f"SELECT count(*) FROM {table}")).scalar() == 2
    finally:
        held.close()
        with db_engine.begin() as other:
            other.execute(text(f"DROP TABLE {table}"))


def test_held_connection_is_replaced_after_it_breaks(db_engine):
    held = HeldConnections(db_engine, idle_seconds=3600)
    first = _backend_pid(held)
    with db_engine.connect() as admin:
        admin.execute(text("SELECT pg_terminate_backend(:pid, 5000)"), {"pid": first})   # waits for it
        admin.commit()
    with pytest.raises(OperationalError):
        _backend_pid(held)   # the statement that finds it broken fails...
    second = _backend_pid(held)   # ...and the next one runs on a fresh connection
    assert second != first
    held.close()
    assert db_engine.pool.checkedout() == 0


def test_held_connections_are_per_thread(db_engine):
    held = HeldConnections(db_engine)
    mine = _backend_pid(held)
    with ThreadPoolExecutor(1) as pool:
        theirs = pool.submit(_backend_pid, held).result()
    assert mine != theirs
    assert db_engine.pool.checkedout() == 2
    held.close()
    assert db_engine.pool.checkedout() == 0


def test_a_failed_statement_does_not_carry_its_parameters(db_engine):
    """What a failed INSERT puts in its error, and so in any log line: the statement, never its
    bound values (prompts, other tenants' data)."""
    from rein.store.db import execute_all

    prompt = "a tenant's secret prompt, zebrafinch"
    with pytest.raises(Exception) as failed:
        execute_all(db_engine, "INSERT INTO results (job_id, text, finish_reason, token_ids) "
                               "VALUES (%s, %s, %s, %s::integer[])", ("job_missing", prompt, "stop", "{1099511627776}"))
    assert "INSERT INTO results" in str(failed.value)
    assert "zebrafinch" not in str(failed.value) and "parameters hidden" in str(failed.value)


def test_revoke_with_cancel_work_cancels_what_the_key_started(settings_env, tenant, db_sessionmaker, capsys):
    import redis

    from rein.store.redis_keys import RedisKeys
    from rein.store.tables import Batch

    with db_sessionmaker.begin() as session:
        key = keys.create_key(session, name="leaving", scopes="inference,batch", tenant=tenant).info
        jobs = {status: Job(tenant=tenant, key_id=key.key_id, model="m", endpoint="/v1/completions",
                            params={}, prompt_token_ids=[1], prompt_tokens=1, status=status)
                for status in ("queued", "running", "succeeded")}
        session.add_all(jobs.values())
        batch = Batch(tenant=tenant, key_id=key.key_id, input_file_id="file-x", endpoint="/v1/completions",
                      completion_window="24h", status="in_progress",
                      expires_at=func.now() + func.make_interval(0, 0, 0, 1))
        session.add(batch)
    assert main(["keys", "revoke", key.key_id, "--cancel-work"]) == 0
    assert "cancelled its work: 1 queued jobs, 1 running jobs (stopping within a step), 1 batches" in \
        capsys.readouterr().out
    with db_sessionmaker() as session:
        status = {name: session.get(Job, job.id).status for name, job in jobs.items()}
        assert status == {"queued": "cancelled", "running": "running", "succeeded": "succeeded"}
        assert session.get(Job, jobs["running"].id).cancel_requested_at is not None
        assert session.get(Batch, batch.id).status == "cancelling"
    flag = RedisKeys.from_settings(settings_env).job_cancel(jobs["running"].id)
    assert redis.Redis.from_url(settings_env.redis_url).exists(flag)    # what its worker checks
    with db_sessionmaker.begin() as session:     # no batch manager of a later test should pick it up
        session.get(Batch, batch.id).status = "cancelled"
