"""`rein worker [--model NAME] [--devices LIST]`: a Celery worker serving one model from its queue.

NAME is a served model (REIN_MODELS); without --model, the first one. The worker uses
the threads pool with one thread per engine sequence (--max-num-seqs / REIN_MAX_NUM_SEQS,
or Celery's -c/--concurrency, which sets both), loads the engine once, and refuses to start
when the database is not migrated. SIGTERM (or Ctrl-C) is a warm shutdown that hands running
jobs back to the queue and exits within seconds.

Engine flags are rein.engine.options' (flag > REIN_* > default), except
--generation-config: the API applies a model's sampling defaults when it parses a request
(REIN_GENERATION_CONFIG), so the worker only logs them. Celery habits: -c, -n (`%h` is
the host; a value without `@` is the host part, after the model's name), -l (any case),
and -Q naming the one queue a rein worker consumes, its model's: `-Q llama` (or the full
queue name) is `--model llama`.

Several engines on one host: `--devices 0,1,2,3` (ranges `0-7`; `all` GPUs; `cpu,cpu` for CPU engines) or
`--data-parallel-size N` makes this process a supervisor (rein.worker.supervisor) of one worker
process per engine, each this command on its own device with the node name MODEL-cuda0@HOST
(MODEL-cpu0@HOST, ...) and metrics port PORT + its position. With `--tensor-parallel-size N`
an engine is N consecutive devices (`--devices 0-7 --tensor-parallel-size 2`: four engines);
a lone worker with it runs one engine of N ranks (rein.engine.rank_processes).
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from rein.cli.engine_flags import CLIError, add_engine_options
from rein.core.settings import SettingsError, get_settings
from rein.engine.generation_defaults import load_generation_defaults
from rein.engine.options import options_for, resolve_engine_values
from rein.model.files import resolve_model
from rein.store.redis_keys import RedisKeys
from rein.worker.device_check import device_problem

if TYPE_CHECKING:
    from rein.core.settings import ServedModel, Settings
    from rein.engine.config import EngineConfig
    from rein.worker.supervisor import EngineGroup

log = logging.getLogger("rein.worker")

LOG_LEVELS = ("debug", "info", "warning", "error", "critical", "fatal")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("worker", help="run a worker for one served model",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, metavar="NAME",
                        help="a model name from REIN_MODELS (default: the first)")
    parser.add_argument("-Q", "--queues", default=None, metavar="QUEUE",
                        help="the queue to consume: a rein worker consumes its model's queue alone, so this "
                             "names the model (NAME, or its queue's full name); the same as --model")
    parser.add_argument("-c", "--concurrency", type=int, default=None, metavar="N",
                        help="jobs run at once, and the engine's max sequences: --max-num-seqs under Celery's name")
    parser.add_argument("-l", "--loglevel", default="info", type=str.lower, choices=LOG_LEVELS,
                        help="worker log level, any case (default info)")
    parser.add_argument("-n", "--hostname", default=None, metavar="NAME",
                        help="worker node name NAME@HOST, as Celery's (%%h: this host); a value without @ is "
                             "the host part: MODEL@value (default MODEL@%%h)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                        help="serve Prometheus metrics on PORT at /metrics; 0: none "
                             "(default: REIN_WORKER_METRICS_PORT, unset: none)")
    parser.add_argument("--devices", default=None, metavar="LIST",
                        help="one engine per device, each in a worker process of its own under this one: CUDA "
                             "indices (0,1,2,3; ranges 0-7; cuda:N), all (every GPU this process sees) or cpu "
                             "entries (cpu,cpu: two CPU engines)")
    parser.add_argument("--data-parallel-size", type=int, default=None, metavar="N",
                        help="engines to run: one per --devices entry, or without --devices on cuda:0 to "
                             "cuda:N-1 (N CPU engines with --device cpu)")
    add_engine_options(parser, "worker")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # SQLAlchemy, Celery and torch (the engine) load only when a worker starts, not with every command.
    from rein.store.db import StoreError, check_migrations_current, make_engine

    try:
        environment = get_settings()
        served = served_model_for(args, environment)
        settings = worker_settings(args, environment, served)
    except (SettingsError, CLIError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        if not 0 <= args.metrics_port <= 65535:
            print(f"error: --metrics-port must be 0 (none) to 65535, got {args.metrics_port}", file=sys.stderr)
            return 2
        settings = settings.model_copy(update={"worker_metrics_port": args.metrics_port})
    if args.devices is not None or args.data_parallel_size is not None:
        return supervise_engines(args, environment, served, settings)
    # A GPU it cannot use would fail deep in the engine's load, without saying why (and under
    # a restart policy, again and again): refuse before connecting to anything. A
    # tensor-parallel engine's ranks use the devices after --device too. (The import brings
    # torch, which checking a CUDA device imports anyway.)
    from rein.engine.rank_processes import rank_device

    size = settings.tensor_parallel_size
    for device in [rank_device(settings.device, rank) for rank in range(size)] if size > 1 else [settings.device]:
        if (problem := device_problem(device)) is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2

    db = make_engine(settings.database_url)
    try:
        check_migrations_current(db)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        db.dispose()

    from rein.jobs.queues import queued_slots, worker_queues
    from rein.worker.app import make_worker_celery
    from rein.worker.bootstep import EngineThreadPool, configure_worker
    from rein.worker.context import WorkerSpec

    try:
        # The bootstep loads the engine; a model that cannot be found fails here, in one line.
        files = resolve_model(served.source, revision=settings.revision)
        config = worker_engine_config(settings, served)
        # The API applies these when it parses a request (the job's params are fixed at intake);
        # logged here too, so a worker's log says what its jobs were sampled with.
        defaults = load_generation_defaults(files.directory, settings.generation_config)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = make_worker_celery(settings)
    _keep_rein_logging(app, args.loglevel)
    log.info("generation defaults for model %s (applied by the API at intake): %s", served.name,
             defaults.describe())
    _warn_if_context_differs(args, environment, served)
    _warn_if_tokenizer_differs(args, environment)
    configure_worker(app, WorkerSpec(settings=settings, model_name=served.name, engine_config=config))
    worker = app.Worker(
        hostname=worker_hostname(args.hostname, served.name),
        queues=worker_queues(settings, served.name),
        pool_cls=EngineThreadPool,
        concurrency=settings.max_num_seqs + queued_slots(settings),
        loglevel=args.loglevel.upper(),
        without_gossip=True,
        without_mingle=True,
        optimization="fair",
    )
    worker.start()
    return int(worker.exitcode or 0)


def supervise_engines(args: argparse.Namespace, environment: Settings, served: ServedModel,
                      settings: Settings) -> int:
    """Run one worker process per engine group under a supervisor (rein.worker.supervisor)."""
    from rein.worker.supervisor import Child, Supervisor, parse_devices, plan_engines

    if args.devices is not None and args.device is not None:
        print(f"error: --device {args.device} and --devices {args.devices}: give --devices alone", file=sys.stderr)
        return 2
    from rein.worker.device_check import cuda_facts

    try:
        if args.devices is not None and args.devices.strip().lower() == "all":
            if (problem := device_problem("cuda")) is not None:
                print(f"error: --devices all: {problem}", file=sys.stderr)
                return 2
            devices: tuple[str, ...] | None = tuple(f"cuda:{i}" for i in range(cuda_facts().device_count))
        else:
            devices = parse_devices(args.devices) if args.devices is not None else None
        device = settings.device
        if devices is None and device == "auto":
            device = "cuda" if cuda_facts().device_count else "cpu"
        groups = plan_engines(devices, args.data_parallel_size, settings.tensor_parallel_size, device)
        children = [Child(group, name, engine_worker_argv(args, served, group, name, port))
                    for group, name, port in zip(groups, engine_node_names(args.hostname, served.name, groups),
                                                 engine_metrics_ports(settings.worker_metrics_port, len(groups)),
                                                 strict=True)]
    except (ValueError, CLIError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # Every device is checked before any worker starts: one bad index stops the command at once,
    # naming the device, rather than after the others have loaded their engines.
    for group in groups:
        for device in group.devices:
            if (problem := device_problem(device)) is not None:
                print(f"error: {problem}", file=sys.stderr)
                return 2
    logging.getLogger().setLevel(args.loglevel.upper())
    _warn_if_context_differs(args, environment, served)
    _warn_if_tokenizer_differs(args, environment)
    log.info("model %s: %d engines (%s), one worker process each", served.name, len(children),
             ", ".join(f"{child.name} on {'+'.join(child.group.devices)}" for child in children))
    return Supervisor(children).run()


def engine_node_names(given: str | None, model_name: str, groups: list[EngineGroup]) -> list[str]:
    """Each engine's Celery node name: the worker's (worker_hostname) with the engine's label
    after the name part, e.g. llama-cuda0@host."""
    name, _, host = worker_hostname(given, model_name).partition("@")
    return [f"{name}-{group.label}@{host}" for group in groups]


def engine_metrics_ports(port: int | None, count: int) -> list[int]:
    """Each engine's metrics port: PORT, PORT + 1, ...; 0 (none) for all without one."""
    if not port:
        return [0] * count
    if port + count - 1 > 65535:
        raise CLIError(f"metrics port {port}: {count} engines serve metrics on {port} to {port + count - 1}, "
                       f"past 65535; choose a lower port")
    return [port + position for position in range(count)]


