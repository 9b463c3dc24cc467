#!/usr/bin/env bash
# Makes sure the browser the console's end-to-end test drives
# (service/internal/console, headless Chromium through chromedp) is installed:
# Debian's `chromium` package at /usr/bin/chromium, or the binary that
# IDEMSAGA_CHROMIUM names.
#
# - If that browser exists, it exits 0 at once and prints nothing.
# - Otherwise, on a system with apt-get, as root or through sudo (sudo -n
#   when there is no terminal, so CI never waits for a password), it installs
#   Debian's package with `apt-get install -y --no-install-recommends
#   chromium` (running apt-get update first when the package lists are
#   missing, or when the install fails without it), and says so on stderr.
# - Otherwise it prints the command to run and exits 1.
# Browser downloads (Puppeteer's, Playwright's) are not used: the package
# comes from the distribution's own mirror.
#
# With --check (scripts/prerequisites.sh) it installs nothing: it prints
# nothing when the browser is there, prints "chromium<TAB>why" when
# installing the package is what is needed, and fails as above otherwise.
# IDEMSAGA_TEST_ROOT (the scripts' tests only) stands for / in
# /usr/bin/chromium.
set -euo pipefail

CHECK=""
[ "${1-}" = --check ] && CHECK=1

say() { echo "ensure-chromium: $*" >&2; }
die() { echo "ensure-chromium: $*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

if [ -n "${IDEMSAGA_CHROMIUM-}" ]; then
	[ -x "$IDEMSAGA_CHROMIUM" ] && exit 0
	die "IDEMSAGA_CHROMIUM is $IDEMSAGA_CHROMIUM, which is not an executable file; point it at a Chromium or Chrome binary, or unset it to use Debian's /usr/bin/chromium"
fi
CHROMIUM=${IDEMSAGA_TEST_ROOT-}/usr/bin/chromium
[ -x "$CHROMIUM" ] && exit 0

INSTALL="apt-get install -y --no-install-recommends chromium"
if ! have apt-get; then
	die "the console's browser test needs Chromium at $CHROMIUM, and this system has no apt-get; install Chromium or Chrome and set IDEMSAGA_CHROMIUM to its binary (on Debian: $INSTALL)"
fi
if [ -n "$CHECK" ]; then
	printf 'chromium\tthere is no browser at %s\n' "$CHROMIUM"
	exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
	if ! have sudo; then
		die "the console's browser test needs Chromium at $CHROMIUM, and installing it needs root (no sudo here); run as root: $INSTALL"
	fi
	if [ -t 0 ]; then
		SUDO="sudo"
	elif sudo -n true 2>/dev/null; then
		SUDO="sudo -n"
	else
		die "the console's browser test needs Chromium at $CHROMIUM, and installing it needs root (sudo wants a password and there is no terminal); run as root: $INSTALL"
	fi
fi
as_root() { $SUDO "$@"; }

say "the console's browser test needs Chromium at $CHROMIUM; installing Debian's chromium package with apt-get"
# shellcheck source=scripts/apt.sh
. "$(dirname "$0")/apt.sh"
apt_get_install chromium || die "apt-get could not install chromium; install it by hand (as root: apt-get update && $INSTALL), or set IDEMSAGA_CHROMIUM to a Chromium or Chrome binary"
[ -x "$CHROMIUM" ] || die "apt-get installed chromium, but $CHROMIUM is still missing (on Ubuntu the package only installs a snap); install Debian's or Google's build and set IDEMSAGA_CHROMIUM to its binary"
say "installed chromium with apt-get (--no-install-recommends); the console's browser test can run"
