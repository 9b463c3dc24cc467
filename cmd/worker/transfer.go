package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

type transferCmd struct {
	From    int64         `required:"" help:"Source account."`
	To      int64         `required:"" help:"Destination account."`
	Amount  int64         `required:"" help:"Amount, in the smallest unit."`
	Key     string        `required:"" help:"Idempotency key: the business identifier of this transfer. Resending the same key and input returns the same saga."`
	Wait    bool          `help:"Wait for the saga to finish and print its final state (needs a running worker)."`
	Timeout time.Duration `default:"60s" help:"How long --wait waits."`
}

func (t *transferCmd) Run(ctx context.Context, g *globals) error {
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
	return nil
}

func printSaga(sg *saga.Instance) {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "id\t%s\n", sg.ID)
	fmt.Fprintf(w, "definition\t%s\n", sg.Definition)
	fmt.Fprintf(w, "key\t%s\n", sg.Key)
	fmt.Fprintf(w, "state\t%s\n", sg.State)
	fmt.Fprintf(w, "version\t%d\n", sg.Version)
	fmt.Fprintf(w, "input\t%s\n", sg.Input)
	fmt.Fprintf(w, "created\t%s\n", sg.CreatedAt.Format(time.RFC3339Nano))
	if sg.FinishedAt != nil {
		fmt.Fprintf(w, "finished\t%s (%s)\n", sg.FinishedAt.Format(time.RFC3339Nano), sg.FinishedAt.Sub(sg.CreatedAt).Round(time.Millisecond))
	}
	if sg.Error != "" {
		fmt.Fprintf(w, "error\t%s\n", sg.Error)
	}
	_ = w.Flush()
	if len(sg.Steps) == 0 {
		return
	}
	fmt.Println()
	w = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "STEP\tKIND\tPHASE\tSTATUS\tATTEMPTS\tKEY\t")
	for _, st := range sg.Steps {
		note := ""
		if st.PossiblyDone {
			note = "possibly done: an attempt's outcome is unknown"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", st.Step, st.Kind, st.Phase, st.Status, st.Attempt, st.Key, note)
	}
	_ = w.Flush()
	if len(sg.Attempts) == 0 {
		return
	}
	fmt.Println("\ntimeline:")
	w = tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "AT\tSTEP\tPHASE\tATTEMPT\tOUTCOME\tTOOK\tERROR")
	for _, a := range sg.Attempts {
		took, outcome := "", a.Outcome
		if a.FinishedAt != nil {
			took = a.FinishedAt.Sub(a.DispatchedAt).Round(time.Millisecond).String()
		}
		if outcome == "" {
			outcome = "in flight"
		}
		fmt.Fprintf(w, "+%s\t%s\t%s\t%d\t%s\t%s\t%s\n", a.DispatchedAt.Sub(sg.CreatedAt).Round(time.Millisecond), a.Step, a.Phase, a.Attempt, outcome, took, truncateText(a.Error, 80))
	}
	_ = w.Flush()
}
