#!/usr/bin/env bash
# Validate a Compose file (default: docker-compose.yml) with a real Compose implementation; no
# Docker engine is needed. Uses `docker compose` (v2) when the plugin is there, else
# `docker-compose`; when neither is, installs Debian's docker-compose (1.29, the only Compose in
# Debian 12) without its recommended docker.io. Exits non-zero when the file is invalid.
#   bash scripts/check-compose.sh [FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
file="${1:-docker-compose.yml}"

install_compose() {
  local sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "check-compose: install Compose first: apt-get install docker-compose" >&2
      exit 1
    }
    sudo="sudo"
  fi
  local log
  log="$(mktemp)"
  echo "check-compose: installing Debian's docker-compose" >&2
  if ! { $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      docker-compose; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "check-compose: could not install docker-compose" >&2
    exit 1
  fi
  rm -f "$log"
}

if docker compose version >/dev/null 2>&1; then
  compose=(docker compose)
else
  command -v docker-compose >/dev/null 2>&1 || install_compose
  compose=(docker-compose)
fi

version="$("${compose[@]}" version --short 2>/dev/null || true)"
if ! "${compose[@]}" -f "$file" config -q; then
  echo "check-compose: $file is invalid (${compose[*]} $version)" >&2
  exit 1
fi
echo "check-compose: $file is valid (${compose[*]} $version)"
