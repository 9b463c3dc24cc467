#!/usr/bin/env bash
# Makes sure `go test -race` (what `make test` runs) can build here. The race
# detector needs cgo: CGO_ENABLED must not be 0, and the C compiler Go uses
# (`go env CC`, gcc by default) must be installed together with the C
# library's headers. Go turns cgo off by itself when it finds no compiler,
# which is why -race fails on a machine that has only Go.
#
# - If cgo is on and the compiler builds and links a small C program, it
#   exits 0 at once and prints nothing.
# - Otherwise, on Debian/Ubuntu as root or through sudo (sudo -n when there is
#   no terminal, so CI never waits for a password), it installs gcc and
#   libc6-dev with `apt-get install -y --no-install-recommends` (running
#   apt-get update first when the package lists are missing, or when the
#   install fails without it), and says so on stderr.
# - Otherwise it fails, saying what to install (apt-get install gcc
#   libc6-dev; on macOS xcode-select --install) and that CGO_ENABLED must not
#   be 0.
# It never changes CGO_ENABLED or CC: when either is set to something that
# cannot work, it says so and stops.
#
# With --check (scripts/prerequisites.sh) it installs nothing: it prints
# nothing when the compiler works, prints "gcc libc6-dev<TAB>why" when
# installing them is what is needed, and fails as above otherwise.
set -euo pipefail

CHECK=""
[ "${1-}" = --check ] && CHECK=1

GO=${GO:-go}

say() { echo "ensure-cc: $*" >&2; }
die() { echo "ensure-cc: $*" >&2; exit 1; }
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

have "$GO" || die "$GO is not on PATH; install Go first"

# The command that installs a C compiler and the C library's headers here.
install_cmd() {
	if [ "$(uname -s)" = Darwin ]; then
		echo "xcode-select --install"
	elif have apt-get; then
		echo "apt-get install gcc libc6-dev"
	else
		echo "apt-get install gcc libc6-dev (Debian/Ubuntu) or xcode-select --install (macOS)"
	fi
}
KEEP="Keep CGO_ENABLED unset or 1, not 0: go test -race needs cgo."

tmp=""
trap '[ -z "$tmp" ] || rm -rf "$tmp"' EXIT

CC_LINE=""
CC_NAME=""
CC_ERR=""
# Reads `go env CC` into CC_LINE (the whole command) and CC_NAME (the
# program); gcc when empty.
read_cc() {
	CC_LINE=$("$GO" env CC)
	CC_NAME=${CC_LINE%% *}
	if [ -z "$CC_NAME" ]; then
		CC_LINE=gcc
		CC_NAME=gcc
	fi
}

# Succeeds when the compiler builds and links a C program using the headers
# runtime/cgo needs; otherwise sets CC_ERR to why not.
cc_works() {
	local -a cc
	CC_ERR=""
	if ! have "$CC_NAME"; then
		CC_ERR="$CC_NAME is not installed"
		return 1
	fi
	[ -n "$tmp" ] || tmp=$(mktemp -d)
	printf '#include <pthread.h>\n#include <stdlib.h>\nint main(void) { return 0; }\n' >"$tmp/t.c"
	read -r -a cc <<<"$CC_LINE"
	if ! "${cc[@]}" -o "$tmp/t" "$tmp/t.c" -lpthread >"$tmp/err" 2>&1; then
		CC_ERR="$CC_LINE cannot build a C program ($(grep -m1 -iE 'error|not found|cannot' "$tmp/err" || head -n1 "$tmp/err"))"
		return 1
	fi
}

# Succeeds when CGO_ENABLED=0 was asked for (in the environment or with
# go env -w), as opposed to Go's own default when it finds no compiler.
cgo_forced_off() {
	[ "${CGO_ENABLED-}" = 0 ] && return 0
	"$GO" env -changed 2>/dev/null | grep -Eq "^(set )?CGO_ENABLED='?0'?\$"
}

# Fast path: already fine.
read_cc
cgo=$("$GO" env CGO_ENABLED)
if [ "$cgo" = 1 ] && cc_works; then
	exit 0
fi

if cgo_forced_off; then
	msg="CGO_ENABLED is 0 (in the environment or set with go env -w), but go test -race needs cgo; unset it (unset CGO_ENABLED; go env -u CGO_ENABLED) or set CGO_ENABLED=1."
	cc_works || msg="$msg Also $CC_ERR: install it with $(install_cmd)."
	die "$msg"
fi

# cgo is off because Go found no compiler, or the compiler does not work.
if cc_works; then
	# Not a missing compiler: GOOS/GOARCH for another system, for example.
	die "go env CGO_ENABLED is $cgo although $CC_LINE works; is GOOS or GOARCH set for another system? $KEEP"
fi
case $CC_NAME in
gcc | cc | /usr/bin/gcc | /usr/bin/cc) ;;
*)
	# Installing gcc would not change what Go runs.
	die "go test -race needs cgo and the C compiler that go env CC names, but $CC_ERR; install it, or unset CC to use gcc ($(install_cmd)). $KEEP"
	;;
esac
if [ "$(uname -s)" = Darwin ] || ! have apt-get; then
	die "go test -race needs cgo and a C compiler, but $CC_ERR; install one: $(install_cmd). $KEEP"
fi
if [ -n "$CHECK" ]; then
	printf 'gcc libc6-dev\t%s\n' "$CC_ERR"
	exit 0
fi
if [ "$(id -u)" -ne 0 ] && [ -z "$SUDO" ]; then
	die "go test -race needs cgo and a C compiler, but $CC_ERR, and installing one needs root (no sudo here); run as root: $(install_cmd). $KEEP"
fi
if [ "$SUDO" = "sudo -n" ] && ! sudo -n true 2>/dev/null; then
	die "go test -race needs cgo and a C compiler, but $CC_ERR, and installing one needs root (sudo wants a password and there is no terminal); run as root: $(install_cmd). $KEEP"
fi

say "go test -race needs cgo and a C compiler, but $CC_ERR; installing gcc and libc6-dev with apt-get"
# shellcheck source=scripts/apt.sh
. "$(dirname "$0")/apt.sh"
apt_get_install gcc libc6-dev || die "apt-get install gcc libc6-dev failed; install them by hand: $(install_cmd). $KEEP"

read_cc
cgo=$("$GO" env CGO_ENABLED)
if ! cc_works; then
	die "installed gcc and libc6-dev, but $CC_ERR; install a working C compiler by hand ($(install_cmd)). $KEEP"
fi
if [ "$cgo" != 1 ]; then
	die "installed gcc and libc6-dev, but go env CGO_ENABLED is still $cgo. $KEEP"
fi
say "installed gcc and libc6-dev with apt-get (--no-install-recommends); go test -race can build now"
