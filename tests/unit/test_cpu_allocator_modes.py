"""glibc's malloc settings around a load (rein.model.cpu_allocator): fixed 128 KiB thresholds
while a model or tokenizer loads, so its one-off buffers are unmapped when freed, then the
step's 1 GiB heap reuse -- again after every load, not only the process's first."""

from __future__ import annotations

import pytest

from rein.model import cpu_allocator as allocator


@pytest.fixture
def calls(monkeypatch):
    made: list[tuple[int, int]] = []

    def mallopt(param, value):
        made.append((param, value))
        return 1

    monkeypatch.setattr(allocator, "_mallopt", lambda: mallopt)
    monkeypatch.setattr(allocator, "_mode", "default")
    return made


def test_a_load_fixes_the_thresholds_and_the_engine_then_keeps_freed_memory(calls):
    assert allocator.return_freed_memory()
    assert calls == [(allocator.M_MMAP_THRESHOLD, 128 << 10), (allocator.M_TRIM_THRESHOLD, 128 << 10)]
    calls.clear()
    assert allocator.keep_freed_memory() and allocator.keep_freed_memory()
    assert calls == [(allocator.M_MMAP_THRESHOLD, 1 << 30), (allocator.M_TRIM_THRESHOLD, 1 << 30)]   # once


def test_a_second_load_gets_the_steps_settings_back_afterwards(calls):
    allocator.keep_freed_memory()
    allocator.return_freed_memory()
    calls.clear()
    assert allocator.keep_freed_memory()
    assert calls == [(allocator.M_MMAP_THRESHOLD, 1 << 30), (allocator.M_TRIM_THRESHOLD, 1 << 30)]


def test_disabled_or_not_glibc_changes_nothing(monkeypatch):
    monkeypatch.setattr(allocator, "_mallopt", lambda: None)
    monkeypatch.setattr(allocator, "_mode", "default")
    assert not allocator.return_freed_memory() and not allocator.keep_freed_memory()
