// Package exampleenv gives the packages' runnable examples what a test
// gets from testenv, without a *testing.T: a fresh database with the
// engine's tables on the server of DATABASE_URL, and an in-process NATS
// server with JetStream. Failures panic: an example has no other way to
// fail.
package exampleenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/idemsaga/idemsaga/migrations"
)

func adminURL() string {
	if v := os.Getenv("DATABASE_URL"); v != "" {
		return v
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// Env is one example's infrastructure.
type Env struct {
	Pool *pgxpool.Pool
	// URL is the database's connection string.
	URL  string
	NATS *nats.Conn
	// NATSURL is the server's client URL.
	NATSURL string
	stop    []func()
}

// New creates the database (engine tables migrated) and the NATS server.
func New() *Env {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	name := "idemsaga_example_" + hex.EncodeToString(b)
	// Read once: an example may point DATABASE_URL at this database.
	server := adminURL()
	admin, err := pgx.Connect(ctx, server)
	must(err)
	_, err = admin.Exec(ctx, "create database "+name)
	must(err)
	must(admin.Close(ctx))
	cfg, err := pgxpool.ParseConfig(server)
	must(err)
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	must(err)
	conn, err := pool.Acquire(ctx)
	must(err)
	must(migrations.Migrate(ctx, conn.Conn()))
	conn.Release()
	e := &Env{Pool: pool, URL: fmt.Sprintf("postgres://%s@%s:%d/%s?sslmode=disable", cfg.ConnConfig.User, cfg.ConnConfig.Host, cfg.ConnConfig.Port, name)}
	e.stop = append(e.stop, func() {
		pool.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if admin, err := pgx.Connect(ctx, server); err == nil {
			_, _ = admin.Exec(ctx, "drop database if exists "+name+" with (force)")
			_ = admin.Close(ctx)
		}
	})
	dir, err := os.MkdirTemp("", "idemsaga-example-nats")
	must(err)
	srv, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	must(err)
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		panic("exampleenv: nats server did not become ready")
	}
	e.NATSURL = srv.ClientURL()
	e.NATS, err = nats.Connect(e.NATSURL, nats.MaxReconnects(-1))
	must(err)
	e.stop = append(e.stop, func() {
		e.NATS.Close()
		srv.Shutdown()
		srv.WaitForShutdown()
		_ = os.RemoveAll(dir)
	})
	return e
}

// Close drops the database and stops the server.
func (e *Env) Close() {
	for i := len(e.stop) - 1; i >= 0; i-- {
		e.stop[i]()
	}
}

func must(err error) {
	if err != nil {
		panic(fmt.Sprintf("exampleenv: %v (examples need PostgreSQL at DATABASE_URL)", err))
	}
}
