package service

import (
	"context"
	"encoding/json"
	"fmt"
	"os/user"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// repairFlags are the flags of retry, cancel, skip and close: one saga,
// or (without one) every saga a filter matches.
type repairFlags struct {
	IDOrKey string `arg:"" optional:"" name:"id-or-key" help:"Saga ID or idempotency key. Leave it out and give --definition or --state to repair every saga they match."`
	Key     string `name:"request-key" help:"Key of this request: the same key sent again changes nothing and prints the first result (default: a new key, printed). In bulk, each saga's repair is recorded under this key and the saga's ID."`
	Reason  string `help:"Why, recorded with the repair (and, for cancel, in the saga's error)."`
	By      string `help:"Who asks, recorded with the repair (default: $USER)."`
	JSON    bool   `name:"json" help:"Print JSON."`

	Definition string        `help:"Bulk: the sagas of this definition."`
	State      string        `help:"Bulk: the sagas in this state."`
	OlderThan  time.Duration `name:"older-than" help:"Bulk: only sagas created longer ago than this."`
	Limit      int           `default:"100" help:"Bulk: at most this many sagas, newest first (at most 1000); continue with --cursor."`
	Cursor     string        `help:"Bulk: continue after the last saga of a previous run (printed as next_cursor)."`
	DryRun     bool          `name:"dry-run" help:"Bulk: list the sagas and what the repair would do to each, changing nothing."`
}

func (r *repairFlags) repair() engine.Repair {
	by := r.By
	if by == "" {
		if u, err := user.Current(); err == nil {
			by = u.Username
		}
	}
	return engine.Repair{Key: r.Key, Reason: r.Reason, By: "cli:" + by}
}

type retryCmd struct{ repairFlags }

func (c *retryCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "retry", engine.SkipStep{})
}

type cancelCmd struct{ repairFlags }

func (c *cancelCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "cancel", engine.SkipStep{})
}

type closeCmd struct{ repairFlags }

func (c *closeCmd) Run(ctx context.Context, f *Flags) error {
	return c.run(ctx, f, "close", engine.SkipStep{})
}

type skipCmd struct {
	repairFlags
	Step   string `required:"" help:"The step to skip: the saga's step in flight, or the one it parked or failed on (see show)."`
	Result string `default:"null" help:"The step's result as JSON, @file or - for stdin: what the next steps read as its result."`
}

func (c *skipCmd) Run(ctx context.Context, f *Flags) error {
	result, err := readInput(c.Result)
	if err != nil {
		return err
	}
	return c.run(ctx, f, "skip", engine.SkipStep{Step: c.Step, Result: json.RawMessage(result)})
}

var repairDone = map[string]string{"retry": "resumed", "cancel": "cancelled", "skip": "step skipped", "close": "closed as handled", "pause": "paused", "resume": "resumed from its pause"}

// run repairs one saga, or every saga the filter matches, and says who
// will carry the work out: the steps run in a worker that has the
// definition's code, which may not be this process.
func (r *repairFlags) run(ctx context.Context, f *Flags, op string, skip engine.SkipStep) error {
	bulk := r.Definition != "" || r.State != "" || r.OlderThan != 0 || r.Cursor != "" || r.DryRun
	switch {
	case r.IDOrKey != "" && bulk:
		return fmt.Errorf("give a saga (ID or key) or a filter (--definition, --state), not both")
	case r.IDOrKey == "" && !bulk:
		return fmt.Errorf("give a saga's ID or key, or --definition and/or --state to %s every saga they match (try --dry-run first)", op)
	case r.IDOrKey == "" && r.Definition == "" && r.State == "":
		return fmt.Errorf("a bulk %s needs --definition or --state to select its sagas", op)
	}
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		if bulk {
			return r.bulk(ctx, f, cl, op, skip)
		}
		sg, err := cl.Lookup(ctx, r.IDOrKey)
		if err != nil {
			return err
		}
		var res engine.RepairResult
		switch op {
		case "retry":
			res, err = cl.Retry(ctx, sg.ID, r.repair())
		case "cancel":
			res, err = cl.Cancel(ctx, sg.ID, r.repair())
		case "skip":
			res, err = cl.Skip(ctx, sg.ID, skip, r.repair())
		case "close":
			res, err = cl.Close(ctx, sg.ID, r.repair())
		case "pause":
			res, err = cl.Pause(ctx, sg.ID, r.repair())
		case "resume":
			res, err = cl.Resume(ctx, sg.ID, r.repair())
		}
		if err != nil {
			return err
		}
		runs, known := liveWorker(ctx, cl, saga.Ref(sg.Definition, sg.DefinitionVersion))
		if r.JSON {
			return printJSON(f.out, map[string]any{"id": res.ID, "operation": res.Operation, "state": res.State, "key": res.Key,
				"at": res.At, "replayed": res.Replayed, "worker_running": runs})
		}
		what := repairDone[op]
		if res.Replayed {
			fmt.Fprintf(f.out, "saga %s: already %s by this request (key %s) at %s; now %s\n", sg.ID, what, res.Key, res.At.Format(time.RFC3339), res.State)
		} else {
			fmt.Fprintf(f.out, "saga %s: %s; now %s (request key %s)\n", sg.ID, what, res.State, res.Key)
		}
		def, derr := cl.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion)
		if derr == nil && !def.IsTerminal(res.State) && known && !runs {
			fmt.Fprintf(f.errOut, "no live worker runs definition %q version %d: its steps wait in the outbox until one starts (`%s run` with that definition version)\n", sg.Definition, sg.DefinitionVersion, name(*f.cfg))
		}
		return nil
	})
}