def engine_worker_argv(args: argparse.Namespace, served: ServedModel, group: EngineGroup, name: str,
                       metrics_port: int) -> list[str]:
    """The command line of one engine's worker: this one's engine flags, its own device, node
    name and metrics port (the supervisor's flags left out)."""
    argv = [sys.executable, "-P", "-m", "rein.cli.main", *(["-v"] if getattr(args, "verbose", False) else []),
            "worker", "--model", served.name, "--hostname", name, "--loglevel", args.loglevel,
            "--metrics-port", str(metrics_port), "--device", group.device]
    for option in options_for("worker"):
        # -c is --max-num-seqs under Celery's name (worker_settings checked that both agree).
        value = args.concurrency if option.name == "max_num_seqs" and args.concurrency else getattr(args, option.name)
        if option.name == "device" or value is None:
            continue
        if option.boolean:
            argv.append(option.flag if value else "--no-" + option.flag.removeprefix("--"))
        else:
            argv += [option.flag, str(value)]
    return argv


def served_model_for(args: argparse.Namespace, settings: Settings) -> ServedModel:
    """The model --model or -Q names (the first served one without either); CLIError otherwise."""
    name = args.model or None          # compose passes --model '' for "the first"
    if args.queues is not None:
        queues = [q.strip() for q in args.queues.split(",") if q.strip()]
        if len(queues) != 1:
            raise CLIError(f"-Q/--queues {args.queues!r}: a rein worker consumes one queue, its model's; run "
                           f"one worker per model (e.g. rein worker -Q {queues[0] if queues else 'NAME'})")
        keys = RedisKeys.from_settings(settings)
        by_queue = {keys.queue(m.name): m.name for m in settings.models}
        queue_model = by_queue.get(queues[0], queues[0])
        if name is not None and name != queue_model:
            raise CLIError(f"--model {name} and -Q {queues[0]} name different models; a worker serves one")
        name = queue_model
    if name is None:
        return settings.default_model
    served = settings.served_model(name)
    if served is None:
        names = ", ".join(m.name for m in settings.models) or "none (REIN_MODELS is empty)"
        queues = ", ".join(RedisKeys.from_settings(settings).queue(m.name) for m in settings.models)
        what = f"queue {args.queues!r}" if args.queues is not None else f"model {name!r}"
        raise CLIError(f"{what} is not served; served models: {names}" + (f" (queues {queues})" if queues else ""))
    return served


