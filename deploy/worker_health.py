"""A rein worker container's health check: healthy while its worker beats with its engine up.

The worker writes a heartbeat to Redis every 5 s (rein.worker.heartbeat), under the Celery
node name MODEL@HOST, HOST being this container's hostname; the key expires 15 s after the
last beat. Healthy means a beat of a worker of this host exists and says `up` (the engine is
loaded and stepping); `down` while the model loads or after an engine death, and no beat at
all, are unhealthy. The metrics port would answer before the model is loaded, so it is not
asked. Exit 0: healthy; 1: not (the reason on stdout, which `docker inspect` shows).
"""

from __future__ import annotations

import json
import socket
import sys


def main() -> int:
    from redis import Redis

    from rein.store.redis_keys import RedisKeys
    from rein.core.settings import get_settings

    settings = get_settings()
    keys = RedisKeys.from_settings(settings)
    host = socket.gethostname()
    redis = Redis.from_url(settings.redis_url, socket_timeout=3)
    try:
        names = [n.decode() for n in redis.hkeys(keys.workers()) if n.decode().endswith(f"@{host}")]
        beats = [redis.get(keys.worker_heartbeat(name)) for name in names]
    finally:
        redis.close()
    states = {name: json.loads(beat).get("state") for name, beat in zip(names, beats, strict=True) if beat}
    if any(state == "up" for state in states.values()):
        print(f"up: {', '.join(n for n, s in states.items() if s == 'up')}")
        return 0
    print(f"no worker of host {host} beats with its engine up: {states or 'no heartbeat'}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
