"""`rein worker --devices`: reading the device list, planning the engines, each engine's worker
command line, and the supervisor's start / restart / give-up / stop rules on stand-in children
(small Python scripts; the real workers are tests/integration/test_worker_devices.py's)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import replace

import pytest

from rein.cli.engine_flags import CLIError
from rein.cli.main import build_parser, main
from rein.cli.worker import (
    engine_metrics_ports,
    engine_node_names,
    engine_worker_argv,
    served_model_for,
    worker_settings,
)
from rein.core.settings import Settings
from rein.worker.supervisor import Child, EngineGroup, Supervisor, parse_devices, plan_engines

pytestmark = pytest.mark.usefixtures("clean_rein_env")


@pytest.mark.parametrize(("text", "devices"), [
    ("0,1,2,3", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
    ("0-3", ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
    ("0-1, 4,cuda:6-7", ("cuda:0", "cuda:1", "cuda:4", "cuda:6", "cuda:7")),
    ("CUDA:2", ("cuda:2",)),
    ("cpu,cpu", ("cpu", "cpu")),
    ("cpu:0,cpu:1,cpu:2", ("cpu", "cpu", "cpu")),
])
def test_devices_are_read_as_engine_devices(text, devices):
    assert parse_devices(text) == devices


@pytest.mark.parametrize(("text", "message"), [
    ("", "comma-separated list"),
    ("0,,1", "comma-separated list"),
    ("gpu0", "'gpu0' is not a device"),
    ("0-x", "'0-x' is not a device"),
    ("3-1", "runs backwards; write 1-3"),
    ("0,cpu", "mixes CPU and CUDA"),
    ("0-2,cuda:1", "names cuda:1 more than once"),
])
def test_bad_devices_are_refused_saying_why(text, message):
    with pytest.raises(ValueError, match=message):
        parse_devices(text)


def test_engines_are_planned_per_device_or_by_count():
    assert plan_engines(("cuda:0", "cuda:1"), None, 1, "auto") == [EngineGroup(("cuda:0",), 0),
                                                                   EngineGroup(("cuda:1",), 1)]
    assert [g.device for g in plan_engines(None, 3, 1, "cuda")] == ["cuda:0", "cuda:1", "cuda:2"]
    cpus = plan_engines(None, 2, 1, "cpu")
    assert [(g.device, g.label) for g in cpus] == [("cpu", "cpu0"), ("cpu", "cpu1")]
    assert plan_engines(("cuda:3",), 1, 1, "cpu")[0].label == "cuda3"
    # Tensor parallelism: engines of N consecutive devices, rank 0's the engine's --device.
    pairs = plan_engines(tuple(f"cuda:{i}" for i in range(8)), None, 2, "auto")
    assert [(g.devices, g.device) for g in pairs] == [((f"cuda:{i}", f"cuda:{i + 1}"), f"cuda:{i}")
                                                      for i in range(0, 8, 2)]
    assert [g.devices for g in plan_engines(None, 2, 2, "cpu")] == [("cpu", "cpu"), ("cpu", "cpu")]
    for args, message in (((("cuda:0",), 2, 1, "auto"), "need 2 devices; --devices names 1"),
                          ((None, 2, 1, "cuda:1"), "name the GPUs with --devices"),
                          ((None, 0, 1, "cpu"), "at least 1"),
                          ((None, None, 1, "cpu"), "give --devices or --data-parallel-size"),
                          ((("cuda:0", "cuda:2"), None, 2, "auto"), "must be consecutive indices"),
                          ((("cuda:0", "cuda:1", "cuda:2"), None, 2, "auto"), "do not split into engines of 2"),
                          ((("cuda:0",), None, 0, "auto"), "at least 1")):
        with pytest.raises(ValueError, match=message):
            plan_engines(*args)


@pytest.fixture
def settings(monkeypatch) -> Settings:
    monkeypatch.setenv("REIN_MODELS", "llama=/models/llama@4096")
    monkeypatch.setenv("REIN_WORKER_METRICS_PORT", "9100")
    return Settings()


def test_each_engine_worker_runs_this_command_on_its_own_device(settings):
    parser = build_parser()
    args = parser.parse_args(["-v", "worker", "--devices", "0-1", "-c", "6", "-n", "box", "--kv-cache-memory",
                              "2GiB", "--no-enable-prefix-caching", "--enforce-eager", "-l", "debug"])
    served = served_model_for(args, settings)
    groups = plan_engines(parse_devices(args.devices), None, 1, "auto")
    names = engine_node_names(args.hostname, served.name, groups)
    assert names == ["llama-cuda0@box", "llama-cuda1@box"]
    ports = engine_metrics_ports(settings.worker_metrics_port, len(groups))
    assert ports == [9100, 9101] and engine_metrics_ports(None, 2) == [0, 0]
    argv = engine_worker_argv(args, served, groups[1], names[1], ports[1])
    assert argv[:4] == [sys.executable, "-P", "-m", "rein.cli.main"]   # -P: the working directory is not on sys.path
    child = parser.parse_args(argv[4:])
    assert child.verbose and child.devices is None and child.data_parallel_size is None
    assert (child.model, child.hostname, child.loglevel, child.metrics_port) == ("llama", "llama-cuda1@box", "debug",
                                                                                 9101)
    resolved = worker_settings(child, settings, served)
    assert resolved.device == "cuda:1" and resolved.max_num_seqs == 6 and resolved.kv_cache_memory == "2GiB"
    assert resolved.enable_prefix_caching is False and resolved.enforce_eager is True
    with pytest.raises(CLIError, match="past 65535"):
        engine_metrics_ports(65535, 2)


def test_a_tensor_parallel_engine_worker_gets_its_first_device_and_the_size(settings):
    parser = build_parser()
    args = parser.parse_args(["worker", "--devices", "4-7", "--tensor-parallel-size", "2", "-n", "box"])
    served = served_model_for(args, settings)
    groups = plan_engines(parse_devices(args.devices), None, 2, "auto")
    assert [g.devices for g in groups] == [("cuda:4", "cuda:5"), ("cuda:6", "cuda:7")]
    names = engine_node_names(args.hostname, served.name, groups)
    assert names == ["llama-cuda4@box", "llama-cuda6@box"]
    child = parser.parse_args(engine_worker_argv(args, served, groups[1], names[1], 0)[4:])
    # Rank 0 on cuda:6; rein.engine.rank_processes puts rank 1 on cuda:7.
    resolved = worker_settings(child, settings, served)
    assert (resolved.device, resolved.tensor_parallel_size) == ("cuda:6", 2)
    assert child.devices is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--devices", "0,0"], "names cuda:0 more than once"),
    (["--devices", "cpu,cpu", "--device", "cpu"], "give --devices alone"),
    (["--devices", "0,2", "--tensor-parallel-size", "2"], "must be consecutive indices"),
    (["--data-parallel-size", "2", "--device", "cuda:1"], "name the GPUs with --devices"),
])
def test_the_worker_command_refuses_what_cannot_run(argv, message, settings, capsys):
    assert main(["worker", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_device_it_cannot_use_is_named_before_any_worker_starts(settings, monkeypatch, capsys):
    from rein.worker import device_check

    facts = device_check.CudaFacts(torch_version="2.x", cuda_version="12.8", device_count=2, visible_devices=None)
    monkeypatch.setattr(device_check, "cuda_facts", lambda: facts)
    assert main(["worker", "--devices", "0-2"]) == 2
    assert "device cuda:2: only 2 GPU(s) are visible" in capsys.readouterr().err


# -- the supervisor, on stand-in children ---------------------------------------------------------


def script_child(tmp_path, position: int, code: str) -> Child:
    """A child running `code` (with `marker`, a file of its own, and `os`, `sys`, `time`)."""
    marker = tmp_path / f"child{position}"
    source = f"import os, sys, time\nmarker = {str(marker)!r}\n{code}"
    return Child(EngineGroup(("cpu",), position), f"m-cpu{position}@test", [sys.executable, "-c", source])


SLEEPER = "open(marker, 'a').write('started\\n')\ntime.sleep(60)"
# Dies at its first start, lives at its second.
DIES_ONCE = ("starts = open(marker, 'a+').tell() // 8\nopen(marker, 'a').write('started\\n')\n"
             "sys.exit(1) if starts == 0 else time.sleep(60)")


def starts(tmp_path, position: int) -> int:
    marker = tmp_path / f"child{position}"
    return marker.read_text().count("started") if marker.exists() else 0


def signal_when(predicate, signum=signal.SIGTERM, timeout: float = 30.0) -> threading.Thread:
    """Send `signum` to this process (the supervisor runs in the test's main thread) once `predicate`."""
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signum)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_a_child_that_dies_is_started_again_and_sigterm_stops_all(tmp_path):
    children = [script_child(tmp_path, 0, SLEEPER), script_child(tmp_path, 1, DIES_ONCE)]
    supervisor = Supervisor(children, first_backoff_seconds=0.05)
    watcher = signal_when(lambda: starts(tmp_path, 0) == 1 and starts(tmp_path, 1) == 2)
    assert supervisor.run() == 0
    watcher.join()
    assert starts(tmp_path, 0) == 1 and starts(tmp_path, 1) == 2
    assert all(child.process is None for child in children)


