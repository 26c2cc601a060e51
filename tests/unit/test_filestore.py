"""LocalFileStore: atomic writes, the size limit, ids that cannot name a path."""

from __future__ import annotations

import pytest

from rein.store.filestore import FileTooLargeError, LocalFileStore


def test_save_open_size_delete(tmp_path):
    store = LocalFileStore(tmp_path / "files")
    assert store.save("file-abc", [b"one\n", b"two\n"]) == 8
    with store.open("file-abc") as f:
        assert f.read() == b"one\ntwo\n"
    assert store.size("file-abc") == 8
    store.delete("file-abc")
    store.delete("file-abc")     # already gone: no error
    with pytest.raises(FileNotFoundError):
        store.open("file-abc")


def test_too_large_leaves_nothing(tmp_path):
    store = LocalFileStore(tmp_path)
    with pytest.raises(FileTooLargeError, match="limit of 5 bytes"):
        store.save("file-big", [b"abc", b"def"], max_bytes=5)
    assert list(tmp_path.iterdir()) == []


def test_writer_is_atomic(tmp_path):
    store = LocalFileStore(tmp_path)
    with store.writer("file-out") as out:
        out.write("first\n")
    with pytest.raises(RuntimeError), store.writer("file-out") as out:
        out.write("half")
        raise RuntimeError("crash mid-write")
    with store.open("file-out") as f:
        assert f.read() == b"first\n"     # the old contents, no partial file
    assert [p.name for p in tmp_path.iterdir()] == ["file-out"]


@pytest.mark.parametrize("bad", ["../etc/passwd", "a/b", "", "x" * 200, "file-1.jsonl"])
def test_ids_cannot_name_paths(tmp_path, bad):
    with pytest.raises(ValueError, match="not a file id"):
        LocalFileStore(tmp_path).path(bad)


def test_new_file_is_stored_only_when_committed(tmp_path):
    store = LocalFileStore(tmp_path)
    new = store.create("file-new")
    new.write(b"one\n")
    new.write(b"two\n")
    assert new.size == 8 and not store.path("file-new").exists()
    assert new.commit() == 8
    new.discard()                        # after commit: nothing to drop
    assert store.size("file-new") == 8
    dropped = store.create("file-dropped")
    dropped.write(b"partial")
    dropped.discard()
    dropped.discard()                    # twice: no error
    assert [p.name for p in tmp_path.iterdir()] == ["file-new"]
