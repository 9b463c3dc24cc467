# Sourced by the scripts that install packages (ensure-cc.sh,
# ensure-chromium.sh, prerequisites.sh); they define say and as_root first.

# apt_get_install PACKAGE... installs the packages with apt-get, without
# recommended packages, as root (as_root): running apt-get update first when
# the package lists are missing, or when the install fails without it. It
# returns apt-get install's status; its output goes to stderr.
apt_get_install() {
	local lists
	lists=$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -print -quit 2>/dev/null || true)
	if [ -z "$lists" ]; then
		as_root apt-get update -q >&2 || say "apt-get update failed; trying to install anyway"
	elif as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2; then
		return 0
	else
		say "apt-get install failed; running apt-get update and trying again"
		as_root apt-get update -q >&2 || say "apt-get update failed; trying to install anyway"
	fi
	as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@" >&2
}
