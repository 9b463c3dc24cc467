package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
)

// newLogger logs to stderr at level, as text or JSON.
func newLogger(level string, format ...string) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	opts := &slog.HandlerOptions{Level: l}
	if len(format) > 0 && format[0] == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// openDB opens a pool and checks the database answers, with a one-line
// error that says what to do when it does not.
func openDB(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL is not a valid PostgreSQL connection string: %w", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open database: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, dbError(cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Database, err)
	}
	return pool, nil
}

func dbError(host string, port uint16, db string, err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "3D000" {
		return fmt.Errorf("database %q does not exist on %s:%d: create it (createdb -h %s -U postgres %s) or point DATABASE_URL at another", db, host, port, host, db)
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("cannot reach PostgreSQL at %s:%d: start it (scripts/ensure-postgres.sh) or set DATABASE_URL", host, port)
	}
	return fmt.Errorf("cannot use PostgreSQL at %s:%d (%v): check DATABASE_URL", host, port, err)
}

// connectNATS connects with a one-line error that says what to do.
func connectNATS(url, name string) (*nats.Conn, error) {
	nc, err := nats.Connect(url, nats.Name(name), nats.Timeout(5*time.Second),
		nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))
	if err != nil {
		return nil, fmt.Errorf("cannot reach NATS at %s (%v): start nats-server with JetStream (nats-server -js) or set NATS_URL", url, err)
	}
	return nc, nil
}
