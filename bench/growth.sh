#!/usr/bin/env bash
# growth.sh measures how start, step and saga latency grow with the number
# of finished sagas in the tables: `worker bench --prefill N` for each N in
# SIZES, in that order (interleave them to see the machine's drift), with
# the same open-loop load, then drops the benchmark's database.
#
#   bench/growth.sh                                  # 0, 1M, 10M, 1M, 0
#   SIZES="0 10000000" RATE=300 SAGAS=6000 bench/growth.sh
#
# A 10-million prefill takes several minutes and about 20 GB of disk
# (tables, indexes and WAL); check `df` first. DATABASE_URL names the
# server (default postgres://postgres@127.0.0.1:5432/postgres).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${SIZES:-"0 1000000 10000000 1000000 0"}
RATE=${RATE:-300}
SAGAS=${SAGAS:-6000}
DB=${DB:-idemsaga_growth}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
bin=$(mktemp -d)/worker
trap 'rm -rf "$(dirname "$bin")"; psql "$DATABASE_URL" -qAtc "drop database if exists $DB with (force)" >/dev/null || true' EXIT
go build -o "$bin" ./cmd/worker
for n in $SIZES; do
	echo "== $n finished sagas, $SAGAS sagas at $RATE/s"
	"$bin" bench --db-name "$DB" --prefill "$n" --rate "$RATE" --sagas "$SAGAS" --concurrency 64 \
		--pgbench-seconds 0 --timeout 60m | grep -E 'prefilled|throughput|latency|start, step|buffers|reconcile'
	psql "$DATABASE_URL" -qAtc "select 'tables: ' || pg_size_pretty(pg_database_size('$DB'))"
done
