#!/usr/bin/env bash
# Counts the instructions PostgreSQL executes for a Go benchmark, free of the
# machine's noise: a scratch cluster runs under valgrind's callgrind, the
# benchmark runs against it (TEST_DATABASE_URL), and the instructions of the
# backend that did the most work are divided by the benchmark's iterations.
# Counts repeat to about 0.02% for the same build; timings on a shared
# 2-core machine do not.
#
# Usage: bench/pg-instructions.sh <go test arguments>
#   bench/pg-instructions.sh -bench 'TransferSaga/eager' -benchtime 500x ./engine
# (run from the repository's root: the arguments go to `go test` as they
# are, so package paths are relative to the current folder).
#
# The benchmark must do its work on one connection (the largest backend is
# taken as its own); its connection start and warm-up are included, so use
# enough iterations (-benchtime Nx, N in the thousands) for them to fade.
# Needs valgrind and PostgreSQL's server binaries (initdb, postgres); the
# scratch cluster lives in a temporary folder on PORT (default 5499) and is
# removed at the end (kept, with each backend's callgrind profile, when KEEP
# is set). As root, the server runs as the postgres user.
set -euo pipefail

PORT=${PORT:-5499}
say() { echo "pg-instructions: $*" >&2; }
die() { echo "pg-instructions: $*" >&2; exit 1; }

[ $# -gt 0 ] || die "give the go test arguments, for example: -bench 'TransferSaga/eager' -benchtime 500x ./engine"
command -v valgrind >/dev/null || die "valgrind is missing; install it (apt-get install valgrind)"
bindir=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
[ -n "$bindir" ] && [ -x "$bindir/initdb" ] || die "PostgreSQL's server binaries are missing; install the postgresql package"
if (echo >/dev/tcp/127.0.0.1/"$PORT") 2>/dev/null; then
	die "port $PORT is taken; set PORT to a free one"
fi

dir=$(mktemp -d /tmp/pg-instructions.XXXXXX)
as_owner() { "$@"; }
if [ "$(id -u)" -eq 0 ]; then
	chown postgres "$dir"
	as_owner() { runuser -u postgres -- "$@"; }
fi
stop() {
	as_owner "$bindir/pg_ctl" -D "$dir/data" stop -m fast >/dev/null 2>&1 || true
	if [ -n "${KEEP:-}" ]; then
		say "kept $dir: callgrind_annotate --inclusive=yes $dir/cg/cg.<pid> reads a backend's profile"
	else
		# Backends under valgrind may still be writing their counts.
		for _ in 1 2 3 4 5; do
			rm -rf "$dir" 2>/dev/null && break
			sleep 1
		done
	fi
}
trap stop EXIT

say "starting a scratch cluster under callgrind on port $PORT (in $dir)"
as_owner "$bindir/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
cat >>"$dir/data/postgresql.conf" <<EOF
port = $PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
shared_buffers = 128MB
autovacuum = off
max_connections = 20
EOF
as_owner mkdir "$dir/cg"
as_owner sh -c "valgrind --tool=callgrind --callgrind-out-file='$dir/cg/cg.%p' '$bindir/postgres' -D '$dir/data' >'$dir/log' 2>&1 &"
for _ in $(seq 1 120); do
	"$bindir/pg_isready" -q -h 127.0.0.1 -p "$PORT" && break
	sleep 0.5
done
"$bindir/pg_isready" -q -h 127.0.0.1 -p "$PORT" || die "the scratch cluster did not start; see $dir/log"

before=$(grep -c 'I   refs' "$dir/log" || true)
out=$(TEST_DATABASE_URL="postgres://postgres@127.0.0.1:$PORT/postgres?sslmode=disable" go test -count=1 -run '^$' "$@" 2>&1) || {
	echo "$out" >&2
	die "the benchmark failed"
}
echo "$out" | grep -E '^Benchmark' >&2 || true
# Backends write their counts when their connections close.
sleep 3
largest=$(grep 'I   refs' "$dir/log" | tail -n +"$((before + 1))" | awk '{gsub(",", "", $4); print $4}' | sort -n | tail -1)
iterations=$(echo "$out" | awk '/^Benchmark/ {print $2; exit}')
[ -n "$largest" ] && [ -n "$iterations" ] || die "found no backend count or no benchmark line"
echo "instructions of the busiest backend: $largest over $iterations iterations: $((largest / iterations)) per iteration"
