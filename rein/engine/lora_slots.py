"""Which LoRA adapters are loaded, and which sit in the model's device slots.

Two levels, as vLLM's: a host cache of loaded adapters (`LoRAWeights`, read from their
directories by rein.model.lora.adapters) and the model's `max_loras` device slots
(rein.model.lora.layers.LoRAModel), into which a step's adapters are copied.

* Host: `load(lora_request)` returns the adapter's weights, from the cache or read now (the
  error, `AdapterError`, is the request's: the engine fails that request alone). The cache keeps
  the `max_cpu_loras` adapters used last; a request holds its adapter's weights itself
  (Request.lora_weights), so an adapter dropped from the cache while requests still need it
  stays loaded for them and is never read twice for one request.
* Device: `assign(adapters)` gives each adapter of a step a slot: the one it has, else a free
  one, else the one least recently used by a step among the adapters this step does not use
  (the scheduler keeps a step's adapters within max_loras, so there always is one).
* Under tensor parallelism the other ranks `place` each adapter in the slot rank 0's `assign`
  gave it (rein.engine.model_runner's StepPlan.lora_activations), reading it through their own
  host cache.

No torch here: the loader and the model's slots are handed in, so fakes test this module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from rein.model.lora.request import LoRARequest


class AdapterSlots(Protocol):
    """What this module needs of the model side (rein.model.lora.layers.LoRAModel)."""

    def activate(self, slot: int, weights: Any) -> None: ...

    def deactivate(self, slot: int) -> None: ...


class LoRASlots:
    """The host cache and the device slots of one engine (see the module docstring).
    `loader(lora_request)` reads an adapter (raising the model side's AdapterError)."""

    def __init__(self, loader: Callable[[LoRARequest], Any], model: AdapterSlots, max_loras: int,
                 max_cpu_loras: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be at least max_loras ({max_loras})")
        self.loader = loader
        self.model = model
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        # lora_int_id -> (the request it was loaded for, its weights), least recently used first.
        self._host: OrderedDict[int, tuple[LoRARequest, Any]] = OrderedDict()
        # lora_int_id -> its slot, least recently used by a step first.
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free = list(range(max_loras - 1, -1, -1))   # pop() hands out slot 0 first
        self.num_loads = 0          # adapters read from disk (tests, logs)
        self.num_activations = 0    # adapters copied into a device slot

    # -- host ------------------------------------------------------------------------------------

    def load(self, lora_request: LoRARequest) -> Any:
        """The adapter's weights, from the host cache or read now (AdapterError on a bad adapter;
        ValueError when its id was loaded for another adapter path)."""
        found = self._host.get(lora_request.lora_int_id)
        if found is not None:
            cached, weights = found
            if cached.lora_path != lora_request.lora_path:
                raise ValueError(
                    f"lora_int_id {lora_request.lora_int_id} is adapter {cached.lora_name!r} at "
                    f"{cached.lora_path}, not {lora_request.lora_path}: give each adapter an id of its own")
            self._host.move_to_end(lora_request.lora_int_id)
            return weights
        weights = self.loader(lora_request)
        self.num_loads += 1
        self._host[lora_request.lora_int_id] = (lora_request, weights)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
        return weights

    def forget(self, lora_int_id: int) -> None:
        """Drop an adapter from the host cache (unloaded): read again if a request names it later.
        Its device slot, if it has one, goes to the next adapter that needs a slot like any other."""
        self._host.pop(lora_int_id, None)

    @property
    def loaded(self) -> list[int]:
        """The ids of the adapters in the host cache, least recently used first."""
        return list(self._host)

    # -- device ----------------------------------------------------------------------------------

    def assign(self, adapters: Mapping[int, Any]) -> dict[int, int]:
        """Slots for one step's adapters (lora_int_id -> weights): lora_int_id -> slot, copying into
        a slot each adapter not in one already. ValueError if they are more than max_loras."""
        if len(adapters) > self.max_loras:
            raise ValueError(f"a step needs {len(adapters)} LoRA adapters, more than max_loras "
                             f"({self.max_loras}) slots (scheduler bug)")
        slots = {}
        for lora_id, weights in adapters.items():
            held = self._slots.get(lora_id)
            if held is not None:
                self._slots.move_to_end(lora_id)
                slots[lora_id] = held
                continue
            slot = self._free.pop() if self._free else self._evict(adapters)
            self.model.activate(slot, weights)
            self.num_activations += 1
            self._slots[lora_id] = slot
            slots[lora_id] = slot
        return slots

    def place(self, slot: int, lora_request: LoRARequest) -> None:
        """Put the adapter in `slot`, whatever was there: a tensor-parallel rank other than 0 doing
        what rank 0's `assign` did (its step plan says which adapter went where), the weights from
        this rank's own host cache. Rank 0 accepted the adapter, so it is read here without question:
        an id this cache holds for another path is read again (rank 0's is the newer)."""
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"LoRA slot {slot} is out of range: there are {self.max_loras} (max_loras)")
        cached = self._host.get(lora_request.lora_int_id)
        if cached is not None and cached[0].lora_path != lora_request.lora_path:
            del self._host[lora_request.lora_int_id]
        weights = self.load(lora_request)
        for lora_id, held in list(self._slots.items()):
            if held == slot or lora_id == lora_request.lora_int_id:
                del self._slots[lora_id]
        if slot in self._free:
            self._free.remove(slot)
        self.model.activate(slot, weights)
        self.num_activations += 1
        self._slots[lora_request.lora_int_id] = slot

    def _evict(self, keep: Mapping[int, Any]) -> int:
        """Empty the slot of the least recently used adapter that is not in `keep`."""
        victim = next(lora_id for lora_id in self._slots if lora_id not in keep)
        slot = self._slots.pop(victim)
        self.model.deactivate(slot)
        return slot

    @property
    def active(self) -> dict[int, int]:
        """lora_int_id -> slot of the adapters in the device slots."""
        return dict(self._slots)
