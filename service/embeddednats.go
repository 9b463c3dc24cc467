package service

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
)

// startEmbeddedNATS starts a JetStream server in this process on
// 127.0.0.1:port (0: a free port), storing in dir, which it creates when
// missing. Its warnings and errors go to log. The error says what to do.
func startEmbeddedNATS(dir string, port int, log *slog.Logger) (*natsserver.Server, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("--embedded-nats %s: cannot create the folder (%v): give a folder this user can write", dir, errors.Unwrap(err))
	}
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	if port != 0 {
		// Checked first for the message: the server itself reports a
		// taken port only in its log.
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return nil, fmt.Errorf("--embedded-nats: cannot listen on %s (%v): something holds the port, often a nats-server (Debian's nats-server package runs one as a systemd service, without JetStream: systemctl stop nats-server); stop it, or give --embedded-nats-port 0 for a free port", addr, errors.Unwrap(err))
		}
		_ = ln.Close()
	} else {
		port = natsserver.RANDOM_PORT
	}
	srv, err := natsserver.NewServer(&natsserver.Options{
		Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoSigs: true,
	})
	if err != nil {
		return nil, fmt.Errorf("--embedded-nats %s: %w", dir, err)
	}
	nl := &natsLogger{log: log}
	srv.SetLoggerV2(nl, false, false, false)
	srv.Start() // returns after listening, or after a fatal error
	if err := nl.fatalErr(); err != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, fmt.Errorf("--embedded-nats %s: the NATS server did not start: %w", dir, err)
	}
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		srv.WaitForShutdown()
		return nil, fmt.Errorf("--embedded-nats %s: the NATS server did not accept connections within 10s on %s", dir, addr)
	}
	return srv, nil
}

// natsLogger hands the embedded server's log to slog: notices at debug,
// warnings and errors as such. It keeps the first fatal error, which the
// server only logs.
type natsLogger struct {
	log   *slog.Logger
	mu    sync.Mutex
	fatal error
}

func (l *natsLogger) Noticef(format string, v ...any) { l.at(slog.LevelDebug, format, v) }
func (l *natsLogger) Warnf(format string, v ...any)   { l.at(slog.LevelWarn, format, v) }
func (l *natsLogger) Errorf(format string, v ...any)  { l.at(slog.LevelError, format, v) }
func (l *natsLogger) Debugf(format string, v ...any)  { l.at(slog.LevelDebug, format, v) }
func (l *natsLogger) Tracef(format string, v ...any)  { l.at(slog.LevelDebug, format, v) }

func (l *natsLogger) at(level slog.Level, format string, v []any) {
	l.log.Log(context.Background(), level, "nats: "+fmt.Sprintf(format, v...))
}

func (l *natsLogger) Fatalf(format string, v ...any) {
	l.at(slog.LevelError, format, v)
	msg := fmt.Sprintf(format, v...)
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.fatal == nil {
		l.fatal = errors.New(msg)
	}
}

func (l *natsLogger) fatalErr() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fatal
}
