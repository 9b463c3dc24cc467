package testenv

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/migrations"
)

// PGServer is a PostgreSQL server of the test's own on a free loopback
// port, in a temporary folder, stopped and removed when the test ends.
// When the test runs as root the server runs as the postgres OS user,
// since PostgreSQL refuses to run as root.
type PGServer struct {
	t    testing.TB
	bin  string
	dir  string // data directory
	port int
	cred *syscall.Credential
}

// pgServerBinaries are the programs StartPGPrimary and StartStandby run.
var pgServerBinaries = []string{"initdb", "pg_ctl", "pg_basebackup", "postgres"}

// PGBinDir returns the folder of PostgreSQL's server binaries: pg_config
// --bindir, else /usr/lib/postgresql/15/bin. The error says what to install.
func PGBinDir() (string, error) {
	var dirs []string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		dirs = append(dirs, strings.TrimSpace(string(out)))
	}
	dirs = append(dirs, "/usr/lib/postgresql/15/bin")
	for _, d := range dirs {
		ok := true
		for _, b := range pgServerBinaries {
			if _, err := os.Stat(filepath.Join(d, b)); err != nil {
				ok = false
				break
			}
		}
		if ok {
			return d, nil
		}
	}
	return "", fmt.Errorf("PostgreSQL's server binaries (%s) were found neither by pg_config --bindir nor in /usr/lib/postgresql/15/bin: install the server package (Debian and Ubuntu: apt-get install postgresql-15, or postgresql)", strings.Join(pgServerBinaries, ", "))
}

// StartPGPrimary initialises and starts a server that accepts streaming
// replicas (trust authentication on loopback, fsync off: the tests crash
// its processes, never the machine).
func StartPGPrimary(t testing.TB) *PGServer {
	t.Helper()
	bin, err := PGBinDir()
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	s := &PGServer{t: t, bin: bin, port: freePort(t)}
	root := s.tempRoot()
	s.dir = filepath.Join(root, "primary")
	s.run(2*time.Minute, "initdb", "-D", s.dir, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync")
	s.writeConf("postgresql.conf", fmt.Sprintf(`
listen_addresses = '127.0.0.1'
port = %d
unix_socket_directories = '%s'
fsync = off
wal_level = replica
max_wal_senders = 10
wal_keep_size = '512MB'
shared_buffers = '64MB'
max_connections = 100
synchronous_commit = on
`, s.port, root))
	s.start()
	return s
}

// StartStandby makes a streaming replica of s with pg_basebackup, under
// application_name name (what synchronous_standby_names lists), starts it
// on a port of its own and waits until s streams to it.
func (s *PGServer) StartStandby(name string) *PGServer {
	s.t.Helper()
	r := &PGServer{t: s.t, bin: s.bin, port: freePort(s.t), cred: s.cred}
	r.dir = filepath.Join(filepath.Dir(s.dir), name)
	conninfo := fmt.Sprintf("host=127.0.0.1 port=%d user=postgres application_name=%s", s.port, name)
	r.run(2*time.Minute, "pg_basebackup", "-d", conninfo, "-D", r.dir, "-X", "stream", "-c", "fast", "-R", "--no-sync")
	r.writeConf("postgresql.auto.conf", fmt.Sprintf("\nport = %d\nprimary_conninfo = '%s'\n", r.port, conninfo))
	r.start()
	s.waitFor(30*time.Second, "select count(*) = 1 from pg_stat_replication where application_name = $1 and state = 'streaming'", name)
	return r
}

// SetSynchronous sets synchronous_standby_names on s (empty: asynchronous
// replication) and, if names is set, waits until a standby is synchronous.
func (s *PGServer) SetSynchronous(names string) {
	s.t.Helper()
	s.Exec("alter system set synchronous_standby_names = '" + strings.ReplaceAll(names, "'", "''") + "'")
	s.Exec("select pg_reload_conf()")
	if names != "" {
		s.waitFor(30*time.Second, "select count(*) > 0 from pg_stat_replication where sync_state in ('sync', 'quorum')")
	}
}

// WaitCaughtUp waits until the standby s replayed every WAL record the
// primary wrote so far.
func (s *PGServer) WaitCaughtUp(primary *PGServer) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, primary.URL("postgres"))
	if err != nil {
		s.t.Fatalf("testenv: connect to PostgreSQL at %s: %v", primary.Addr(), err)
	}
	defer conn.Close(ctx)
	var lsn string
	if err := conn.QueryRow(ctx, "select pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
		s.t.Fatalf("testenv: read the WAL position of %s: %v", primary.Addr(), err)
	}
	s.waitFor(30*time.Second, "select pg_last_wal_replay_lsn() >= $1::pg_lsn", lsn)
}

// StopStreaming has the standby s stop receiving WAL (an empty
// primary_conninfo): what its primary commits from now on never reaches it.
func (s *PGServer) StopStreaming() {
	s.t.Helper()
	s.Exec("alter system set primary_conninfo = ''")
	s.Exec("select pg_reload_conf()")
	s.waitFor(30*time.Second, "select count(*) = 0 from pg_stat_wal_receiver")
}

