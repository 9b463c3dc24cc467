#!/usr/bin/env bash
# growth.sh measures how start, step and saga latency grow with the number
# of finished sagas in the tables: `worker bench --prefill N` for each N in
# SIZES, in that order (interleave them to see the machine's drift), with
# the same open-loop load. Each size has a database of its own, prefilled
# once and reused by later runs of that size (--reuse-prefill); all are
# dropped at the end unless KEEP=1.
#
#   bench/growth.sh                                  # 0, 1M, 10M, 1M, 0
#   SIZES="0 10000000" RATE=300 SAGAS=6000 bench/growth.sh
#
# A 10-million prefill takes 10-20 minutes on 2 cores and about 13 GB of
# disk (tables and indexes; WAL on top while it runs): check `df` first.
# DATABASE_URL names the server (default postgres://postgres@127.0.0.1:5432/postgres).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZES=${SIZES:-"0 1000000 10000000 1000000 0"}
RATE=${RATE:-300}
SAGAS=${SAGAS:-6000}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
bin=$(mktemp -d)/worker
cleanup() {
	rm -rf "$(dirname "$bin")"
	[ "${KEEP:-0}" = 1 ] && return
	for n in $SIZES; do psql "$DATABASE_URL" -qAtc "drop database if exists idemsaga_growth_$n with (force)" >/dev/null || true; done
}
trap cleanup EXIT
go build -o "$bin" ./cmd/worker
for n in $SIZES; do
	echo "== $n finished sagas, $SAGAS sagas at $RATE/s"
	"$bin" bench --db-name "idemsaga_growth_$n" --prefill "$n" --reuse-prefill --rate "$RATE" --sagas "$SAGAS" --concurrency 64 \
		--pgbench-seconds 0 --timeout 60m | grep -E 'prefilled|reused|throughput|latency|start, step|buffers|pages by|reconcile'
	psql "$DATABASE_URL" -qAtc "select 'tables: ' || pg_size_pretty(pg_database_size('idemsaga_growth_$n'))"
done