def worker_settings(args: argparse.Namespace, settings: Settings, served: ServedModel) -> Settings:
    """Settings whose engine fields hold the resolved values: flag > REIN_* > default, with
    -c/--concurrency as --max-num-seqs and the REIN_MODELS entry's @N before REIN_MAX_MODEL_LEN."""
    values = resolve_engine_values(vars(args), settings, tuple(o.name for o in options_for("worker")))
    if args.concurrency is not None:
        if args.concurrency < 1:
            raise CLIError(f"-c/--concurrency must be at least 1, got {args.concurrency}")
        if args.max_num_seqs is not None and args.max_num_seqs != args.concurrency:
            raise CLIError(f"-c/--concurrency {args.concurrency} and --max-num-seqs {args.max_num_seqs} set the "
                           f"same thing (jobs at once = engine sequences); give one")
        values["max_num_seqs"] = args.concurrency
    if args.max_model_len is None and served.max_model_len is not None:
        values["max_model_len"] = served.max_model_len
    return settings.model_copy(update=values)


def worker_engine_config(settings: Settings, served: ServedModel) -> EngineConfig:
    """The engine of `served` from resolved settings (worker_settings); ValueError if invalid."""
    from rein.engine.config import EngineConfig

    names = (*(o.name for o in options_for("worker")), "generation_config")
    return EngineConfig(model=served.source, **{name: getattr(settings, name) for name in names})


