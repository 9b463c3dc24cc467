// Package scripts_test runs the shell scripts that prepare a machine for
// `make test` and `make demo` against a fake Debian: a PATH in which gcc,
// psql, pg_ctlcluster and chromium are missing, go and id answer as the
// test says, and apt-get, apt-cache and sudo only record what they were
// asked. Nothing is installed.
package scripts_test

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// tools are the real commands the scripts use; everything else is a stub
// or missing.
var tools = []string{"bash", "sh", "env", "mktemp", "rm", "cat", "grep", "awk", "sed", "find", "head", "tail", "tr", "sort", "wc", "dirname", "cp", "sleep", "true"}

// fakeSystem is a PATH with the tools and stubs, an empty root standing
// for / (no /usr/bin/chromium, no /usr/lib/postgresql) and a port where no
// PostgreSQL answers.
type fakeSystem struct {
	t    *testing.T
	bin  string
	log  string
	env  []string
	root string
}

// stub writes an executable shell script named name into the fake PATH.
func (f *fakeSystem) stub(name, body string) {
	f.t.Helper()
	require.NoError(f.t, os.WriteFile(filepath.Join(f.bin, name), []byte("#!/bin/sh\n"+body+"\n"), 0o755))
}

func newFakeSystem(t *testing.T, uid int) *fakeSystem {
	t.Helper()
	dir := t.TempDir()
	f := &fakeSystem{t: t, bin: filepath.Join(dir, "bin"), log: filepath.Join(dir, "calls.log"), root: filepath.Join(dir, "root")}
	require.NoError(t, os.MkdirAll(f.bin, 0o755))
	require.NoError(t, os.MkdirAll(f.root, 0o755))
	for _, tool := range tools {
		path, err := exec.LookPath(tool)
		require.NoError(t, err, "the scripts' test needs %s", tool)
		require.NoError(t, os.Symlink(path, filepath.Join(f.bin, tool)))
	}
	f.stub("id", fmt.Sprintf(`[ "$1" = -u ] && echo %d`, uid))
	f.stub("uname", `echo Linux`)
	// Go as on a machine without a C compiler: cgo off by its own default.
	f.stub("go", `case "$*" in
"env CC") echo gcc ;;
"env CGO_ENABLED") echo "${CGO_ENABLED:-0}" ;;
"env -changed") ;;
*) exit 1 ;;
esac`)
	// apt-get simulates a package and one dependency each, and records
	// every call; a real run fails when STUB_APT_FAIL is set.
	f.stub("apt-get", `echo "apt-get $*" >>"$STUB_LOG"
case " $* " in
*" -s "*)
	[ -z "$STUB_APT_NO_LISTS" ] || exit 100
	for a in "$@"; do case $a in -*|install) ;; *) echo "Inst $a (1 Debian:12)"; echo "Inst lib$a (1 Debian:12)" ;; esac; done ;;
*) [ -z "$STUB_APT_FAIL" ] || exit 100 ;;
esac`)
	f.stub("apt-cache", `for a in "$@"; do case $a in -*|show) ;; *) printf 'Package: %s\nSize: 1500000\nInstalled-Size: 4000\n\n' "$a" ;; esac; done`)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	f.env = []string{"PATH=" + f.bin, "HOME=" + dir, "STUB_LOG=" + f.log, "IDEMSAGA_TEST_ROOT=" + f.root, fmt.Sprintf("IDEMSAGA_TEST_PG_PORT=%d", port)}
	return f
}

// run runs a script of this folder in the fake system and returns its
// stderr and exit status.
func (f *fakeSystem) run(script string, args ...string) (string, int) {
	f.t.Helper()
	cmd := exec.Command("./"+script, args...)
	cmd.Env = f.env
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	code := 0
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else {
		require.NoError(f.t, err)
	}
	require.Empty(f.t, stdout.String(), "the scripts write to stderr only")
	return stderr.String(), code
}

// calls returns what apt-get and sudo were asked, one call a line.
func (f *fakeSystem) calls() string {
	b, err := os.ReadFile(f.log)
	if errors.Is(err, os.ErrNotExist) {
		return ""
	}
	require.NoError(f.t, err)
	return string(b)
}

const allThree = "apt-get install -y --no-install-recommends gcc libc6-dev postgresql chromium"

// installs counts the apt-get runs that would install something.
func installs(calls string) int { return strings.Count(calls, "install -y -q --no-install-recommends") }

