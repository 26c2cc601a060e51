#!/bin/sh
# MinIO's command line, `server DIR [--address [HOST]:PORT] [--console-address ...]`, runs
# moto's S3 server on PORT (default 9000), so compose.s3.yaml's `s3` service runs this image
# or MinIO's unchanged. DIR is ignored: moto keeps everything in memory. Any other command
# (python3, sh) runs as given.
set -eu
if [ "${1:-}" = server ]; then
    shift
    port=9000
    while [ $# -gt 0 ]; do
        case "$1" in
            --address) port=${2##*:}; shift 2 ;;
            --address=*) port=${1##*:}; shift ;;
            --console-address) shift 2 ;;
            *) shift ;;
        esac
    done
    echo "s3: moto's S3 server on port $port, IN MEMORY: every bucket and object is lost when this container stops; for trying rein and for tests only (keep data in MinIO, S3 or R2: docs/deployment.md)" >&2
    exec moto_server -H 0.0.0.0 -p "$port"
fi
exec "$@"
