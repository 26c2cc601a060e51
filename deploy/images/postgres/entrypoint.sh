#!/bin/sh
# First start (an empty PGDATA): initdb with POSTGRES_USER as superuser and password
# POSTGRES_PASSWORD (required: no default password), password logins over the network,
# then POSTGRES_DB created. Every start: the server in the foreground, listening on all
# addresses of the container (compose publishes no port for it).
set -eu
: "${POSTGRES_DB:=$POSTGRES_USER}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        echo "postgres: POSTGRES_PASSWORD is not set; set it (compose.yaml reads it from the shell or .env)" >&2
        exit 1
    fi
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    initdb --username="$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 > /dev/null
    rm -f "$pwfile"
    echo "host all all all scram-sha-256" >> "$PGDATA/pg_hba.conf"
    # A server on the socket alone while the database is made, so nothing connects half-ready.
    pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait start > /dev/null
    if [ "$POSTGRES_DB" != postgres ]; then
        createdb --username="$POSTGRES_USER" --owner="$POSTGRES_USER" "$POSTGRES_DB"
    fi
    pg_ctl --pgdata="$PGDATA" --mode=fast --wait stop > /dev/null
    echo "postgres: initialized $PGDATA (user $POSTGRES_USER, database $POSTGRES_DB)"
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' "$@"
