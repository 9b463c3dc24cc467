#!/usr/bin/env bash
# run.sh BINARY NAME [VAR=value ...]: one overload run of a worker build on
# a fresh database and stream: two `worker run` processes with 5 s leases
# by default (2 s step timeout + 3 s lease grace), flooded through their
# HTTP APIs by bench/overload. VAR=value pairs go to the workers' environment (say
# IDEMSAGA_NO_SHEDDING=true). N (default 20000) and C (default 200) set the
# transfers and the requests in flight; LEASE_GRACE (default 3s) and
# STEP_TIMEOUT (default 2s) the deployment's lease (30s is the engine's
# default grace, and its default shedding bound); WORKER_FLAGS more flags
# of `worker run` (say --step-concurrency 2).
set -euo pipefail
bin=$1 name=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
drv=${OVERLOAD_BIN:-/tmp/overload}
[ -x "$drv" ] || go build -o "$drv" "$here"
db=idemsaga_ovl_$name stream=OVL_$name
export PGHOST=127.0.0.1 PGUSER=postgres
psql -qc "drop database if exists $db" -c "create database $db"
export DATABASE_URL="postgres://postgres@127.0.0.1:5432/$db?sslmode=disable" IDEMSAGA_STREAM=$stream \
  IDEMSAGA_SUBJECT_PREFIX=ovl.$name IDEMSAGA_LEASE_GRACE=${LEASE_GRACE:-3s} IDEMSAGA_STEP_TIMEOUT=${STEP_TIMEOUT:-2s} LOG_LEVEL=error
"$drv" -delete-stream "$stream"
"$bin" migrate >/dev/null
"$bin" seed --accounts 1000 >/dev/null
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  "$drv" -delete-stream "$stream" || true
  psql -qc "drop database if exists $db" || true
}
trap cleanup EXIT
for port in 19464 19465; do
  # shellcheck disable=SC2086
  env "$@" "$bin" run --http-addr 127.0.0.1:$port --max-conns 10 ${WORKER_FLAGS:-} 2>"/tmp/ovl-$name-$port.log" &
  pids+=($!)
done
for port in 19464 19465; do
  for _ in $(seq 100); do curl -sf http://127.0.0.1:$port/readyz >/dev/null && break; sleep 0.1; done
done
"$drv" -urls http://127.0.0.1:19464,http://127.0.0.1:19465 -n "${N:-20000}" -c "${C:-200}" -accounts 1000