// Stop stops s with pg_ctl's mode: "immediate" is a crash (no checkpoint,
// clients cut), "fast" a clean shutdown.
func (s *PGServer) Stop(mode string) {
	s.t.Helper()
	s.run(time.Minute, "pg_ctl", "stop", "-D", s.dir, "-m", mode, "-w")
}

// Promote turns the standby s into a primary and waits until it accepts
// writes.
func (s *PGServer) Promote() {
	s.t.Helper()
	s.run(time.Minute, "pg_ctl", "promote", "-D", s.dir, "-w")
	s.waitFor(30*time.Second, "select not pg_is_in_recovery()")
}

// Addr is s's host:port.
func (s *PGServer) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// URL is the connection string of database db on s.
func (s *PGServer) URL(db string) string {
	return "postgres://postgres@" + s.Addr() + "/" + db + "?sslmode=disable"
}

// CreateDB creates database name on s with the engine's migrations and the
// process's own tables (WithTables) applied, and returns its URL.
func (s *PGServer) CreateDB(name string) string {
	s.t.Helper()
	s.Exec("create database " + name)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL(name))
	if err != nil {
		s.t.Fatalf("testenv: connect to %s: %v", name, err)
	}
	defer conn.Close(ctx)
	if err := migrations.Migrate(ctx, conn); err != nil {
		s.t.Fatalf("testenv: migrate %s: %v", name, err)
	}
	for _, m := range tables {
		if err := m(ctx, conn); err != nil {
			s.t.Fatalf("testenv: tables of %s: %v", name, err)
		}
	}
	return s.URL(name)
}

// Exec runs sql on s's postgres database.
func (s *PGServer) Exec(sql string, args ...any) {
	s.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL("postgres"))
	if err != nil {
		s.t.Fatalf("testenv: connect to PostgreSQL at %s: %v", s.Addr(), err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, sql, args...); err != nil {
		s.t.Fatalf("testenv: %s on %s: %v", sql, s.Addr(), err)
	}
}

// waitFor polls a query returning one boolean on s until it is true.
func (s *PGServer) waitFor(timeout time.Duration, sql string, args ...any) {
	s.t.Helper()
	deadline := time.Now().Add(timeout)
	var lastErr error
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		conn, err := pgx.Connect(ctx, s.URL("postgres"))
		if err == nil {
			var ok bool
			err = conn.QueryRow(ctx, sql, args...).Scan(&ok)
			conn.Close(ctx)
			if err == nil && ok {
				cancel()
				return
			}
		}
		cancel()
		lastErr = err
		time.Sleep(50 * time.Millisecond)
	}
	s.t.Fatalf("testenv: %q on %s not true after %s (last error: %v); log:\n%s", sql, s.Addr(), timeout, lastErr, s.log())
}

// tempRoot makes the folder of s's data directories, owned by the user
// the server runs as, removed when the test ends (after the servers
// stopped: cleanups run last-in first-out).
func (s *PGServer) tempRoot() string {
	s.t.Helper()
	root, err := os.MkdirTemp("", "idemsaga-pg-")
	if err != nil {
		s.t.Fatalf("testenv: %v", err)
	}
	s.t.Cleanup(func() { _ = os.RemoveAll(root) })
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			s.t.Fatalf("testenv: PostgreSQL refuses to run as root and there is no postgres user to run it as (%v): create one (useradd --system postgres) or run the tests as another user", err)
		}
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		if err := os.Chown(root, uid, gid); err != nil {
			s.t.Fatalf("testenv: %v", err)
		}
	}
	return root
}

func (s *PGServer) start() {
	s.t.Helper()
	s.run(time.Minute, "pg_ctl", "start", "-D", s.dir, "-l", s.dir+".log", "-w", "-t", "60")
	s.t.Cleanup(func() {
		// Already stopped by the test, or stopped now.
		cmd := s.command("pg_ctl", "stop", "-D", s.dir, "-m", "immediate", "-w")
		_ = cmd.Run()
	})
}

func (s *PGServer) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bin, name), args...)
	cmd.Dir = os.TempDir()
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
	}
	return cmd
}

func (s *PGServer) run(timeout time.Duration, name string, args ...string) {
	s.t.Helper()
	cmd := s.command(name, args...)
	timer := time.AfterFunc(timeout, func() {
		if cmd.Process != nil {
			_ = cmd.Process.Kill()
		}
	})
	out, err := cmd.CombinedOutput()
	timer.Stop()
	if err != nil {
		s.t.Fatalf("testenv: %s %s: %v\n%s\nserver log:\n%s", name, strings.Join(args, " "), err, out, s.log())
	}
}

func (s *PGServer) writeConf(file, text string) {
	s.t.Helper()
	f, err := os.OpenFile(filepath.Join(s.dir, file), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(text)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		s.t.Fatalf("testenv: write %s: %v", file, err)
	}
}

func (s *PGServer) log() string {
	b, _ := os.ReadFile(s.dir + ".log")
	if len(b) > 4000 {
		b = b[len(b)-4000:]
	}
	return string(b)
}

// freePort returns a loopback port nothing listens on now.
func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("testenv: find a free port: %v", err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
