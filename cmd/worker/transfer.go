package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

type transferCmd struct {
	From    int64         `required:"" help:"Source account."`
	To      int64         `required:"" help:"Destination account."`
	Amount  int64         `required:"" help:"Amount, in the smallest unit."`
	Key     string        `required:"" help:"Idempotency key: the business identifier of this transfer. Resending the same key and input returns the same saga."`
	Wait    bool          `help:"Wait for the saga to finish and print its final state (needs a running worker)."`
	Timeout time.Duration `default:"60s" help:"How long --wait waits."`
}

func (t *transferCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	in := transfer.Input{From: t.From, To: t.To, Amount: t.Amount}
	if err := in.Validate(); err != nil {
		return err
	}
	pool, err := openDB(ctx, g.DatabaseURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	return startAndWait(ctx, g, pool, transfer.Definition.Name(), "a transfer", t.Key, in, t.Wait, t.Timeout)
}

// startAndWait starts a saga of the named example under key, prints its
// ID, and with wait its final state.
func startAndWait(ctx context.Context, g *globals, pool *pgxpool.Pool, name, what, key string, in any, wait bool, timeout time.Duration) error {
	cl, def, err := g.client(pool, name)
	if err != nil {
		return err
	}
	if err := checkExamplesMigrated(ctx, pool); err != nil {
		return err
	}
	res, err := cl.Start(ctx, def, key, in)
	if err != nil {
		if errors.Is(err, saga.ErrIdempotencyKeyReused) {
			return fmt.Errorf("key %q already started %s with different details (saga %s); resend the original details or use a new key", key, what, res.ID)
		}
		return err
	}
	fmt.Println(res.ID)
	if res.Duplicate {
		fmt.Fprintf(os.Stderr, "key %q already names this saga (state %s); nothing new was started\n", key, res.State)
	}
	if !wait {
		return nil
	}
	wctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	sg, err := cl.Wait(wctx, res.ID)
	if err != nil {
		return fmt.Errorf("%w (is a worker running? start one with `worker run`)", err)
	}
	fmt.Println(sg.State)
	if sg.State != def.FinalState() {
		return &service.ExitError{Code: 3, Err: fmt.Errorf("saga %s ended %s, not %s: %s", sg.ID, sg.State, def.FinalState(), sg.Error)}
	}
	return nil
}
