"""Stored images (rein.jobs.image_sources) on real Postgres: each use recorded once per image, and
the retention sweep (rein.jobs.retention) deleting an image nobody named for
REIN_IMAGE_RETENTION_SECONDS, but never one a queued or running job names."""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta

from PIL import Image
from sqlalchemy import select, update

from rein.core.images import ImageInput
from rein.jobs.image_sources import image_file_id, image_refs_of, store_images
from rein.jobs.retention import expire_once
from rein.store.filestore import LocalFileStore
from rein.store.tables import Job, StoredImage


def image(color) -> ImageInput:
    out = io.BytesIO()
    Image.new("RGB", (3, 3), color).save(out, "PNG")
    return ImageInput.of(out.getvalue())


def age(sessions, images, days: float) -> None:
    with sessions.begin() as session:
        session.execute(update(StoredImage).where(StoredImage.sha256.in_([i.sha256 for i in images]))
                        .values(last_used_at=datetime.now(UTC) - timedelta(days=days)))


def rows(sessions, images) -> set[str]:
    with sessions() as session:
        return set(session.scalars(select(StoredImage.sha256).where(
            StoredImage.sha256.in_([i.sha256 for i in images]))))


def test_unused_images_expire_and_a_waiting_jobs_image_stays(db_sessionmaker, make_settings, make_job, tmp_path):
    store = LocalFileStore(tmp_path / "files")
    needed, unused, recent = image((1, 0, 0)), image((0, 1, 0)), image((0, 0, 1))
    store_images(store, [needed, unused, needed], db_sessionmaker)     # the same image twice: one row
    store_images(store, [recent], db_sessionmaker)
    assert rows(db_sessionmaker, [needed, unused, recent]) == {needed.sha256, unused.sha256, recent.sha256}
    job_id = make_job().job_id
    with db_sessionmaker.begin() as session:
        job = session.get(Job, job_id)
        job.params = {**job.params, "images": image_refs_of([needed])}
    age(db_sessionmaker, [needed, unused], days=8)
    settings = make_settings(image_retention_seconds=7 * 86400)

    report = expire_once(settings, db_sessionmaker, store)
    assert report.images >= 1
    assert rows(db_sessionmaker, [needed, unused, recent]) == {needed.sha256, recent.sha256}
    assert not (tmp_path / "files" / image_file_id(unused.sha256)).exists()
    assert (tmp_path / "files" / image_file_id(needed.sha256)).exists()   # its job has not run yet

    with db_sessionmaker.begin() as session:
        session.get(Job, job_id).status = "succeeded"
    expire_once(settings, db_sessionmaker, store)
    assert rows(db_sessionmaker, [needed, unused, recent]) == {recent.sha256}
    assert not (tmp_path / "files" / image_file_id(needed.sha256)).exists()

    # sent again: stored again
    store_images(store, [unused], db_sessionmaker)
    assert (tmp_path / "files" / image_file_id(unused.sha256)).read_bytes() == unused.data
    assert rows(db_sessionmaker, [unused]) == {unused.sha256}


def test_a_use_renews_an_image(db_sessionmaker, make_settings, tmp_path):
    store = LocalFileStore(tmp_path / "files")
    renewed = image((5, 5, 5))
    store_images(store, [renewed], db_sessionmaker)
    age(db_sessionmaker, [renewed], days=8)
    store_images(store, [renewed], db_sessionmaker)       # named again by a request
    expire_once(make_settings(image_retention_seconds=7 * 86400), db_sessionmaker, store)
    assert rows(db_sessionmaker, [renewed]) == {renewed.sha256}
    expire_once(make_settings(image_retention_seconds=0), db_sessionmaker, store)   # 0: kept
    assert (tmp_path / "files" / image_file_id(renewed.sha256)).exists()
