#!/usr/bin/env bash
# API fuzzing in CI: the newest schemathesis against a real `callbackd serve` (temp SQLite
# store, test config, seeded messages), every check on every operation, with both tokens.
# Fails on any failure. Bounded so it stays within a few minutes on 2 cores:
# SCHEMATHESIS_MAX_EXAMPLES (default 40) cases per operation and phase, a fixed seed
# (SCHEMATHESIS_SEED) so a red run can be replayed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Run as a module, so a fresh install needs no PATH or shim refresh.
st() { python3 -m schemathesis.cli "$@"; }
if ! python3 -c 'import schemathesis' 2>/dev/null; then
  echo "installing schemathesis (pip)"
  python3 -m pip install --quiet --disable-pip-version-check schemathesis
fi
st --version

cargo build --locked --bin callbackd
bin="${CARGO_TARGET_DIR:-target}/debug/callbackd"

work="$(mktemp -d)"
pid=""
cleanup() {
  if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; fi
  rm -rf "$work"
}
trap cleanup EXIT

port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
base="http://127.0.0.1:$port"
export ST_ADMIN_TOKEN="schemathesis-admin-token"
export ST_CONNECTOR_TOKEN="schemathesis-connector-token"
# Dispatch is off: the fuzzer's callbackUrls are random hosts, and CI talks to loopback only.
# Private targets are allowed so that no callbackUrl is looked up in DNS either.
cat >"$work/config.toml" <<TOML
[server]
listen = "127.0.0.1:$port"
request_timeout_secs = 5
[store]
url = "sqlite://$work/callbackd.db"
[auth]
connector_tokens = ["$ST_CONNECTOR_TOKEN"]
admin_tokens = ["$ST_ADMIN_TOKEN"]
[dispatch]
enabled = false
allow_private_networks = true
[log]
level = "warn"
[sources.open]
signature = "none"
forward_url = "http://127.0.0.1:9/events"
allow_private_forward_url = true
# Three sources, as a deployment with several providers has: a transactionId without
# source then names the transaction in every one of them.
[sources.second]
signature = "none"
forward_url = "http://127.0.0.1:9/events"
allow_private_forward_url = true
[sources.third]
signature = "none"
TOML

"$bin" serve --config "$work/config.toml" >"$work/callbackd.log" 2>&1 &
pid=$!
for _ in $(seq 1 150); do
  curl -fsS "$base/healthz" >/dev/null 2>&1 && break
  sleep 0.1
done
curl -fsS "$base/healthz" >/dev/null || {
  echo "callbackd did not start:" >&2
  cat "$work/callbackd.log" >&2
  exit 1
}

# Seed one transaction's events in every source and two payments' notifications, so that lookups find messages
# (the document's links lead the fuzzer from these answers to the operations taking ids).
seed() { curl -fsS -o /dev/null "$@"; }
for source in open second third; do
  seed -X POST "$base/v1/callbacks/$source" -H 'Content-Type: application/json' \
    -d '{"id":"tx-seed-1","status":"COMPLETED"}'
done
for p in pay-seed-1 pay-seed-2; do
  seed -X POST "$base/v1/notifications" -H "Authorization: Bearer $ST_CONNECTOR_TOKEN" \
    -H 'Content-Type: application/json' \
    -d "{\"paymentId\":\"$p\",\"status\":\"approved\",\"callbackUrl\":\"http://127.0.0.1:9/cb\"}"
done

status=0
st --config-file .ci/schemathesis.toml run "$base/openapi.json" \
  --checks all \
  --max-examples "${SCHEMATHESIS_MAX_EXAMPLES:-40}" \
  --seed "${SCHEMATHESIS_SEED:-20261130}" \
  --workers 1 ${SCHEMATHESIS_ARGS:-} || status=$?
if [ "$status" -ne 0 ]; then
  echo "--- callbackd log (tail) ---"
  tail -n 50 "$work/callbackd.log"
fi
exit "$status"
