package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

type listCmd struct {
	Definition string        `help:"Only sagas of this definition."`
	State      string        `help:"Only sagas in this state: init, compensating, compensated, failed, parked, or a step's (deducted, credited; reserved, charged, shipped)."`
	OlderThan  time.Duration `name:"older-than" help:"Only sagas created longer ago than this."`
	Stuck      bool          `help:"Only running sagas with no step in flight or an overdue lease or retry."`
	StuckAfter time.Duration `name:"stuck-after" default:"30s" help:"How overdue a lease or retry must be to count as stuck."`
	Limit      int           `default:"50" help:"At most this many, newest first."`
	JSON       bool          `name:"json" help:"Print JSON."`
}

func (l *listCmd) Run(ctx context.Context, g *globals) error {
	return withClient(ctx, g, func(cl *engine.Client) error { return l.list(ctx, cl) })
}

func (l *listCmd) list(ctx context.Context, cl *engine.Client) error {
	sagas, err := cl.List(ctx, engine.ListOptions{Definition: l.Definition, State: saga.State(l.State), OlderThan: l.OlderThan,
		Stuck: l.Stuck, StuckAfter: l.StuckAfter, Limit: l.Limit})
	if err != nil {
		return err
	}
	if l.JSON {
		if sagas == nil {
			sagas = []*saga.Instance{}
		}
		return printJSON(sagas)
	}
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "ID\tDEFINITION\tKEY\tSTATE\tAGE\tERROR")
	for _, sg := range sagas {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", sg.ID, sg.Definition, sg.Key, sg.State, time.Since(sg.CreatedAt).Round(time.Second), truncateText(sg.Error, 60))
	}
	if err := w.Flush(); err != nil {
		return err
	}
	fmt.Printf("%d sagas\n", len(sagas))
	return nil
}

type showCmd struct {
	IDOrKey string `arg:"" name:"id-or-key" help:"Saga ID or idempotency key."`
	JSON    bool   `name:"json" help:"Print JSON."`
}

func (s *showCmd) Run(ctx context.Context, g *globals) error {
	return withClient(ctx, g, func(cl *engine.Client) error {
		sg, err := cl.Lookup(ctx, s.IDOrKey)
		if err != nil {
			return err
		}
		if s.JSON {
			return printJSON(sg)
		}
		printSaga(sg)
		return nil
	})
}

type retryCmd struct {
	ID string `arg:"" help:"ID of a failed saga."`
}

func (r *retryCmd) Run(ctx context.Context, g *globals) error {
	return withSaga(ctx, g, r.ID, "worker list --state failed", func(cl *engine.Client, id uuid.UUID) error {
		if err := cl.Retry(ctx, id); err != nil {
			return err
		}
		fmt.Printf("saga %s: compensation resumed; follow it with `worker show %s`\n", id, id)
		return nil
	})
}

type cancelCmd struct {
	ID     string `arg:"" help:"ID of a running saga."`
	Reason string `help:"Why, recorded in the saga's error."`
}

func (c *cancelCmd) Run(ctx context.Context, g *globals) error {
	return withSaga(ctx, g, c.ID, "worker list", func(cl *engine.Client, id uuid.UUID) error {
		if err := cl.Cancel(ctx, id, c.Reason); err != nil {
			return err
		}
		fmt.Printf("saga %s: cancelled; its completed steps are being compensated\n", id)
		return nil
	})
}

// withSaga parses a saga ID, opens the database and runs fn with a client;
// hint says how to find a valid ID.
func withSaga(ctx context.Context, g *globals, arg, hint string, fn func(*engine.Client, uuid.UUID) error) error {
	id, err := uuid.Parse(arg)
	if err != nil {
		return fmt.Errorf("%q is not a saga ID (find it with `%s`)", arg, hint)
	}
	return withClient(ctx, g, func(cl *engine.Client) error { return fn(cl, id) })
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func truncateText(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}
