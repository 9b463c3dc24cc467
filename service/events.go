package service

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
)

// eventsCmd groups the commands on the events that start sagas
// (saga.WithEvents).
type eventsCmd struct {
	DeadLetters eventDeadLettersCmd `cmd:"" name:"dead-letters" default:"withargs" help:"List the events that could not start a saga (no key, a refused body), oldest first, with why."`
	Drop        eventDropCmd        `cmd:"" help:"Delete event dead letters (once the publisher sent them again, fixed, or nobody needs them)."`
}

type eventDeadLettersCmd struct {
	Definition string `help:"Only those of this definition."`
	Limit      int    `default:"100" help:"At most this many."`
	JSON       bool   `name:"json" help:"Print JSON."`
}

func (c *eventDeadLettersCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		dls, err := cl.EventDeadLetters(ctx, engine.EventDeadLetterFilter{Definition: c.Definition, Limit: c.Limit})
		if err != nil {
			return err
		}
		if c.JSON {
			if dls == nil {
				dls = []engine.EventDeadLetter{}
			}
			return printJSON(f.out, dls)
		}
		w := tabwriter.NewWriter(f.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "ID\tDEFINITION\tSTREAM\tSEQ\tSUBJECT\tKEY\tPARKED\tREASON")
		for _, d := range dls {
			key := d.Key
			if key == "" {
				key = "-"
			}
			fmt.Fprintf(w, "%d\t%s\t%s\t%d\t%s\t%s\t%s ago\t%s\n", d.ID, d.Definition, d.Stream, d.StreamSeq, d.Subject, key,
				time.Since(d.At).Round(time.Second), truncate(d.Reason, 80))
		}
		_ = w.Flush()
		fmt.Fprintf(f.out, "%d event dead letters\n", len(dls))
		return nil
	})
}

type eventDropCmd struct {
	IDs  []int64 `arg:"" name:"id" help:"Event dead-letter ids, as events dead-letters prints them."`
	JSON bool    `name:"json" help:"Print JSON."`
}

func (c *eventDropCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		if err := cl.DropEventDeadLetters(ctx, c.IDs...); err != nil {
			return err
		}
		if c.JSON {
			return printJSON(f.out, map[string]any{"dropped": c.IDs})
		}
		s := make([]string, len(c.IDs))
		for i, id := range c.IDs {
			s[i] = fmt.Sprint(id)
		}
		fmt.Fprintf(f.out, "dropped %d event dead letters: %s\n", len(c.IDs), strings.Join(s, ", "))
		return nil
	})
}