def test_a_child_that_refuses_to_start_stops_the_others(tmp_path, caplog):
    children = [script_child(tmp_path, 0, SLEEPER), script_child(tmp_path, 1, "sys.exit(2)")]
    with caplog.at_level("ERROR", logger="rein.worker.supervisor"):
        assert Supervisor(children).run() == 2
    assert "worker m-cpu1@test (device cpu) refused to start (exit code 2" in caplog.text
    assert all(child.process is None for child in children)


def test_a_child_that_keeps_dying_young_is_given_up(tmp_path, caplog):
    children = [script_child(tmp_path, 0, SLEEPER),
                script_child(tmp_path, 1, "open(marker, 'a').write('started\\n')\nsys.exit(1)")]
    with caplog.at_level("ERROR", logger="rein.worker.supervisor"):
        assert Supervisor(children, max_quick_deaths=3, first_backoff_seconds=0.01).run() == 1
    assert starts(tmp_path, 1) == 3
    assert "died 3 times in a row" in caplog.text and "(device cpu)" in caplog.text


def test_devices_all_is_every_gpu_this_process_sees(settings, monkeypatch, capsys):
    from rein.worker import device_check, supervisor

    facts = device_check.CudaFacts(torch_version="2.x", cuda_version="12.8", device_count=3, visible_devices=None)
    monkeypatch.setattr(device_check, "cuda_facts", lambda: facts)
    planned = []
    monkeypatch.setattr(supervisor.Supervisor, "run", lambda self: planned.extend(self.children) or 0)
    assert main(["worker", "--devices", "all"]) == 0
    assert [child.group.device for child in planned] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [child.argv[child.argv.index("--metrics-port") + 1] for child in planned] == ["9100", "9101", "9102"]
    monkeypatch.setattr(device_check, "cuda_facts", lambda: replace(facts, device_count=0))
    assert main(["worker", "--devices", "all"]) == 2
    assert "--devices all: device cuda: torch 2.x (CUDA 12.8) sees no GPU" in capsys.readouterr().err
