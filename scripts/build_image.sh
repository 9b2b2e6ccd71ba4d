#!/usr/bin/env bash
# Build the atropos-sandbox server image (default tag atropos-sandbox:dev).
#
#   1. wheel of this project -> sandbox_image/dist/ (+ dependency wheels in dist/wheelhouse/, fetched on
#      the host with its pip configuration, so the image build needs no network when they are complete)
#   2. scripts/docker_engine.sh (start the engine if needed)
#   3. base image: the public python base if it is available locally (or ATROPOS_BASE=public), otherwise the
#      local debootstrap base from scripts/build_base_image.sh (no registry needed)
#   4. docker build sandbox_image/ -> image labelled with a hash of wheel contents + Dockerfile + base id;
#      skipped when an image with that label already exists
#
# Environment:
#   IMAGE_TAG        default atropos-sandbox:dev
#   ATROPOS_BASE     auto (default) | public | local | <any image reference>
#   PUBLIC_BASE      default python:3.11-slim-bookworm
#   PYTHON           python used to build the wheel (default .venv/bin/python, else python3)
#   REBUILD=1        build even if an image with the same hash exists
#   PREFETCH_DEPS=0  do not download dependency wheels on the host
#   PIP_INDEX_URL / PIP_EXTRA_INDEX_URL   passed to the build as build args when set
#   PIP_CERT         CA bundle passed to pip in the build stage only (not in the final image)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ctx="$repo/sandbox_image"
dist="$ctx/dist"
tag="${IMAGE_TAG:-atropos-sandbox:dev}"
public_base="${PUBLIC_BASE:-python:3.11-slim-bookworm}"
local_base="atropos-sandbox-base:bookworm"
base_choice="${ATROPOS_BASE:-auto}"

start=$SECONDS
say() { printf '[build_image +%3ss] %s\n' "$((SECONDS - start))" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

py="${PYTHON:-}"
if [[ -z "$py" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then py="$repo/.venv/bin/python"; else py="$(command -v python3)"; fi
fi

# --- 1. wheel ----------------------------------------------------------------------------------------
say "building wheel with $py"
rm -rf "$dist" "$repo/build"  # build/: setuptools' in-tree staging dir would keep deleted modules
mkdir -p "$dist"
# fixed timestamps: same sources -> same wheel bytes (the hash below uses contents anyway)
SOURCE_DATE_EPOCH=315532800 "$py" -m pip wheel --quiet --no-deps -w "$dist" "$repo" \
    || die "pip wheel failed"
wheels=("$dist"/*.whl)
[[ ${#wheels[@]} -eq 1 && -f "${wheels[0]}" ]] || die "expected exactly one wheel in $dist"
wheel="${wheels[0]}"
say "wheel: $(basename "$wheel")"
# slotd, the compiled supervisor (docs/native-supervisor.md): static, built here once (cached by its
# source's hash), so the image needs no compiler; without one the image's slots run the Python supervisor.
if ATROPOS_SLOTD="" "$py" -c 'import shutil, sys
from atropos.sandbox.host import slotd_build
built = slotd_build.build()
sys.exit(1) if built is None else shutil.copyfile(built, sys.argv[1])' "$dist/slotd"; then
    chmod 0755 "$dist/slotd"
    say "slotd built into the image's context"
else
    say "WARNING: slotd did not build (no C compiler?): the image's slots run the Python supervisor"
fi

# --- 2. engine ---------------------------------------------------------------------------------------
bash "$repo/scripts/docker_engine.sh"

# --- 3. base image -----------------------------------------------------------------------------------
image_present() { docker image inspect "$1" >/dev/null 2>&1; }
case "$base_choice" in
    auto)
        if image_present "$public_base"; then
            base="$public_base"
        else
            say "public base $public_base not available locally; using the local debootstrap base"
            bash "$repo/scripts/build_base_image.sh"
            base="$local_base"
        fi
        ;;
    public) base="$public_base" ;;  # docker build pulls it if needed
    local)
        bash "$repo/scripts/build_base_image.sh"
        base="$local_base"
        ;;
    *) base="$base_choice" ;;
esac
base_id="$(docker image inspect --format '{{.Id}}' "$base" 2>/dev/null || echo "$base")"
say "base image: $base"

# --- 4. hash + build ---------------------------------------------------------------------------------
wheel_hash="$("$py" - "$wheel" <<'EOF'
import hashlib, sys, zipfile
h = hashlib.sha256()
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in sorted(z.namelist()):
        h.update(name.encode() + b"\0" + hashlib.sha256(z.read(name)).digest())
print(h.hexdigest())
EOF
)"
slotd_hash="$(sha256sum <"$dist/slotd" 2>/dev/null || echo none)"
build_hash="$(printf '%s\n' "$wheel_hash" "$(sha256sum <"$ctx/Dockerfile")" "$base_id" "$slotd_hash" | sha256sum | cut -c1-32)"

report_size() {
    local size
    size="$(docker image inspect --format '{{.Size}}' "$tag")"
    say "image $tag: $((size / 1000000)) MB ($size bytes), build hash $build_hash"
}

if [[ "${REBUILD:-0}" != 1 ]]; then
    existing="$(docker images --quiet --filter "label=org.atropos.build-hash=$build_hash" | head -n 1)"
    if [[ -n "$existing" ]]; then
        docker tag "$existing" "$tag"
        say "image with build hash $build_hash already exists ($existing); skipping build"
        report_size
        exit 0
    fi
fi

if [[ "${PREFETCH_DEPS:-1}" == 1 ]]; then
    say "downloading dependency wheels on the host"
    if ! "$py" -m pip download --quiet --only-binary=:all: -d "$dist/wheelhouse" "$wheel" \
        >"$dist/prefetch.log" 2>&1; then
        tail -n 5 "$dist/prefetch.log" >&2
        say "WARNING: dependency prefetch failed; pip inside the build will use the package index"
        rm -rf "$dist/wheelhouse"
    fi
    rm -f "$dist/wheelhouse/$(basename "$wheel")"
fi
if [[ -n "${PIP_CERT:-}" && -f "${PIP_CERT}" ]]; then
    cp "$PIP_CERT" "$dist/pip-ca.pem"
fi

build_args=(--build-arg "BASE_IMAGE=$base")
for v in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
    if [[ -n "${!v:-}" ]]; then build_args+=(--build-arg "$v=${!v}"); fi
done

say "docker build -> $tag"
docker build "${build_args[@]}" \
    --label "org.atropos.build-hash=$build_hash" \
    --label "org.atropos.wheel=$(basename "$wheel")" \
    -t "$tag" "$ctx"
# Leftovers of earlier builds: superseded (untagged) final images and the intermediate build stage.
# `until` keeps the images of a build that may still be running next to this one.
docker image prune --force --filter "label=org.atropos.build-hash" --filter "until=10m" >/dev/null || true
docker image prune --force --filter "label=org.atropos.stage=build" --filter "until=10m" >/dev/null || true
report_size
