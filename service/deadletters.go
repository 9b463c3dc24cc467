package service

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// deadLettersCmd groups the commands on parked commands.
type deadLettersCmd struct {
	List   deadLettersListCmd   `cmd:"" default:"withargs" help:"List parked commands, oldest first."`
	Resend deadLettersResendCmd `cmd:"" help:"Send parked commands again, whoever runs their version (nothing runs twice: each is one attempt of one step, fenced by its key)."`
	Drop   deadLettersDropCmd   `cmd:"" help:"Delete parked commands without sending them; their saga's step is driven again by its lease once a worker of its version runs."`
}

type deadLettersListCmd struct {
	Saga       string `help:"Only those of this saga (ID or idempotency key)."`
	Definition string `help:"Only those of this definition."`
	Version    int    `help:"Only those of this version of --definition."`
	Limit      int    `default:"100" help:"At most this many."`
	JSON       bool   `name:"json" help:"Print JSON."`
}

func (c *deadLettersListCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		filter := engine.DeadLetterFilter{Definition: c.Definition, Version: c.Version, Limit: c.Limit}
		if c.Version != 0 && c.Definition == "" {
			return fmt.Errorf("--version %d needs --definition: versions are per definition", c.Version)
		}
		if c.Saga != "" {
			sg, err := cl.Lookup(ctx, c.Saga)
			if err != nil {
				return err
			}
			filter.SagaID = sg.ID
		}
		dls, err := cl.DeadLetters(ctx, filter)
		if err != nil {
			return err
		}
		if c.JSON {
			if dls == nil {
				dls = []saga.DeadLetter{}
			}
			return printJSON(f.out, dls)
		}
		workers, werr := cl.Workers(ctx)
		printDeadLetters(f.out, dls)
		fmt.Fprintf(f.out, "%d parked commands\n", len(dls))
		if werr == nil {
			for _, ref := range unrunVersions(dls, workers) {
				fmt.Fprintf(f.errOut, "no live worker runs %s: start one with its code (it sends them again at start), or resend or drop them\n", ref)
			}
		}
		return nil
	})
}

// unrunVersions names the definition versions of dls no live worker runs.
func unrunVersions(dls []saga.DeadLetter, workers []engine.Worker) []string {
	run := map[string]bool{}
	for _, w := range workers {
		for _, v := range w.Versions {
			run[v] = true
		}
	}
	var out []string
	seen := map[string]bool{}
	for _, d := range dls {
		ref := saga.Ref(d.Definition, d.DefinitionVersion)
		if !run[ref] && !seen[ref] {
			seen[ref] = true
			out = append(out, ref)
		}
	}
	return out
}

func printDeadLetters(out interface{ Write([]byte) (int, error) }, dls []saga.DeadLetter) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tSAGA\tDEFINITION\tSTEP\tPHASE\tATTEMPT\tDELIVERIES\tPARKED\tREASON")
	for _, d := range dls {
		fmt.Fprintf(w, "%d\t%s\t%s\t%s\t%s\t%d\t%d\t%s ago\t%s\n", d.ID, d.SagaID, saga.Ref(d.Definition, d.DefinitionVersion), d.Step, d.Phase,
			d.Attempt, d.Deliveries, time.Since(d.LastSeen).Round(time.Second), truncate(d.Reason, 80))
	}
	_ = w.Flush()
}

// deadLetterIDs are the ids a resend or a drop takes.
type deadLetterIDs struct {
	IDs  []int64 `arg:"" name:"id" optional:"" help:"Dead-letter ids, as dead-letters list prints them."`
	Saga string  `help:"All those of this saga (ID or idempotency key)."`
	JSON bool    `name:"json" help:"Print JSON."`
}

// resolve returns the ids given, or those of --saga.
func (d *deadLetterIDs) resolve(ctx context.Context, cl *engine.Client) ([]int64, error) {
	if (len(d.IDs) == 0) == (d.Saga == "") {
		return nil, fmt.Errorf("give dead-letter ids or --saga, not both or neither; `dead-letters list` shows them")
	}
	if d.Saga == "" {
		return d.IDs, nil
	}
	sg, err := cl.Lookup(ctx, d.Saga)
	if err != nil {
		return nil, err
	}
	dls, err := cl.DeadLetters(ctx, engine.DeadLetterFilter{SagaID: sg.ID, Limit: 1000})
	if err != nil {
		return nil, err
	}
	if len(dls) == 0 {
		return nil, fmt.Errorf("%w: saga %s has no parked command", engine.ErrDeadLetterNotFound, sg.ID)
	}
	ids := make([]int64, len(dls))
	for i, dl := range dls {
		ids[i] = dl.ID
	}
	return ids, nil
}

func (d *deadLetterIDs) run(ctx context.Context, f *Flags, verb string, do func(*engine.Client, []int64) error) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		ids, err := d.resolve(ctx, cl)
		if err != nil {
			return err
		}
		if err := do(cl, ids); err != nil {
			return err
		}
		if d.JSON {
			return printJSON(f.out, map[string]any{verb: ids})
		}
		s := make([]string, len(ids))
		for i, id := range ids {
			s[i] = fmt.Sprint(id)
		}
		fmt.Fprintf(f.out, "%s %d dead letters: %s\n", verb, len(ids), strings.Join(s, ", "))
		return nil
	})
}

type deadLettersResendCmd struct{ deadLetterIDs }

func (c *deadLettersResendCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "resent", func(cl *engine.Client, ids []int64) error { return cl.ResendDeadLetters(ctx, ids...) })
}

type deadLettersDropCmd struct{ deadLetterIDs }

func (c *deadLettersDropCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "dropped", func(cl *engine.Client, ids []int64) error { return cl.DropDeadLetters(ctx, ids...) })
}
