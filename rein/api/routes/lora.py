"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters registered for the whole
fleet at run time (vLLM's routes and bodies; a key with the `admin` scope).

Loading checks the adapter as far as can be done without its weights (rein.jobs.adapters:
the path, its adapter_config.json, its rank, the base it was trained on), then records it in
Postgres (`lora_adapters`), from where every API process finds it when a request names it
(within REIN_AUTH_CACHE_SECONDS), and announces it on Redis (RedisKeys.lora_events) so running
workers read it into their host cache before its first job. Workers started later need no
announcement: each job's message carries the adapter's path, read on demand. Unloading deletes
the row: new requests for the adapter are refused; jobs already accepted still run.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from fastapi import APIRouter, Depends
from sqlalchemy import delete
from sqlalchemy.dialects.postgresql import insert

from rein.api.checked_route import CheckedRoute
from rein.api.deps import RedisDep, RegistryDep, SessionDep, SettingsDep, require_scope
from rein.api.schemas import (
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelPublic,
    UnloadLoRAAdapterRequest,
)
from rein.core.settings import MODEL_NAME, LoRAModule
from rein.jobs.adapters import AdapterRef, base_for, check_adapter
from rein.jobs.errors import APIError
from rein.model.lora.config import AdapterError
from rein.store.keys import KeyInfo
from rein.store.redis_keys import RedisKeys
from rein.store.tables import LoRAAdapter

log = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["lora"], route_class=CheckedRoute)

AdminKey = Depends(require_scope("admin"))
_ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse} for code in (400, 401, 403, 404)}


@router.post("/load_lora_adapter", response_model=ModelPublic, responses=_ERRORS)
def load_lora_adapter(body: LoadLoRAAdapterRequest, session: SessionDep, registry: RegistryDep,
                      settings: SettingsDep, redis: RedisDep, key: KeyInfo = AdminKey) -> ModelPublic:
    """Register a LoRA adapter for every worker serving its base model; its jobs may be sent at once."""
    catalog = registry.adapters
    if not settings.enable_lora or catalog is None:
        raise APIError(400, "LoRA adapters are off in this deployment: set REIN_ENABLE_LORA=true (and "
                            "REIN_MAX_LORA_RANK to fit the adapters) for the API and the workers",
                       code="lora_disabled")
    name = body.lora_name
    if not MODEL_NAME.fullmatch(name):
        raise APIError(400, f"lora_name {name!r} must start with a letter or digit and use only letters, digits "
                            f"and . _ : / -", param="lora_name", code="invalid_value")
    if any(entry.name == name for entry in registry):
        raise APIError(400, f"lora_name {name!r} is a served model's name: give the adapter a name of its own",
                       param="lora_name", code="invalid_value")
    if name in catalog.static:
        raise APIError(400, f"the LoRA adapter '{name}' is named in REIN_LORA_MODULES: change it there, or "
                            f"register this one under another name", param="lora_name", code="invalid_value")
    module = LoRAModule(name=name, path=body.lora_path, base_model_name=body.base_model_name)
    try:
        base = base_for(module, settings.models)
        adapter = check_adapter(name, body.lora_path, base, settings.max_lora_rank,
                                check_base=body.base_model_name is None)
    except AdapterError as exc:
        raise APIError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from exc
    row = {"name": adapter.name, "base_model": adapter.base, "path": adapter.path,
           "lora_int_id": adapter.lora_int_id, "base_model_name": adapter.base_model_name, "key_id": key.key_id}
    statement = insert(LoRAAdapter).values(**row)
    if body.load_inplace:
        statement = statement.on_conflict_do_update(index_elements=["name"], set_=row)
    else:
        statement = statement.on_conflict_do_nothing(index_elements=["name"])
    stored = session.execute(statement.returning(LoRAAdapter.name)).first()
    session.commit()
    if stored is None:
        raise APIError(400, f"The lora adapter '{name}' has already been loaded (unload it first, or pass "
                            f"load_inplace: true to replace it).", param="lora_name", code="lora_adapter_exists")
    catalog.forget(name)
    announce(redis, settings, "load", adapter)
    log.info("LoRA adapter %s registered over model %s: %s (key %s)", name, adapter.base, adapter.path, key.key_id)
    base_entry = registry.get(adapter.base)
    return ModelPublic(id=name, created=int(time.time()),
                       max_model_len=base_entry.max_model_len if base_entry is not None else 0,
                       root=adapter.path, parent=adapter.base)


@router.post("/unload_lora_adapter", responses=_ERRORS)
def unload_lora_adapter(body: UnloadLoRAAdapterRequest, session: SessionDep, registry: RegistryDep,
                        settings: SettingsDep, redis: RedisDep, key: KeyInfo = AdminKey) -> dict[str, Any]:
    """Unregister a LoRA adapter: new requests for it are refused; jobs already accepted still run."""
    name = body.lora_name
    catalog = registry.adapters
    if catalog is not None and name in catalog.static:
        raise APIError(400, f"the LoRA adapter '{name}' is named in REIN_LORA_MODULES: remove it there and "
                            f"restart", param="lora_name", code="invalid_value")
    row = session.execute(delete(LoRAAdapter).where(LoRAAdapter.name == name)
                          .returning(LoRAAdapter.name, LoRAAdapter.base_model, LoRAAdapter.path,
                                     LoRAAdapter.lora_int_id, LoRAAdapter.base_model_name)).first()
    session.commit()
    if row is None:
        raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                       code="lora_adapter_not_found")
    if catalog is not None:
        catalog.forget(name)
    announce(redis, settings, "unload", AdapterRef(*row))
    log.info("LoRA adapter %s unloaded (key %s)", name, key.key_id)
    return {"id": name, "object": "model", "deleted": True}


def announce(redis: Any, settings: Any, event: str, adapter: AdapterRef) -> None:
    """Tell running workers (best effort: a worker that misses it reads the adapter on its first job)."""
    try:
        redis.publish(RedisKeys.from_settings(settings).lora_events(),
                      json.dumps({"event": event, **adapter.to_dict()}))
    except Exception as exc:   # Redis away: the registration stands, in Postgres
        log.warning("LoRA adapter %s: the %s announcement was not sent (%s)", adapter.name, event, exc)

