package service

import (
	"context"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
)

// schedulesCmd groups the commands on schedules (saga.WithSchedule).
type schedulesCmd struct {
	List   schedulesListCmd  `cmd:"" default:"withargs" help:"List the recorded schedules: cron, last tick started, next tick, paused or not."`
	Pause  schedulePauseCmd  `cmd:"" help:"Stop a definition's schedule in every worker: it starts no saga, and the ticks that come due meanwhile are skipped."`
	Resume scheduleResumeCmd `cmd:"" help:"Let a paused schedule tick again, from the first tick after now."`
}

type schedulesListCmd struct {
	JSON bool `name:"json" help:"Print JSON."`
}

func (c *schedulesListCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		list, err := cl.Schedules(ctx)
		if err != nil {
			return err
		}
		if c.JSON {
			if list == nil {
				list = []engine.ScheduleInfo{}
			}
			return printJSON(f.out, list)
		}
		w := tabwriter.NewWriter(f.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "DEFINITION\tCRON\tLAST STARTED\tNEXT\tPAUSED")
		for _, s := range list {
			last, next, paused := "-", "-", "-"
			if s.LastStarted != nil {
				last = s.LastStarted.UTC().Format(time.RFC3339)
			}
			if s.Next != nil {
				next = s.Next.UTC().Format(time.RFC3339)
			}
			if s.Paused != nil {
				paused = fmt.Sprintf("since %s by %s: %s", s.Paused.Since.UTC().Format(time.RFC3339), s.Paused.By, truncate(s.Paused.Reason, 60))
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", s.Definition, s.Cron, last, next, paused)
		}
		_ = w.Flush()
		fmt.Fprintf(f.out, "%d schedules\n", len(list))
		return nil
	})
}

// scheduleRepairFlags are the flags of a schedule's pause and resume.
type scheduleRepairFlags struct {
	Definition string `arg:"" help:"The definition whose schedule to pause or resume."`
	Key        string `name:"request-key" help:"Key of this request: the same key sent again changes nothing and prints the first result (default: a new key)."`
	Reason     string `help:"Why, recorded with the request."`
	By         string `help:"Who asks, recorded with the request (default: $USER)."`
	JSON       bool   `name:"json" help:"Print JSON."`
}

type schedulePauseCmd struct{ scheduleRepairFlags }

func (c *schedulePauseCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, (*engine.Client).PauseSchedule, "paused: it starts no saga until resumed")
}

type scheduleResumeCmd struct{ scheduleRepairFlags }

func (c *scheduleResumeCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, (*engine.Client).ResumeSchedule, "resumed: it starts the ticks after now")
}

func (p *scheduleRepairFlags) run(ctx context.Context, f *Flags,
	do func(*engine.Client, context.Context, string, engine.Repair) (engine.ScheduleRepair, error), what string) error {
	rf := repairFlags{Key: p.Key, Reason: p.Reason, By: p.By}
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		res, err := do(cl, ctx, p.Definition, rf.repair())
		if err != nil {
			return err
		}
		if p.JSON {
			return printJSON(f.out, res)
		}
		if res.Replayed {
			fmt.Fprintf(f.out, "schedule of %s: already %sd by this request (key %s) at %s\n", res.Definition, res.Operation, res.Key, res.At.Format(time.RFC3339))
			return nil
		}
		fmt.Fprintf(f.out, "schedule of %s: %s (request key %s)\n", res.Definition, what, res.Key)
		return nil
	})
}
