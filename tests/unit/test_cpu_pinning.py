"""rein.core.cpu_pinning: the CPU list syntax, and a process's threads moved off the engine's
cores (in a child interpreter, so the test process keeps every core)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from rein.core.cpu_pinning import check_engine_cpus, format_cpus, parse_cpu_list

CORES = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(("text", "cpus"), [("3", {3}), ("0,2-3", {0, 2, 3}), (" 1 , 4-6 ", {1, 4, 5, 6}),
                                            ("2-2", {2})])
def test_cpu_lists(text, cpus):
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(("text", "says"), [("", "'' in '' is not a CPU number"), ("1,,2", "'' in '1,,2'"),
                                            ("3-1", "not a CPU number or an increasing range"),
                                            ("-1", "'-1' in '-1'"), ("a-b", "'a-b' in 'a-b'")])
def test_bad_cpu_lists_say_what_and_the_format(text, says):
    with pytest.raises(ValueError, match=says) as error:
        parse_cpu_list(text)
    assert "a Linux CPU list such as 3, 2-3 or 0,4-7" in str(error.value)


def test_format_cpus_is_the_inverse():
    assert format_cpus({0, 2, 3, 7, 8, 9}) == "0,2-3,7-9"
    assert parse_cpu_list(format_cpus({1, 5, 6})) == {1, 5, 6}
    assert format_cpus([]) == ""


def test_a_core_the_worker_cannot_use_is_refused():
    check_engine_cpus(frozenset(CORES[:1]))
    with pytest.raises(RuntimeError, match=rf"CPU\(s\) {CORES[-1] + 1000}, which this worker cannot run on"):
        check_engine_cpus(frozenset({CORES[-1] + 1000}))


@pytest.mark.skipif(len(CORES) < 2, reason="needs two cores")
def test_the_worker_keeps_every_thread_off_the_engine_cores():
    engine, rest = CORES[-1], CORES[:-1]
    script = textwrap.dedent(f"""
        import json, os, threading
        from rein.core.cpu_pinning import keep_worker_off
        started = threading.Event()
        before = threading.Thread(target=started.wait, daemon=True)   # a thread already running
        before.start()
        kept = keep_worker_off(frozenset({{{engine}}}))
        after = threading.Thread(target=started.wait, daemon=True)    # one started afterwards
        after.start()
        masks = {{task: sorted(os.sched_getaffinity(int(task))) for task in os.listdir("/proc/self/task")}}
        started.set()
        print(json.dumps({{"kept": sorted(kept), "masks": list(masks.values())}}))
    """)
    answer = json.loads(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                       check=True).stdout)
    assert answer["kept"] == rest
    assert len(answer["masks"]) == 3 and all(mask == rest for mask in answer["masks"])


def test_an_engine_on_every_core_leaves_the_worker_where_it_is():
    script = textwrap.dedent("""
        import json, os
        from rein.core.cpu_pinning import keep_worker_off
        kept = keep_worker_off(frozenset(os.sched_getaffinity(0)))
        print(json.dumps([sorted(kept), sorted(os.sched_getaffinity(0))]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [[], CORES]
