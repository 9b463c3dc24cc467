#!/usr/bin/env bash
# Finds every system package that `make test` (or, with the argument demo,
# `make demo`) needs and this machine lacks, before installing any:
#
#   test: a C compiler for -race (gcc, libc6-dev; scripts/ensure-cc.sh),
#         PostgreSQL (postgresql; scripts/ensure-postgres.sh) and Chromium
#         for the console's browser test (chromium; scripts/ensure-chromium.sh)
#   demo: PostgreSQL only
#
# Each ensure-*.sh script decides, with --check, whether its piece is
# missing (so DATABASE_URL pointing at another server means no PostgreSQL
# here, and IDEMSAGA_CHROMIUM names the browser to use instead).
#
# - If nothing is missing, it exits 0 at once and prints nothing.
# - Otherwise, on a system with apt-get, as root or through sudo (sudo -n
#   when there is no terminal, so CI never waits for a password), it
#   installs them all in one `apt-get install -y --no-install-recommends`
#   run (running apt-get update first when the package lists are missing,
#   or when the install fails without it), saying what and how large.
# - Otherwise it names every missing piece at once, with its download and
#   disk size and the one command that installs them together, and exits 1.
#   So does a problem that no package solves (CGO_ENABLED=0, say), which is
#   named with the rest.
#
# The ensure-*.sh scripts, run after it, set up and check each piece (the
# PostgreSQL cluster, its trust rule) and stay usable on their own.
set -euo pipefail

WHAT=${1:-test}
case $WHAT in
test) PIECES="cc postgres chromium" ;;
demo) PIECES="postgres" ;;
*)
	echo "usage: $0 [test|demo]" >&2
	exit 2
	;;
esac
DIR=$(cd "$(dirname "$0")" && pwd)

say() { echo "prerequisites: $*" >&2; }
die() { echo "prerequisites: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# What each piece is for, and what to do instead of installing it.
purpose() {
	case $1 in
	cc) echo "a C compiler for go test -race" ;;
	postgres) echo "PostgreSQL, for the $WHAT's databases" ;;
	chromium) echo "Chromium, for the web console's browser test" ;;
	esac
}
instead() {
	case $1 in
	postgres) echo "; or set DATABASE_URL to a server of your own (its user needs CREATEDB)" ;;
	chromium) echo "; or set IDEMSAGA_CHROMIUM to a Chromium or Chrome binary" ;;
	esac
}

# Sizes measured with apt-get on a minimal Debian 12 (a debootstrap
# minbase: the required packages and apt), --no-install-recommends; used
# when this machine's apt cannot tell.
static_size() {
	case $1 in
	cc) echo "41 packages, 54 MB to download, 210 MB on disk" ;;
	postgres) echo "37 packages, 76 MB to download, 321 MB on disk" ;;
	chromium) echo "174 packages, 208 MB to download, 738 MB on disk; it pulls in systemd" ;;
	all) echo "235 packages, 315 MB to download, 1191 MB on disk" ;;
	esac
}

# Prints "N packages, X MB to download, Y MB on disk" for installing the
# packages given on this machine, as apt-get would, or fails when its
# package lists cannot tell. Needs no root: apt-get only simulates.
apt_size() {
	local list n
	have apt-get && have apt-cache || return 1
	list=$(apt-get -s -qq install --no-install-recommends "$@" 2>/dev/null | awk '$1 == "Inst" { print $2 }') || return 1
	[ -n "$list" ] || return 1
	n=$(wc -w <<<"$list")
	# shellcheck disable=SC2086 # one package per word
	apt-cache show --no-all-versions $list 2>/dev/null | awk -v n="$n" '
		$1 == "Size:" { d += $2 }
		$1 == "Installed-Size:" { i += $2 }
		END {
			if (d == 0) exit 1
			printf "%d packages, %.0f MB to download, %.0f MB on disk\n", n, d / 1e6, i * 1024 / 1e6
		}'
}

# Ask each ensure script. Bash 3 (macOS) has no associative arrays: the
# i-th missing piece's packages and reason are mpkgs[i] and mwhy[i].
missing=() mpkgs=() mwhy=() problems=()
pkgs="" # all their packages
for piece in $PIECES; do
	errf=$(mktemp)
	if out=$(GO=${GO:-go} "$DIR/ensure-$piece.sh" --check 2>"$errf"); then
		if [ -n "$out" ]; then
			IFS=$'\t' read -r p why <<<"$out"
			missing+=("$piece")
			mpkgs+=("$p")
			mwhy+=("$why")
			pkgs="${pkgs:+$pkgs }$p"
		fi
	else
		problems+=("$(cat "$errf")")
	fi
	rm -f "$errf"
done
[ ${#missing[@]} -eq 0 ] && [ ${#problems[@]} -eq 0 ] && exit 0

INSTALL="apt-get install -y --no-install-recommends $pkgs"

# Can this process install packages?
SUDO=""
root_why=""
if [ "$(id -u)" -ne 0 ]; then
	if ! have sudo; then
		root_why="installing them needs root (no sudo here)"
	elif [ -t 0 ]; then
		SUDO="sudo"
	elif sudo -n true 2>/dev/null; then
		SUDO="sudo -n"
	else
		root_why="installing them needs root (sudo wants a password and there is no terminal)"
	fi
fi
as_root() { $SUDO "$@"; }

# Names every missing piece (one line each, with its size) and their total.
describe() {
	local i piece size total
	for i in "${!missing[@]}"; do
		piece=${missing[$i]}
		# shellcheck disable=SC2086 # one package per word
		size=$(apt_size ${mpkgs[$i]}) || size=$(static_size "$piece")
		case $piece in chromium) [[ $size == *systemd* ]] || size="$size; it pulls in systemd" ;; esac
		echo "  - $(purpose "$piece") (${mwhy[$i]}): ${mpkgs[$i]}, $size$(instead "$piece")" >&2
	done
	if [ ${#missing[@]} -gt 1 ]; then
		# shellcheck disable=SC2086 # one package per word
		if total=$(apt_size $pkgs); then
			echo "  together: $total" >&2
		elif [ ${#missing[@]} -eq 3 ]; then
			echo "  together: $(static_size all) (measured on a minimal Debian 12)" >&2
		else
			echo "  together: less than the sum (they share libraries)" >&2
		fi
	fi
}

if [ ${#problems[@]} -gt 0 ] || [ -n "$root_why" ]; then
	if [ ${#missing[@]} -gt 0 ]; then
		if [ -n "$root_why" ]; then
			say "make $WHAT needs packages this machine lacks, and $root_why:"
		else
			say "make $WHAT needs packages this machine lacks (not installed while the problem below stands):"
		fi
		describe
		say "install them all at once, as root: apt-get update && $INSTALL"
	fi
	# Bash 3 calls an empty array unbound under set -u.
	[ ${#problems[@]} -eq 0 ] || for p in "${problems[@]}"; do
		echo "$p" >&2
	done
	die "then run make $WHAT again"
fi

say "make $WHAT needs packages this machine lacks; installing them with one apt-get run:"
describe
# shellcheck source=scripts/apt.sh
. "$DIR/apt.sh"
# shellcheck disable=SC2086 # one package per word
apt_get_install $pkgs || die "apt-get could not install $pkgs; install them by hand (as root: apt-get update && $INSTALL)"
say "installed $pkgs with apt-get (--no-install-recommends)"
