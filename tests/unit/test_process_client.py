"""The engine in a child process (rein.engine.process_client): the same outputs and errors as
the in-thread runner, aborts and groups across the pipe, and no engine left behind when
either side dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rein.engine.client import EngineClient, EngineStoppedError
from rein.engine.config import EngineConfig
from rein.engine.engine import LLMEngine
from rein.engine.errors import ContextLengthExceeded
from rein.engine.process_client import ProcessEngineClient
from rein.engine.sampling_params import SamplingParams
from rein.openai.engine_errors import job_error_code

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], list(range(10, 40)), [8] * 20]


def config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=4)


@pytest.fixture(scope="module")
def runner(model_dir):
    runner = ProcessEngineClient(config(model_dir), name="test-engine").start()
    yield runner
    runner.stop()


def wait_for(check, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0) until it is reaped; it runs nothing any more.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] == "Z"


def test_outputs_equal_the_in_thread_runner(runner, model_dir):
    streams = [runner.submit(f"p{i}", prompt, GREEDY, collect=(i % 2 == 0)) for i, prompt in enumerate(PROMPTS)]
    here = {}
    for i, stream in enumerate(streams):
        if i % 2 == 0:
            assert stream.wait(30)
            here[i] = (stream.collected.token_ids, stream.collected.text, stream.collected.final.finish_reason)
        else:
            outputs = list(stream)
            here[i] = ([t for o in outputs for t in o.new_token_ids], "".join(o.text_delta for o in outputs),
                       outputs[-1].finish_reason)
    with EngineClient(LLMEngine(config(model_dir))) as local:
        for i, prompt in enumerate(PROMPTS):
            stream = local.submit(f"p{i}", prompt, GREEDY, collect=True)
            assert stream.wait(30)
            assert here[i] == (stream.collected.token_ids, stream.collected.text, "length"), i
    # The parent's view of the child's engine follows its steps.
    assert runner.engine.stats.steps > 0 and runner.engine.stats.generation_tokens >= 12 * len(PROMPTS)
    wait_for(lambda: runner.engine.num_running == 0 and runner.engine.pool.usage == 0.0)
    assert runner.engine.max_model_len == 128 and runner.engine.tokenizer.decode([5, 6])


def test_a_refused_request_raises_the_engine_error_in_the_caller(runner):
    with pytest.raises(ContextLengthExceeded) as refused:
        runner.submit("too-long", [1] * 200, GREEDY)
    assert refused.value.param == "max_tokens" and refused.value.max_model_len == 128
    assert "maximum context length is 128 tokens" in str(refused.value)
    assert job_error_code(refused.value) == "context_length_exceeded"   # its fields crossed the pipe too
    assert runner.alive      # the engine goes on


def test_abort_and_groups_cross_the_pipe(runner):
    params = SamplingParams(max_tokens=100, ignore_eos=True)
    long = runner.submit("long", [1, 2, 3], params, collect=True)
    runner.abort("long")
    assert long.wait(30) and long.collected.final.finish_reason == "abort"
    group = runner.submit_group("grp", [[1, 2], [3, 4], [5, 6]], params)
    runner.abort("grp")
    assert all(stream.wait(30) for stream in group)
    assert {stream.collected.final.finish_reason for stream in group} == {"abort"}
    with pytest.raises(ContextLengthExceeded) as refused:
        runner.submit_group("bad", [[1, 2], [1] * 200], GREEDY)
    assert refused.value.index == 1
    wait_for(lambda: runner.engine.pool.usage == 0.0)


def test_a_dead_engine_process_ends_the_streams(model_dir):
    long_context = EngineConfig(model=str(model_dir), device="cpu", max_model_len=2048)
    runner = ProcessEngineClient(long_context).start()
    stream = runner.submit("x", [1, 2, 3], SamplingParams(max_tokens=2000, ignore_eos=True))   # seconds
    os.kill(runner.pid, signal.SIGKILL)
    with pytest.raises(EngineStoppedError, match="engine process exited"):
        while not stream.get(timeout=30).finished:
            pass
    wait_for(lambda: not runner.alive)
    with pytest.raises(EngineStoppedError):
        runner.submit("y", [1, 2], GREEDY)
    runner.stop()


def test_stop_ends_the_child_and_its_open_streams(model_dir):
    runner = ProcessEngineClient(config(model_dir)).start()
    stream = runner.submit("x", [1, 2, 3], SamplingParams(max_tokens=120, ignore_eos=True), collect=True)
    pid = runner.pid
    runner.stop()
    assert not runner.alive and process_gone(pid)
    assert stream.wait(5) and stream.collected.final.finish_reason == "abort"
    with pytest.raises(EngineStoppedError):
        runner.submit("y", [1, 2], GREEDY)


@pytest.mark.parametrize("made_on", ["main thread", "short-lived thread"])
def test_the_child_dies_with_a_killed_parent(model_dir, made_on):
    """A SIGKILLed worker leaves no engine process behind: PR_SET_PDEATHSIG for a runner made
    on the main thread, the closed pipe alone otherwise (and the thread's end is no death)."""
    script = textwrap.dedent(f"""
        import threading, time
        from rein.engine.config import EngineConfig
        from rein.engine.process_client import ProcessEngineClient
        from rein.engine.sampling_params import SamplingParams
        if __name__ == "__main__":
            made = []
            make = lambda: made.append(ProcessEngineClient(EngineConfig(model={str(model_dir)!r}, device="cpu")))
            if {made_on == "main thread"}:
                make()
            else:
                thread = threading.Thread(target=make)
                thread.start()
                thread.join()
            runner = made[0].start()
            time.sleep(0.5)
            stream = runner.submit("x", [1, 2], SamplingParams(max_tokens=4), collect=True)
            assert stream.wait(30)
            print(runner.pid, flush=True)
            time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not process_gone(child)
        parent.kill()
        parent.wait(10)
        wait_for(lambda: process_gone(child), 10)
    finally:
        parent.kill()


def test_a_model_that_cannot_load_fails_the_constructor(tmp_path):
    with pytest.raises(RuntimeError, match="engine could not start"):
        ProcessEngineClient(EngineConfig(model=str(tmp_path / "missing"), device="cpu"), start_timeout=120)


def test_the_child_keeps_to_the_cores_it_is_given(runner, model_dir):
    """REIN_WORKER_ENGINE_CPUS: every thread of the engine process (torch's included, started
    by the first step) on the named core, with the same outputs."""
    core = max(os.sched_getaffinity(0))
    pinned = ProcessEngineClient(config(model_dir), cpus=frozenset({core})).start()
    try:
        streams = [client.submit(f"pin-{i}", PROMPTS[2], GREEDY, collect=True) for i, client in enumerate([runner, pinned])]
        assert all(stream.wait(30) for stream in streams)
        assert streams[1].collected.token_ids == streams[0].collected.token_ids
        assert len(streams[1].collected.token_ids) == GREEDY.max_tokens
        tasks = os.listdir(f"/proc/{pinned.pid}/task")
        assert tasks and all(os.sched_getaffinity(int(task)) == {core} for task in tasks)
    finally:
        pinned.stop()


def test_a_module_planted_in_the_working_directory_is_not_imported(model_dir, tmp_path, monkeypatch):
    """The child starts as `python -c ...`, which would put the working directory first on
    sys.path: a pickle.py there ran before any rein code. The child starts with PYTHONSAFEPATH."""
    marker = tmp_path / "planted-module-ran"
    (tmp_path / "pickle.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('planted')\n")
    monkeypatch.chdir(tmp_path)
    runner = ProcessEngineClient(config(model_dir), name="test-planted").start()
    try:
        stream = runner.submit("planted", [1, 2, 3], GREEDY, collect=True)
        assert stream.wait(60)
    finally:
        runner.stop()
    assert not marker.exists()
    assert "PYTHONSAFEPATH" not in os.environ   # set for the child's start only
