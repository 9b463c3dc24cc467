#!/usr/bin/env bash
# Makes sure a PostgreSQL server accepts connections at 127.0.0.1:5432 as user
# postgres without a password (what the tests, `make demo` and `make migrate`
# expect), installing and starting one on Debian/Ubuntu if needed.
#
# - If DATABASE_URL is set and points at a non-local host, it only checks that
#   server with psql and changes nothing.
# - If the server already answers, it exits 0 at once and prints nothing.
# - Otherwise it starts an existing cluster (pg_ctlcluster), or installs the
#   `postgresql` package (apt-get install --no-install-recommends), creates a
#   cluster, configures trust auth for local and 127.0.0.1/::1 connections
#   on port 5432, and starts it.
# Progress lines go to stderr, and only when something is actually done.
#
# The trust rule is wide. When it creates or installs a cluster, or when
# the postgres user cannot log in to a running one without a password, it
# puts these lines, between "# idemsaga:" marker lines, at the top of that
# cluster's pg_hba.conf (unless the file already trusts such connections),
# and keeps the old file as pg_hba.conf.orig-idemsaga:
#
#   local   all   all                  trust
#   host    all   all   127.0.0.1/32   trust
#   host    all   all   ::1/128        trust
#
# That is: every database, every database user (the superuser postgres
# included), no password, for anyone who can reach the Unix socket or
# connect from 127.0.0.1 or ::1 on this machine, i.e. every local account and
# every local process. Use it only on a machine of your own, a throwaway VM
# or a CI runner; never on a shared or production machine (set DATABASE_URL
# to a server of your own there instead).
#
# With --check (scripts/prerequisites.sh) it changes nothing: it prints
# nothing when no package is missing (a server answers, one is installed,
# or DATABASE_URL points elsewhere), prints "postgresql<TAB>why" when
# installing the package is what is needed, and fails when that would not
# help. For the scripts' tests only, IDEMSAGA_TEST_ROOT stands for / in
# /usr/lib/postgresql and IDEMSAGA_TEST_PG_PORT for the port.
set -euo pipefail

CHECK=""
[ "${1-}" = --check ] && CHECK=1

HOST=127.0.0.1
PORT=${IDEMSAGA_TEST_PG_PORT:-5432}
PGLIB=${IDEMSAGA_TEST_ROOT-}/usr/lib/postgresql
WAIT_SECONDS=30
MARK_BEGIN='# idemsaga: trust local connections (added by scripts/ensure-postgres.sh)'
MARK_END='# idemsaga: end'

