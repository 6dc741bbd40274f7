#!/usr/bin/env bash
# Validate docker-compose.yml with a real Compose implementation (no Docker engine needed).
# Uses `docker compose` when the plugin is there, else Debian's docker-compose (installed if
# missing).
set -euo pipefail
cd "$(dirname "$0")/.."

if docker compose version >/dev/null 2>&1; then
  docker compose config -q
elif command -v docker-compose >/dev/null 2>&1; then
  docker-compose config -q
else
  apt-get update -qq >/dev/null 2>&1
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null 2>&1
  docker-compose config -q
fi
echo "docker-compose.yml is valid"
