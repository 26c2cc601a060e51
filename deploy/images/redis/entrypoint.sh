#!/bin/sh
# `redis-server ARGS` runs with protected mode off first, so ARGS can still turn it on;
# any other command (redis-cli, sh) runs as given.
set -eu
if [ "${1:-}" = redis-server ]; then
    shift
    set -- redis-server --protected-mode no "$@"
fi
exec "$@"