// liveWorker reports whether a live worker runs the definition version
// ref ("name@version"), and whether that could be told.
func liveWorker(ctx context.Context, cl *engine.Client, ref string) (runs, known bool) {
	workers, err := cl.Workers(ctx)
	if err != nil {
		return false, false
	}
	return slices.ContainsFunc(workers, func(w engine.Worker) bool { return slices.Contains(w.Versions, ref) }), true
}

// bulkItem is one saga of a bulk repair in --json.
type bulkItem struct {
	ID         uuid.UUID  `json:"id"`
	Definition string     `json:"definition"`
	Before     saga.State `json:"before"`
	State      saga.State `json:"state,omitempty"`
	Key        string     `json:"key"`
	Replayed   bool       `json:"replayed,omitempty"`
	Error      string     `json:"error,omitempty"`
}

func (r *repairFlags) bulk(ctx context.Context, f *Flags, cl *engine.Client, op string, skip engine.SkipStep) error {
	res, err := cl.Bulk(ctx, engine.BulkRepair{Operation: op, Skip: skip, Repair: r.repair(), DryRun: r.DryRun,
		Filter: engine.ListOptions{Definition: r.Definition, State: saga.State(r.State), OlderThan: r.OlderThan, Limit: r.Limit, Cursor: r.Cursor}})
	if err != nil && len(res.Items) == 0 {
		return err
	}
	refused := 0
	items := make([]bulkItem, 0, len(res.Items))
	for _, it := range res.Items {
		b := bulkItem{ID: it.ID, Definition: it.Definition, Before: it.Before, State: it.State, Key: it.Key, Replayed: it.Replayed}
		if it.Err != nil {
			refused++
			b.State, b.Error = "", it.Err.Error()
		}
		items = append(items, b)
	}
	if r.JSON {
		if jerr := printJSON(f.out, map[string]any{"operation": op, "key": res.Key, "dry_run": r.DryRun, "items": items, "next_cursor": res.NextCursor}); jerr != nil {
			return jerr
		}
	} else {
		w := tabwriter.NewWriter(f.out, 0, 4, 2, ' ', 0)
		after := "NOW"
		if r.DryRun {
			after = "WOULD BE"
		}
		fmt.Fprintf(w, "ID\tDEFINITION\tWAS\t%s\tNOTE\n", after)
		for _, b := range items {
			note := ""
			switch {
			case b.Error != "":
				note = "refused: " + b.Error
			case b.Replayed:
				note = "already done by this request"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", b.ID, b.Definition, b.Before, b.State, note)
		}
		if ferr := w.Flush(); ferr != nil {
			return ferr
		}
		verb := repairDone[op]
		if r.DryRun {
			fmt.Fprintf(f.out, "dry run, nothing changed: %d sagas, %d would be %s, %d refused\n", len(items), len(items)-refused, verb, refused)
		} else {
			fmt.Fprintf(f.out, "%d sagas: %d %s, %d refused (request key %s: send the same command with --request-key %s to replay it)\n",
				len(items), len(items)-refused, verb, refused, res.Key, res.Key)
		}
		if res.NextCursor != "" {
			fmt.Fprintf(f.out, "next_cursor %s\n", res.NextCursor)
		}
	}
	if err != nil {
		return err
	}
	if refused > 0 {
		return fmt.Errorf("%d of %d sagas were refused (each says why above); the others were not held up", refused, len(items))
	}
	return nil
}
