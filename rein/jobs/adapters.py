"""The LoRA adapters the fleet serves, as the API and the batch manager see them.

An adapter is served over a base model (a REIN_MODELS entry): its jobs wait on the base
model's queues, so any worker serving the base runs them, and the job's message carries the
adapter (`AdapterRef`: its name, path and engine id), which the worker's engine reads on
demand into its adapter slots (rein.engine.lora_slots). Workers need no list of adapters.

Two sources, one `AdapterCatalog`:

* REIN_LORA_MODULES (and REIN_MODELS entries naming an adapter directory): checked when the
  process starts (`AdapterCatalog.from_settings`); a bad one stops the API with the reason, as
  vLLM's --lora-modules does.
* The `lora_adapters` table: adapters registered for the whole fleet at run time
  (POST /v1/load_lora_adapter, rein.api.routes.lora). Each API process looks a name up there
  when a request names it and trusts what it read for REIN_AUTH_CACHE_SECONDS, so an unloaded
  adapter is refused by every replica within that time.

An adapter's path is a directory every worker can read, or an `s3://` URL that each machine
fetches once into its cache (rein.model.lora.fetch). The checks here are those that need no weights (rein.model.lora.config): the directory and its
adapter_config.json, the kind of adapter, its rank against REIN_MAX_LORA_RANK and the base it
was trained on. The rest (its tensors against the model's shapes) is the worker's, which fails
the job with the reason.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from rein.core.settings import LoRAModule, ServedModel, Settings
from rein.model.lora.config import (
    AdapterError,
    check_adapter_directory,
    last_component,
    read_config,
)
from rein.model.lora.fetch import is_remote, local_adapter

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"


def lora_int_id(name: str, path: str) -> int:
    """The engines' id of an adapter: the same in every process for the same name and path, and
    a new one when a name is registered again with another path (so no engine reuses the old
    adapter's cached weights or prefix-cache entries)."""
    digest = hashlib.sha256(f"{name}\0{path}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF or 1


@dataclass(frozen=True)
class AdapterRef:
    """An adapter a job runs under: its name (the job's `model`), the base model whose queue it
    waits on, where the worker reads it, its engine id, and the base the worker checks it
    against (None: no check; the API made it)."""

    name: str
    base: str
    path: str
    lora_int_id: int
    base_model_name: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AdapterRef:
        return cls(**data)

    def lora_request(self) -> Any:
        """The engine's LoRARequest for it (rein.model.lora.request: torch-free)."""
        from rein.model.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_int_id, self.path, self.base_model_name)


def check_adapter(name: str, path: str, base: ServedModel, max_lora_rank: int,
                  check_base: bool = True) -> AdapterRef:
    """The adapter `name` at `path`, to run over `base`, checked as far as its weights aside
    (AdapterError saying what is wrong and what to change)."""
    if is_remote(path):     # fetched here too (cached), to check it as the workers will read it
        location = Path(local_adapter(path))
    else:
        location = Path(path)
        if not location.is_absolute():
            raise AdapterError(f"adapter {name}: path {path!r} is relative; give an absolute path that every "
                               f"worker can read (a shared directory), or an s3:// URL")
    if location.suffix.lower() == GGUF_SUFFIX:
        if not location.is_file():
            raise AdapterError(f"adapter {name}: {path} does not exist: give the GGUF LoRA file llama.cpp's "
                               f"convert_lora_to_gguf.py wrote, where every worker can read it")
        return AdapterRef(name, base.name, path, lora_int_id(name, path))
    config = check_adapter_directory(location, max_lora_rank, None, check_base=False)
    recorded = config.get("base_model_name_or_path")
    if check_base and recorded and not trained_on(recorded, base):
        raise AdapterError(
            f"adapter {name} was trained on {recorded!r} (base_model_name_or_path in its adapter_config.json), "
            f"not on the served model {base.name!r} ({base.source}): serve it over that base, or, if it is the "
            f"same model under another name, give base_model_name: {base.name!r} to say so")
    return AdapterRef(name, base.name, path, lora_int_id(name, path), recorded or None)


def trained_on(recorded: str, base: ServedModel) -> bool:
    """Whether an adapter's base_model_name_or_path names `base`: its name, its source, or the
    same last path component (a local copy of org/name)."""
    wanted = last_component(recorded)
    return recorded in (base.name, base.source) or wanted in (last_component(base.name),
                                                              last_component(base.source))


def base_for(module: LoRAModule, models: Sequence[ServedModel]) -> ServedModel:
    """The served model an adapter of REIN_LORA_MODULES runs over: the one it names, else the one
    its adapter_config.json was trained on, else the first (AdapterError when none is served)."""
    if not models:
        raise AdapterError(f"adapter {module.name}: no model is served (REIN_MODELS is empty) to run it over")
    if module.base_model_name is not None:
        found = next((m for m in models if m.name == module.base_model_name), None)
        if found is None:
            raise AdapterError(f"adapter {module.name}: base_model_name {module.base_model_name!r} is not served "
                               f"(served: {', '.join(m.name for m in models)})")
        return found
    if len(models) > 1:
        try:
            recorded = read_config(Path(local_adapter(module.path))).get("base_model_name_or_path")
        except AdapterError:
            recorded = None      # a GGUF file, or something check_adapter will say is wrong
        if recorded:
            found = next((m for m in models if trained_on(recorded, m)), None)
            if found is not None:
                return found
    return models[0]


class AdapterCatalog:
    """name -> AdapterRef for the adapters the fleet serves (see the module docstring).
    `sessions` None: REIN_LORA_MODULES only (tests, `rein run-batch`)."""

    def __init__(self, settings: Settings, static: dict[str, AdapterRef],
                 sessions: sessionmaker[Session] | None = None) -> None:
        self.settings = settings
        self.static = static
        self.sessions = sessions
        self._ttl = settings.auth_cache_seconds
        self._cache: dict[str, tuple[float, AdapterRef | None]] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: Settings, sessions: sessionmaker[Session] | None = None) -> AdapterCatalog:
        """The catalog with REIN_LORA_MODULES checked (AdapterError naming the bad adapter)."""
        static = {}
        for module in settings.lora_modules:
            base = base_for(module, settings.models)
            static[module.name] = check_adapter(module.name, module.path, base, settings.max_lora_rank,
                                                check_base=module.base_model_name is None)
            log.info("LoRA adapter %s over model %s: %s", module.name, base.name, module.path)
        return cls(settings, static, sessions)

    def get(self, name: str) -> AdapterRef | None:
        """The adapter called `name`, or None (a registered one read from Postgres at most once per
        REIN_AUTH_CACHE_SECONDS per name)."""
        found = self.static.get(name)
        if found is not None or self.sessions is None:
            return found
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(name)
        if cached is not None and now - cached[0] < self._ttl:
            return cached[1]
        found = self._read(name)
        with self._lock:
            if len(self._cache) > 10_000:   # names asked for and never registered must not pile up
                self._cache.clear()
            self._cache[name] = (now, found)
        return found

    def _read(self, name: str) -> AdapterRef | None:
        from rein.store.tables import LoRAAdapter

        with self.sessions() as session:  # type: ignore[misc]  # not None: checked by get
            row = session.get(LoRAAdapter, name)
        return None if row is None else ref_of(row)

    def registered(self) -> list[AdapterRef]:
        """Every adapter: REIN_LORA_MODULES', then those registered at run time, by name."""
        refs = list(self.static.values())
        if self.sessions is not None:
            from rein.store.tables import LoRAAdapter

            with self.sessions() as session:
                refs += [ref_of(row) for row in session.scalars(select(LoRAAdapter).order_by(LoRAAdapter.name))]
        return refs

    def forget(self, name: str) -> None:
        """Drop what this process read of `name` (it was just registered or unloaded here)."""
        with self._lock:
            self._cache.pop(name, None)


def ref_of(row: Any) -> AdapterRef:
    """The AdapterRef of a lora_adapters row."""
    return AdapterRef(row.name, row.base_model, row.path, row.lora_int_id, row.base_model_name)
