package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// pauseFlags are the flags of pause and resume: one saga, or a whole
// definition.
type pauseFlags struct {
	IDOrKey    string `arg:"" optional:"" name:"id-or-key" help:"Saga ID or idempotency key (or --definition)."`
	Definition string `name:"definition" help:"Every saga of this definition instead of one: those running and those started meanwhile."`
	Key        string `name:"request-key" help:"Key of this request: the same key sent again changes nothing and prints the first result (default: a new key)."`
	Reason     string `help:"Why, recorded with the repair."`
	By         string `help:"Who asks, recorded with the repair (default: $USER)."`
	JSON       bool   `name:"json" help:"Print JSON."`
}

type pauseCmd struct{ pauseFlags }

func (c *pauseCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "pause", (*engine.Client).PauseDefinition)
}

type resumeCmd struct{ pauseFlags }

func (c *resumeCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "resume", (*engine.Client).ResumeDefinition)
}

func (p *pauseFlags) run(ctx context.Context, f *Flags, op string,
	all func(*engine.Client, context.Context, string, engine.Repair) (engine.DefinitionRepair, error)) error {
	if (p.IDOrKey == "") == (p.Definition == "") {
		return errors.New("name one saga (its ID or key) or one definition (--definition NAME), not both")
	}
	rf := repairFlags{IDOrKey: p.IDOrKey, Key: p.Key, Reason: p.Reason, By: p.By, JSON: p.JSON}
	if p.IDOrKey != "" {
		return rf.run(ctx, f, op, engine.SkipStep{})
	}
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		res, err := all(cl, ctx, p.Definition, rf.repair())
		if err != nil {
			return err
		}
		if p.JSON {
			return printJSON(f.out, res)
		}
		what := map[string]string{"pause": "paused: its sagas start no attempt until it is resumed", "resume": "resumed: its sagas go on with the attempts they had"}[op]
		if res.Replayed {
			fmt.Fprintf(f.out, "definition %s: already %sd by this request (key %s) at %s\n", res.Definition, op, res.Key, res.At.Format(time.RFC3339))
			return nil
		}
		fmt.Fprintf(f.out, "definition %s: %s; %d running sagas (request key %s)\n", res.Definition, what, res.Sagas, res.Key)
		return nil
	})
}

// printPause prints why a saga is held, and its deadline.
func printPause(w io.Writer, sg *saga.Instance) {
	switch {
	case sg.Paused != nil && sg.Paused.Definition != "":
		fmt.Fprintf(w, "paused\tsince %s, with its definition (`resume --definition %s`)\n", sg.Paused.Since.Format(time.RFC3339), sg.Paused.Definition)
	case sg.Paused != nil:
		fmt.Fprintf(w, "paused\tsince %s (`resume %s`)\n", sg.Paused.Since.Format(time.RFC3339), sg.ID)
	}
	if sg.DeadlineAt != nil && sg.FinishedAt == nil {
		fmt.Fprintf(w, "deadline\t%s\n", sg.DeadlineAt.Format(time.RFC3339))
	}
}