def worker_hostname(given: str | None, model_name: str) -> str:
    """Celery's node name rules (`%h`, `%n`, `%d` expanded; a value without `@` is the host part),
    with the model's name where Celery would say `celery`."""
    from celery.utils.nodenames import host_format

    given = given or "%h"
    return host_format(given if "@" in given else f"{model_name}@{given}")


def _warn_if_context_differs(args: argparse.Namespace, environment: Settings, served: ServedModel) -> None:
    """The API checks a request's length against @N / REIN_MAX_MODEL_LEN / the model's own,
    not this worker's flag: a longer request than the flag allows would fail here."""
    api_len = served.max_model_len or environment.max_model_len
    if args.max_model_len == "auto" or api_len == "auto":
        return   # the engine's load log says what fits, and that the API checks the model's own length
    if args.max_model_len is not None and args.max_model_len != api_len:
        log.warning("--max-model-len %d differs from the context length the API checks requests against "
                    "(%s): a request longer than %d tokens fails on this worker; set it in REIN_MODELS "
                    "(%s=...@%d) or REIN_MAX_MODEL_LEN instead, which the API reads too", args.max_model_len,
                    api_len or "the model's own", args.max_model_len, served.name, args.max_model_len)


def _warn_if_tokenizer_differs(args: argparse.Namespace, environment: Settings) -> None:
    """The API encodes requests (and builds chat prompts) with the tokenizer and template of
    its own settings: a worker flag that differs decodes them with another tokenizer."""
    for name in ("tokenizer", "tokenizer_revision", "chat_template", "revision"):
        given = getattr(args, name)
        if given is not None and given != getattr(environment, name):
            flag, variable = "--" + name.replace("_", "-"), f"REIN_{name.upper()}"
            log.warning("%s differs from %s, which the API encodes requests with: set %s instead, which "
                        "the API reads too", flag, variable, variable)


def _keep_rein_logging(app: Any, loglevel: str) -> None:
    """Celery logs through rein's handler (rein.core.logging) instead of replacing it.

    A receiver of Celery's `setup_logging` signal stops Celery from configuring logging at
    all (it would otherwise hijack the root logger with its own format); without the
    stdout redirect, rein's handler writing to stderr cannot loop back into logging.
    """
    import logging

    from celery.signals import setup_logging

    setup_logging.connect(_logging_is_configured, weak=False)
    app.conf.worker_hijack_root_logger = False
    app.conf.worker_redirect_stdouts = False
    logging.getLogger().setLevel(loglevel.upper())


def _logging_is_configured(**_: object) -> None:
    """Celery's setup_logging receiver: rein.cli.main has configured logging already."""
