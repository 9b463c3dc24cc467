package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

// freshDatabase drops and creates database name on the DATABASE_URL
// server, applies the migrations and returns its connection string with a
// pool of maxConns connections. The demo, chaos and bench commands start
// from one each run.
func freshDatabase(ctx context.Context, g *globals, name string, maxConns int32) (string, *pgxpool.Pool, error) {
	if !validDBName(name) {
		return "", nil, fmt.Errorf("--db-name %q must be lowercase letters, digits and '_'", name)
	}
	admin, err := openDB(ctx, g.DatabaseURL, 1)
	if err != nil {
		return "", nil, err
	}
	defer admin.Close()
	for _, q := range []string{"drop database if exists " + name + " with (force)", "create database " + name} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return "", nil, fmt.Errorf("prepare database %q: %w (the DATABASE_URL user needs CREATEDB)", name, err)
		}
	}
	dsn, err := withDBName(g.DatabaseURL, name)
	if err != nil {
		return "", nil, err
	}
	pool, err := openDB(ctx, dsn, maxConns)
	if err != nil {
		return "", nil, err
	}
	if err := migrateAll(ctx, pool); err != nil {
		pool.Close()
		return "", nil, err
	}
	return dsn, pool, nil
}

// embeddedNATS starts a JetStream server on a free loopback port, storing
// in a new temporary folder; cleanup stops it and removes the folder. The
// folder is returned for a harness that restarts the server on it.
func embeddedNATS(prefix string) (ns *natsserver.Server, dir string, cleanup func(), err error) {
	dir, err = os.MkdirTemp("", prefix)
	if err != nil {
		return nil, "", nil, err
	}
	ns, err = startEmbeddedNATS(filepath.Join(dir, "nats"), -1)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, "", nil, err
	}
	return ns, dir, func() { ns.Shutdown(); ns.WaitForShutdown(); _ = os.RemoveAll(dir) }, nil
}

// startPools starts n in-process engines on database dsn and the NATS
// server at natsURL, each with its own connection pool of maxConns and its
// own NATS connection; configure sets the rest of pool i's Config. stop
// drains them all and closes their connections.
func startPools(ctx context.Context, n int, dsn, natsURL string, maxConns int32, configure func(i int, cfg *engine.Config)) (engines []*engine.Engine, stop func(), err error) {
	var closers []func()
	stop = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	for i := range n {
		p, err := openDB(ctx, dsn, maxConns)
		if err != nil {
			stop()
			return nil, nil, err
		}
		closers = append(closers, p.Close)
		nc, err := connectNATS(natsURL, fmt.Sprintf("pool-%d", i+1))
		if err != nil {
			stop()
			return nil, nil, err
		}
		closers = append(closers, nc.Close)
		cfg := engine.Config{Pool: p, NATS: nc, Definitions: []*saga.Definition{transfer.Definition}}
		configure(i, &cfg)
		e, err := engine.New(cfg)
		if err == nil {
			err = e.Start(ctx)
		}
		if err != nil {
			stop()
			return nil, nil, err
		}
		closers = append(closers, func() {
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = e.Stop(sctx)
		})
		engines = append(engines, e)
	}
	return engines, stop, nil
}

// redeliverCommands publishes a copy of a fraction of the commands (every
// one for 1) under a new message id, as a broker redelivery would: the
// broker cannot drop them and the step workers' inbox must. stop waits for
// the copies in flight.
func redeliverCommands(url, prefix string, fraction float64) (stop func(), err error) {
	nc, err := connectNATS(url, "redeliverer")
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	var n atomic.Int64
	every := max(1, int64(math.Round(1/fraction)))
	// Copies are published without waiting for each ack (a copy the
	// broker refused is just one duplicate fewer), so the copier costs
	// the process little beside the engine it measures.
	sub, err := nc.Subscribe(prefix+".cmd.>", func(m *nats.Msg) {
		if m.Header.Get("X-Idemsaga-Copy") != "" || n.Add(1)%every != 0 {
			return
		}
		c := nats.NewMsg(m.Subject)
		c.Data = m.Data
		c.Header.Set("X-Idemsaga-Copy", "1")
		_, _ = js.PublishMsgAsync(c, jetstream.WithMsgID("copy-"+m.Header.Get(nats.MsgIdHdr)))
	})
	if err != nil {
		nc.Close()
		return nil, err
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			_ = sub.Unsubscribe()
			select {
			case <-js.PublishAsyncComplete():
			case <-time.After(10 * time.Second):
			}
			nc.Close()
		})
	}, nil
}

// deleteStream removes a stream a run made on an external server; what
// fails is only reported.
func deleteStream(url, stream string) {
	nc, err := connectNATS(url, "cleanup")
	if err != nil {
		fmt.Printf("bench: stream %s left on %s: %v\n", stream, url, err)
		return
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err == nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err = js.DeleteStream(ctx, stream)
	}
	if err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		fmt.Printf("bench: stream %s left on %s: %v\n", stream, url, err)
	}
}