func TestPrerequisitesWithoutRootNameEverythingAtOnce(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 1000)
	out, code := f.run("prerequisites.sh")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "make test needs packages this machine lacks, and installing them needs root (no sudo here):")
	require.Contains(t, out, "  - a C compiler for go test -race (gcc is not installed): gcc libc6-dev, 4 packages, 6 MB to download, 16 MB on disk\n")
	require.Contains(t, out, "  - PostgreSQL, for the test's databases (nothing answers at 127.0.0.1:")
	require.Contains(t, out, "postgresql, 2 packages, 3 MB to download, 8 MB on disk; or set DATABASE_URL to a server of your own")
	require.Contains(t, out, "  - Chromium, for the web console's browser test (there is no browser at "+f.root+"/usr/bin/chromium): chromium, 2 packages, 3 MB to download, 8 MB on disk; it pulls in systemd; or set IDEMSAGA_CHROMIUM")
	require.Contains(t, out, "  together: 8 packages, 12 MB to download, 33 MB on disk\n")
	require.Contains(t, out, "install them all at once, as root: apt-get update && "+allThree+"\n")
	require.Equal(t, 0, installs(f.calls()), "only simulated: %s", f.calls())

	// The scripts on their own keep their behaviour: one piece, and stop.
	out, code = f.run("ensure-chromium.sh")
	require.Equal(t, 1, code)
	require.Contains(t, out, "installing it needs root (no sudo here); run as root: apt-get install -y --no-install-recommends chromium")
	out, code = f.run("ensure-cc.sh")
	require.Equal(t, 1, code)
	require.Contains(t, out, "gcc is not installed, and installing one needs root (no sudo here)")
	require.Equal(t, 0, installs(f.calls()))
}

func TestPrerequisitesSudoThatWantsAPassword(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 1000)
	f.stub("sudo", `echo "sudo $*" >>"$STUB_LOG"; exit 1`)
	out, code := f.run("prerequisites.sh", "demo")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "make demo needs packages this machine lacks, and installing them needs root (sudo wants a password and there is no terminal):")
	require.Contains(t, out, "  - PostgreSQL, for the demo's databases")
	require.NotContains(t, out, "together")
	require.Contains(t, out, "as root: apt-get update && apt-get install -y --no-install-recommends postgresql\n")
	require.Contains(t, f.calls(), "sudo -n true")
	require.Equal(t, 0, installs(f.calls()))
}

func TestPrerequisitesSizesWithoutPackageLists(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 1000)
	f.env = append(f.env, "STUB_APT_NO_LISTS=1")
	out, code := f.run("prerequisites.sh")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "chromium, 174 packages, 208 MB to download, 738 MB on disk; it pulls in systemd;")
	require.Contains(t, out, "gcc libc6-dev, 41 packages, 54 MB to download, 210 MB on disk\n")
	require.Contains(t, out, "  together: 235 packages, 315 MB to download, 1191 MB on disk (measured on a minimal Debian 12)\n")
}

func TestPrerequisitesAsRootInstallOnce(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 0)
	out, code := f.run("prerequisites.sh")
	require.Equal(t, 0, code, out)
	require.Contains(t, out, "installing them with one apt-get run:")
	require.Contains(t, out, "installed gcc libc6-dev postgresql chromium with apt-get")
	calls := f.calls()
	require.Equal(t, 1, installs(calls), calls)
	require.Contains(t, calls, "apt-get install -y -q --no-install-recommends gcc libc6-dev postgresql chromium\n")
}

func TestPrerequisitesThroughSudoRetryAfterUpdate(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 1000)
	f.stub("sudo", `echo "sudo $*" >>"$STUB_LOG"; [ "$1" = -n ] && shift; exec "$@"`)
	f.env = append(f.env, "STUB_APT_FAIL=1")
	out, code := f.run("prerequisites.sh")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "apt-get could not install gcc libc6-dev postgresql chromium; install them by hand (as root: apt-get update && "+allThree+")")
	calls := f.calls()
	require.Contains(t, calls, "sudo -n env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends gcc libc6-dev postgresql chromium")
	require.Contains(t, calls, "apt-get update -q")
	require.LessOrEqual(t, installs(calls), 4, "at most one run, and one again after apt-get update (each logged by sudo and apt-get)")
}

func TestPrerequisitesOverridesAndProblems(t *testing.T) {
	t.Parallel()
	f := newFakeSystem(t, 0)
	browser := filepath.Join(f.root, "chrome")
	require.NoError(t, os.WriteFile(browser, []byte("#!/bin/sh\n"), 0o755))
	base := f.env

	// A server elsewhere and a browser of one's own: only the compiler.
	f.env = append(base, "DATABASE_URL=postgres://app@db.internal:5432/app", "IDEMSAGA_CHROMIUM="+browser)
	out, code := f.run("prerequisites.sh")
	require.Equal(t, 0, code, out)
	require.Contains(t, f.calls(), "apt-get install -y -q --no-install-recommends gcc libc6-dev\n")
	out, code = f.run("prerequisites.sh", "demo")
	require.Equal(t, 0, code)
	require.Empty(t, out, "nothing missing: nothing said")

	// A problem no package solves is named with the packages, and
	// nothing is installed, even as root.
	before := installs(f.calls())
	f.env = append(base, "CGO_ENABLED=0", "IDEMSAGA_CHROMIUM="+filepath.Join(f.root, "nothing-here"))
	out, code = f.run("prerequisites.sh")
	require.Equal(t, 1, code, out)
	require.Contains(t, out, "make test needs packages this machine lacks (not installed while the problem below stands):")
	require.Contains(t, out, "  - PostgreSQL, for the test's databases")
	require.Contains(t, out, "ensure-cc: CGO_ENABLED is 0")
	require.Contains(t, out, "ensure-chromium: IDEMSAGA_CHROMIUM is "+filepath.Join(f.root, "nothing-here")+", which is not an executable file")
	require.Contains(t, out, "prerequisites: then run make test again")
	require.Equal(t, before, installs(f.calls()))
}