say() { echo "ensure-postgres: $*" >&2; }
die() { echo "ensure-postgres: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# Runs a command as root: directly when root, through sudo otherwise (sudo -n
# when there is no terminal to ask for a password on, so CI never hangs).
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
	if have sudo; then
		if [ -t 0 ]; then SUDO="sudo"; else SUDO="sudo -n"; fi
	fi
fi
as_root() { $SUDO "$@"; }

# ---------------------------------------------------------------------------
# DATABASE_URL pointing elsewhere: check it, do nothing else.

# Prints the host part of a libpq URL or key=value connection string.
url_host() {
	local u=$1 rest h
	case $u in
	postgres://* | postgresql://*)
		rest=${u#*://}
		# host=... may also be given as a query parameter.
		local re='(^|&)host=([^&]*)'
		if [[ $rest == *\?* && ${rest#*\?} =~ $re ]]; then
			echo "${BASH_REMATCH[2]}"
			return
		fi
		rest=${rest%%\?*}
		rest=${rest%%/*}
		rest=${rest##*@}
		if [[ $rest == \[* ]]; then
			h=${rest#\[}
			h=${h%%\]*}
		else
			h=${rest%%:*}
			h=${h%%,*}
		fi
		echo "$h"
		;;
	*)
		local re='(^|[[:space:]])host=([^[:space:]]*)'
		if [[ $u =~ $re ]]; then
			echo "${BASH_REMATCH[2]}" | tr -d "'"
		fi
		;;
	esac
}

is_local_host() {
	case $1 in
	"" | 127.0.0.1 | localhost | ::1 | %2F* | %2f* | /*) return 0 ;;
	*) return 1 ;;
	esac
}

# Drops query parameters that libpq does not know (e.g. pgx's pool_max_conns),
# so psql can be pointed at a URL written for the Go driver.
libpq_url() {
	local u=$1 base query out="" kv key parts
	case $u in
	postgres://*\?* | postgresql://*\?*) ;;
	*)
		echo "$u"
		return
		;;
	esac
	base=${u%%\?*}
	query=${u#*\?}
	IFS='&' read -r -a parts <<<"$query"
	for kv in "${parts[@]}"; do
		key=${kv%%=*}
		case $key in
		host | hostaddr | port | dbname | user | password | passfile | channel_binding | \
			connect_timeout | client_encoding | options | application_name | \
			fallback_application_name | keepalives | keepalives_idle | keepalives_interval | \
			keepalives_count | tcp_user_timeout | replication | gssencmode | sslmode | \
			requiressl | sslcompression | sslcert | sslkey | sslpassword | sslrootcert | \
			sslcrl | sslcrldir | sslsni | requirepeer | ssl_min_protocol_version | \
			ssl_max_protocol_version | krbsrvname | gsslib | service | target_session_attrs)
			out="${out:+$out&}$kv"
			;;
		esac
	done
	echo "${base}${out:+?$out}"
}

if [ -n "${DATABASE_URL:-}" ]; then
	db_host=$(url_host "$DATABASE_URL")
	if ! is_local_host "$db_host"; then
		[ -z "$CHECK" ] || exit 0 # nothing to install here; checked without --check
		if ! have psql; then
			say "DATABASE_URL points at $db_host; psql is not installed, so it was not checked"
			exit 0
		fi
		if ! err=$(PGCONNECT_TIMEOUT=${PGCONNECT_TIMEOUT:-5} psql -X -w -Atq -d "$(libpq_url "$DATABASE_URL")" -c 'select 1' 2>&1 >/dev/null); then
			die "cannot connect to DATABASE_URL (host $db_host): $(echo "$err" | head -n1); fix DATABASE_URL or unset it to use a local server"
		fi
		exit 0
	fi
fi

# ---------------------------------------------------------------------------
# Local server at 127.0.0.1:5432.

# Succeeds when the server accepts a query as postgres without a password.
can_query() {
	PGCONNECT_TIMEOUT=3 psql -X -w -Atq -h "$HOST" -p "$PORT" -U postgres -d postgres \
		-c 'select 1' >/dev/null 2>&1
}

# Succeeds when the server accepts connections (authentication not checked).
is_up() {
	if have pg_isready; then
		pg_isready -q -h "$HOST" -p "$PORT" -t 3 >/dev/null 2>&1
	else
		(exec 3<>"/dev/tcp/$HOST/$PORT") 2>/dev/null
	fi
}

# Fast path: already fine.
if have psql; then
	can_query && exit 0
elif is_up; then
	# No client tools to check authentication with; the port answers, assume
	# a server someone else runs (e.g. in a container).
	exit 0
fi

if ! have apt-get && ! have pg_ctlcluster; then
	die "no PostgreSQL at $HOST:$PORT and no apt-get/pg_ctlcluster to set one up; start PostgreSQL there (user postgres, trust auth) or set DATABASE_URL"
fi
need_root() {
	if [ "$(id -u)" -ne 0 ] && [ -z "$SUDO" ]; then
		die "PostgreSQL at $HOST:$PORT is not usable and fixing that needs root ($1); run this script as root or with sudo, or set DATABASE_URL"
	fi
}

# Highest PostgreSQL server version installed, empty if none.
installed_version() {
	local d v best=""
	for d in "$PGLIB"/*/bin/postgres; do
		[ -x "$d" ] || continue
		v=${d#"$PGLIB"/}
		v=${v%%/*}
		if [ -z "$best" ] || [ "$(printf '%s\n%s\n' "$best" "$v" | sort -V | tail -n1)" = "$v" ]; then
			best=$v
		fi
	done
	echo "$best"
}

# Prints "version name port status logfile" of the cluster to use: the one on
# our port if any, else the highest version's "main", else the first one.
pick_cluster() {
	have pg_lsclusters || return 0
	local lines
	lines=$(pg_lsclusters -h 2>/dev/null | sort -k1,1V) || return 0
	[ -n "$lines" ] || return 0
	awk -v port="$PORT" '
		{ n++; line[n] = $1 " " $2 " " $3 " " $4 " " $7 }
		$3 == port && !byport { byport = line[n] }
		$2 == "main" { main = line[n] }
		END {
			if (byport) print byport
			else if (main) print main
			else if (n) print line[1]
		}' <<<"$lines"
}

pgctl() { # pgctl VERSION NAME ACTION
	as_root pg_ctlcluster --skip-systemctl-redirect "$1" "$2" "$3" >&2 ||
		as_root pg_ctlcluster "$1" "$2" "$3" >&2
}

cluster_running() {
	as_root pg_ctlcluster "$1" "$2" status >/dev/null 2>&1
}

# Prints "trust" when the first pg_hba.conf rule that a password-less
# connection as postgres would hit is "trust" for each of: the local socket,
# 127.0.0.1 and ::1. Anything uncertain counts as not trust.
hba_is_trust() {
	awk '
		function method(   m) { m = $5; if ($1 != "local" && ($5 ~ /^[0-9.]+$/ || $5 ~ /:/)) m = $6; return m }
		function userok(u) { return u == "all" || u ~ /(^|,)postgres(,|$)/ || u ~ /[+@]/ }
		function v4(a) { return a == "all" || a == "samehost" || a == "samenet" || a == "localhost" || a ~ /^127\./ || a == "0.0.0.0/0" || a == "0.0.0.0" }
		function v6(a) { return a == "all" || a == "samehost" || a == "samenet" || a == "localhost" || a ~ /^::1(\/|$)/ || a ~ /^::(\/0)?$/ }
		function probe(key, m, broad) {
			if (key in verdict) return
			if (m != "trust") verdict[key] = "no"
			else if (broad) verdict[key] = "yes"
		}
		/^[ \t]*(#|$)/ { next }
		{
			if ($2 == "replication" || !userok($3)) next
			broad = ($2 == "all" && ($3 == "all" || $3 == "postgres"))
			if ($1 == "local") {
				probe("local", $4, broad)
			} else if ($1 ~ /^host/) {
				if (v4($4)) probe("v4", method(), broad)
				if (v6($4)) probe("v6", method(), broad)
			}
		}
		END {
			if (verdict["local"] == "yes" && verdict["v4"] == "yes" && verdict["v6"] == "yes") print "trust"
		}' "$1"
}

# Makes local, 127.0.0.1 and ::1 connections trusted (sets CHANGED=1 when it
# edits pg_hba.conf).
ensure_trust() {
	local hba=$1 tmp
	tmp=$(mktemp)
	if ! as_root cat "$hba" >"$tmp"; then
		rm -f "$tmp"
		die "cannot read $hba"
	fi
	if grep -qF "$MARK_BEGIN" "$tmp" || [ "$(hba_is_trust "$tmp")" = trust ]; then
		rm -f "$tmp"
		return 0
	fi
	say "configuring trust authentication in $hba (the old file is kept as $hba.orig-idemsaga)"
	say "the rule: every database and every user, the superuser postgres included, with no password, over the local socket and from 127.0.0.1/32 and ::1/128; anyone on this machine can now connect as postgres, so this script must not be used on a shared or production machine"
	{
		echo "$MARK_BEGIN"
		echo "local   all   all                  trust"
		echo "host    all   all   127.0.0.1/32   trust"
		echo "host    all   all   ::1/128        trust"
		echo "$MARK_END"
		cat "$tmp"
	} >"$tmp.new"
	as_root cp -p "$hba" "$hba.orig-idemsaga"
	# shellcheck disable=SC2016 # expanded by the inner sh
	as_root sh -c 'cat "$1" > "$2"' sh "$tmp.new" "$hba"
	rm -f "$tmp" "$tmp.new"
	CHANGED=1
}

hba_file() { # hba_file VERSION NAME
	local f
	f=$(pg_conftool -s "$1" "$2" show hba_file 2>/dev/null || true)
	f=${f//\'/}
	echo "${f:-/etc/postgresql/$1/$2/pg_hba.conf}"
}

# Sets port and listen_addresses so the server listens on localhost:PORT
# (sets CHANGED=1 when it changes something).
ensure_listen() {
	local v=$1 n=$2 cur
	cur=$(pg_conftool -s "$v" "$n" show port 2>/dev/null || true)
	if [ "$cur" != "$PORT" ]; then
		say "setting port = $PORT for cluster $v/$n (was ${cur:-unset})"
		as_root pg_conftool "$v" "$n" set port "$PORT"
		CHANGED=1
	fi
	# Unset means the default, localhost; set but empty means no TCP at all.
	cur=$(pg_conftool -s "$v" "$n" show listen_addresses 2>/dev/null) || cur=localhost
	case ",${cur// /}," in
	*,localhost,* | *,127.0.0.1,* | *,\*,* | *,0.0.0.0,*) ;;
	*)
		say "setting listen_addresses = 'localhost' for cluster $v/$n (was $cur)"
		as_root pg_conftool "$v" "$n" set listen_addresses localhost
		CHANGED=1
		;;
	esac
}

wait_ready() {
	local deadline=$((SECONDS + WAIT_SECONDS))
	while [ "$SECONDS" -lt "$deadline" ]; do
		is_up && return 0
		sleep 0.5
	done
	is_up
}

# 1. Install the server if there is none.
fresh=""
if [ -n "$CHECK" ]; then
	if [ -z "$(installed_version)" ]; then
		have apt-get || die "PostgreSQL is not installed and apt-get is missing; install PostgreSQL and run it at $HOST:$PORT (user postgres, trust auth), or set DATABASE_URL"
		printf 'postgresql\tnothing answers at %s:%s and no PostgreSQL server is installed\n' "$HOST" "$PORT"
	fi
	exit 0
fi
if [ -z "$(installed_version)" ]; then
	have apt-get || die "PostgreSQL is not installed and apt-get is missing; install PostgreSQL and run it at $HOST:$PORT (user postgres, trust auth), or set DATABASE_URL"
	need_root "to install PostgreSQL"
	say "PostgreSQL is not installed; installing it with apt-get"
	as_root apt-get update -q >&2 || say "apt-get update failed; trying to install anyway"
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends postgresql >&2 ||
		die "apt-get install postgresql failed; install PostgreSQL by hand or set DATABASE_URL"
	[ -n "$(installed_version)" ] || die "PostgreSQL server binaries not found after installing; install PostgreSQL by hand or set DATABASE_URL"
	fresh=1
fi

# 2. Make sure a cluster exists.
cluster=$(pick_cluster)
if [ -z "$cluster" ]; then
	ver=$(installed_version)
	need_root "to create a cluster"
	say "creating PostgreSQL $ver cluster 'main' on port $PORT"
	as_root pg_createcluster -p "$PORT" "$ver" main >&2 ||
		die "pg_createcluster $ver main failed; create a cluster by hand or set DATABASE_URL"
	cluster=$(pick_cluster)
	[ -n "$cluster" ] || die "no PostgreSQL cluster found after pg_createcluster; check pg_lsclusters"
	fresh=1
fi
read -r ver name cport _status logfile <<<"$cluster"

# 3. Configure it when we set it up ourselves (leave a user's own cluster
#    alone unless it turns out to refuse password-less connections).
restart="" reload=""
if [ -n "$fresh" ]; then
	CHANGED=""
	ensure_trust "$(hba_file "$ver" "$name")"
	reload=$CHANGED
	CHANGED=""
	ensure_listen "$ver" "$name"
	restart=$CHANGED
fi

# 4. Start it (or apply the configuration if it is already running).
if [ "$cport" != "$PORT" ] && [ -z "$fresh" ]; then
	die "PostgreSQL cluster $ver/$name uses port $cport, not $PORT; set its port to $PORT (pg_conftool $ver $name set port $PORT) and restart it, or set DATABASE_URL"
fi
if cluster_running "$ver" "$name"; then
	if [ -n "$restart" ]; then
		say "restarting PostgreSQL $ver/$name"
		pgctl "$ver" "$name" restart || die "could not restart PostgreSQL $ver/$name; see $logfile"
	elif [ -n "$reload" ]; then
		pgctl "$ver" "$name" reload || true
	fi
else
	say "starting PostgreSQL $ver/$name"
	pgctl "$ver" "$name" start || die "could not start PostgreSQL $ver/$name; see $logfile and pg_lsclusters"
fi

# 5. Wait for it.
if ! wait_ready; then
	die "PostgreSQL did not accept connections at $HOST:$PORT within ${WAIT_SECONDS}s; see $logfile (pg_lsclusters shows its state), or set DATABASE_URL to a reachable server"
fi

# 6. Make sure postgres can log in without a password.
if have psql && ! can_query; then
	need_root "to allow password-less login for postgres"
	CHANGED=""
	ensure_trust "$(hba_file "$ver" "$name")"
	if [ -n "$CHANGED" ]; then
		pgctl "$ver" "$name" reload || true
		for _ in 1 2 3 4 5 6 7 8 9 10; do
			can_query && break
			sleep 0.3
		done
	fi
	if ! can_query; then
		err=$(PGCONNECT_TIMEOUT=3 psql -X -w -Atq -h "$HOST" -p "$PORT" -U postgres -d postgres -c 'select 1' 2>&1 >/dev/null | head -n1 || true)
		die "PostgreSQL is up at $HOST:$PORT but user postgres cannot log in without a password ($err); allow trust auth in $(hba_file "$ver" "$name") or set DATABASE_URL"
	fi
fi
say "PostgreSQL is ready at $HOST:$PORT"
