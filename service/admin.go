package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/planview"
)

// withClient opens a small pool and runs fn with a client on it.
func (f *Flags) withClient(ctx context.Context, fn func(*pgxpool.Pool, *engine.Client) error) error {
	pool, err := f.OpenDB(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := f.checkMigrated(ctx, pool); err != nil {
		return err
	}
	cl, err := f.Client(pool)
	if err != nil {
		return err
	}
	return fn(pool, cl)
}

type startCmd struct {
	Definition string        `arg:"" help:"Name of the saga's definition."`
	Key        string        `required:"" help:"Idempotency key: the business identifier of this intent, 1-255 printable ASCII characters without surrounding spaces. The same key and input return the same saga."`
	Input      string        `required:"" help:"The saga's input as JSON, @file to read it from a file, or - for stdin."`
	Wait       bool          `help:"Wait for the saga to finish and print it; exit 3 when it ends other than in its definition's final state."`
	Timeout    time.Duration `default:"60s" help:"How long --wait waits."`
	JSON       bool          `name:"json" help:"Print JSON."`
}

func (s *startCmd) Run(ctx context.Context, f *Flags) error {
	input, err := readInput(s.Input)
	if err != nil {
		return err
	}
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		def, err := cl.Definition(ctx, s.Definition)
		if errors.Is(err, saga.ErrUnknownDefinition) {
			known := definitionNames(f.defs)
			if descs, derr := cl.Definitions(ctx); derr == nil {
				for _, d := range descs {
					if !slices.Contains(known, d.Name) {
						known = append(known, d.Name)
					}
				}
			}
			if len(known) == 0 {
				return fmt.Errorf("%w: no saga definition is named %q, and the deployment has none yet: run `migrate` (or `run`) with the binary that has the definitions", saga.ErrUnknownDefinition, s.Definition)
			}
			return fmt.Errorf("%w: no saga definition is named %q; the deployment has %s", saga.ErrUnknownDefinition, s.Definition, strings.Join(known, ", "))
		}
		if err != nil {
			return err
		}
		res, err := cl.Start(ctx, def, s.Key, input)
		if errors.Is(err, saga.ErrIdempotencyKeyReused) {
			return fmt.Errorf("key %q already started a %s saga with another input (saga %s); resend the original input or use a new key", s.Key, s.Definition, res.ID)
		}
		if err != nil {
			return err
		}
		if runs, known := liveWorker(ctx, cl, def.Ref()); known && !runs && !res.Duplicate {
			fmt.Fprintf(f.errOut, "no live worker runs %s: the saga waits until one starts (`%s run` built with that version; `workers` lists what runs)\n", def.Ref(), name(*f.cfg))
		}
		if !s.Wait {
			if s.JSON {
				return printJSON(f.out, map[string]any{"id": res.ID, "definition": def.Name(), "key": s.Key, "state": res.State, "duplicate": res.Duplicate})
			}
			fmt.Fprintln(f.out, res.ID)
			if res.Duplicate {
				fmt.Fprintf(f.errOut, "key %q already names this saga (state %s); nothing new was started\n", s.Key, res.State)
			}
			return nil
		}
		wctx, cancel := context.WithTimeout(ctx, s.Timeout)
		defer cancel()
		sg, err := cl.Wait(wctx, res.ID)
		if err != nil {
			return fmt.Errorf("%w (is a worker running `run` for %s? see `workers`)", err, s.Definition)
		}
		if s.JSON {
			if err := printJSON(f.out, sg); err != nil {
				return err
			}
		} else {
			printSaga(f.out, sg, planview.Of(def.Describe(), sg.Steps, sg.Skipped))
		}
		if sg.State != def.FinalState() {
			return &ExitError{Code: 3, Err: fmt.Errorf("saga %s ended %s, not %s: %s", sg.ID, sg.State, def.FinalState(), sg.Error)}
		}
		return nil
	})
}

func definitionNames(defs []*saga.Definition) []string {
	names := make([]string, len(defs))
	for i, d := range defs {
		names[i] = d.Name()
	}
	return names
}

// readInput reads --input: JSON itself, @file, or - for stdin.
func readInput(arg string) ([]byte, error) {
	switch {
	case arg == "-":
		b, err := io.ReadAll(os.Stdin)
		if err != nil {
			return nil, fmt.Errorf("read the input from stdin: %w", err)
		}
		return b, nil
	case strings.HasPrefix(arg, "@"):
		b, err := os.ReadFile(arg[1:])
		if err != nil {
			return nil, fmt.Errorf("read the input: %w", err)
		}
		return b, nil
	}
	return []byte(arg), nil
}

type listCmd struct {
	Definition   string        `help:"Only sagas of this definition."`
	State        string        `help:"Only sagas in this state: init, compensating, compensated, failed, parked, or one a step reaches."`
	OlderThan    time.Duration `name:"older-than" help:"Only sagas created longer ago than this."`
	Stuck        bool          `help:"Only running sagas with no step in flight or an overdue lease or retry."`
	StuckAfter   time.Duration `name:"stuck-after" default:"30s" help:"How overdue a lease or retry must be to count as stuck."`
	Limit        int           `default:"50" help:"At most this many, newest first."`
	Cursor       string        `help:"Continue after the last saga of a previous listing (printed as next_cursor)."`
	DeadLettered bool          `name:"dead-lettered" help:"Only sagas with a command parked as a dead letter (see dead-letters)."`
	Version      int           `help:"Only sagas running this version of --definition."`
	JSON         bool          `name:"json" help:"Print JSON."`
}

func (l *listCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		sagas, err := cl.List(ctx, engine.ListOptions{Definition: l.Definition, State: saga.State(l.State), OlderThan: l.OlderThan,
			Stuck: l.Stuck, StuckAfter: l.StuckAfter, Limit: l.Limit, Cursor: l.Cursor, DeadLettered: l.DeadLettered, Version: l.Version})
		if err != nil {
			return err
		}
		next := ""
		if len(sagas) == l.Limit && l.Limit > 0 {
			next = engine.Cursor(sagas[len(sagas)-1])
		}
		if l.JSON {
			if sagas == nil {
				sagas = []*saga.Instance{}
			}
			return printJSON(f.out, map[string]any{"sagas": sagas, "next_cursor": next})
		}
		w := tabwriter.NewWriter(f.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "ID\tDEFINITION\tKEY\tSTATE\tAGE\tERROR")
		for _, sg := range sagas {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", sg.ID, saga.Ref(sg.Definition, sg.DefinitionVersion), sg.Key, sg.State, time.Since(sg.CreatedAt).Round(time.Second), truncate(sg.Error, 60))
		}
		if err := w.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(f.out, "%d sagas\n", len(sagas))
		if next != "" {
			fmt.Fprintf(f.out, "next_cursor %s\n", next)
		}
		if dls, err := cl.DeadLetters(ctx, engine.DeadLetterFilter{Definition: l.Definition, Limit: 1000}); err == nil && len(dls) > 0 {
			fmt.Fprintf(f.errOut, "%d commands are parked as dead letters (no worker that received them ran their version): `%s dead-letters list`\n", len(dls), name(*f.cfg))
		}
		return nil
	})
}

type showCmd struct {
	IDOrKey string `arg:"" name:"id-or-key" help:"Saga ID or idempotency key."`
	JSON    bool   `name:"json" help:"Print JSON."`
	Archive string `name:"archive" type:"existingfile" placeholder:"FILE" help:"Read the saga from this archive file (written by run --archive-dir) instead of the database; --json prints its whole archive line."`
}

func (s *showCmd) Run(ctx context.Context, f *Flags) error {
	if s.Archive != "" {
		return s.showArchived(f)
	}
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		sg, err := cl.Lookup(ctx, s.IDOrKey)
		if err != nil {
			return err
		}
		if s.JSON {
			return printJSON(f.out, sg)
		}
		var plan []planview.Stage
		if def, err := cl.DefinitionAt(ctx, sg.Definition, sg.DefinitionVersion); err == nil {
			plan = planview.Of(def.Describe(), sg.Steps, sg.Skipped)
		}
		printSaga(f.out, sg, plan)
		return nil
	})
}

type workersCmd struct {
	JSON bool `name:"json" help:"Print JSON."`
}

func (c *workersCmd) Run(ctx context.Context, f *Flags) error {
	return f.withClient(ctx, func(_ *pgxpool.Pool, cl *engine.Client) error {
		ws, err := cl.Workers(ctx)
		if err != nil {
			return err
		}
		if c.JSON {
			if ws == nil {
				ws = []engine.Worker{}
			}
			return printJSON(f.out, ws)
		}
		w := tabwriter.NewWriter(f.out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "HOST\tPID\tSTARTED\tDEFINITIONS")
		for _, wk := range ws {
			fmt.Fprintf(w, "%s\t%d\t%s\t%s\n", wk.Host, wk.PID, wk.StartedAt.Format(time.RFC3339), strings.Join(wk.Versions, ","))
		}
		if err := w.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(f.out, "%d live workers\n", len(ws))
		return nil
	})
}

func printJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// printSaga prints a saga, its plan (none when its definition's
// version is not known), its steps and its timeline.
func printSaga(out io.Writer, sg *saga.Instance, plan []planview.Stage) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "id\t%s\n", sg.ID)
	fmt.Fprintf(w, "definition\t%s version %d\n", sg.Definition, sg.DefinitionVersion)
	fmt.Fprintf(w, "key\t%s\n", sg.Key)
	fmt.Fprintf(w, "state\t%s\n", sg.State)
	if sg.Parent != nil {
		fmt.Fprintf(w, "parent\t%s (its step %s started this saga)\n", *sg.Parent, sg.ParentStep)
	}
	fmt.Fprintf(w, "version\t%d\n", sg.Version)
	fmt.Fprintf(w, "input\t%s\n", sg.Input)
	fmt.Fprintf(w, "created\t%s\n", sg.CreatedAt.Format(time.RFC3339Nano))
	if sg.FinishedAt != nil {
		fmt.Fprintf(w, "finished\t%s (%s)\n", sg.FinishedAt.Format(time.RFC3339Nano), sg.FinishedAt.Sub(sg.CreatedAt).Round(time.Millisecond))
	}
	if sg.Error != "" {
		fmt.Fprintf(w, "error\t%s\n", sg.Error)
	}
	printPause(w, sg)
	if len(plan) > 0 {
		fmt.Fprintf(w, "plan\t%s\n", planText(plan))
	}
	_ = w.Flush()
	if len(sg.Steps) > 0 {
		fmt.Fprintln(out)
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "STEP\tKIND\tPHASE\tSTATUS\tATTEMPTS\tKEY\tNOTE")
		for _, st := range sg.Steps {
			note := st.LastError
			if st.PossiblyDone {
				note = "possibly done: an attempt's outcome is unknown"
			}
			note = truncate(note, 80)
			if st.Status == saga.StepWaiting && st.LeaseUntil != nil {
				// The token in full: an operator may send the callback by hand.
				note = "waits for its callback until " + st.LeaseUntil.Format(time.RFC3339) + "; token " + st.CallbackToken
				if st.Kind == saga.ChildStep.String() {
					note = "waits for its child saga until " + st.LeaseUntil.Format(time.RFC3339)
					for _, ch := range sg.Children {
						if ch.Step == st.Step {
							note += ": " + ch.ID.String() + " (" + string(ch.State) + ")"
						}
					}
				}
			}
			key := st.Key.String()
			if st.Status == saga.StepSkipped {
				key, note = "-", "skipped by its condition: no key, no effect, nothing to compensate"
			}
			name := st.Step
			if st.Group != "" {
				name += " (group " + st.Group + ")"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", name, st.Kind, st.Phase, st.Status, st.Attempt, key, note)
		}
		_ = w.Flush()
	}
	if len(sg.Children) > 0 {
		fmt.Fprintln(out, "\nchild sagas (`show` an ID for its steps):")
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "STEP\tID\tDEFINITION\tSTATE")
		for _, ch := range sg.Children {
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", ch.Step, ch.ID, ch.Definition, ch.State)
		}
		_ = w.Flush()
	}
	if len(sg.Attempts) > 0 {
		fmt.Fprintln(out, "\ntimeline:")
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "AT\tSTEP\tPHASE\tATTEMPT\tOUTCOME\tTOOK\tERROR")
		for _, a := range sg.Attempts {
			took, outcome := "", a.Outcome
			if a.FinishedAt != nil {
				took = a.FinishedAt.Sub(a.DispatchedAt).Round(time.Millisecond).String()
			}
			if outcome == "" {
				outcome = "in flight"
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", a.DispatchedAt.Format("15:04:05.000"), a.Step, a.Phase, a.Attempt, outcome, took, truncate(a.Error, 80))
		}
		_ = w.Flush()
	}
	if len(sg.Callbacks) > 0 {
		fmt.Fprintln(out, "\ncallbacks:")
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "RECEIVED\tSTEP\tEVENT\tOUTCOME\tBODY")
		for _, cb := range sg.Callbacks {
			body := string(cb.Result)
			if cb.Failed {
				body = "refused: " + cb.Error
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\n", cb.ReceivedAt.Format("15:04:05.000"), cb.Step, cb.EventID, cb.Outcome, truncate(body, 80))
		}
		_ = w.Flush()
	}
	if len(sg.Repairs) > 0 {
		fmt.Fprintln(out, "\nrepairs:")
		w = tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(w, "AT\tOPERATION\tSTEP\tBY\tSTATE AFTER\tREQUEST KEY\tREASON")
		for _, r := range sg.Repairs {
			step := r.Step
			if step != "" {
				step += "/" + string(r.Phase)
			}
			fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.At.Format(time.RFC3339), r.Operation, step, r.By, r.StateAfter, r.Key, truncate(r.Reason, 80))
		}
		_ = w.Flush()
	}
	if len(sg.DeadLetters) > 0 {
		fmt.Fprintln(out, "\nparked commands (dead letters; see `dead-letters`):")
		printDeadLetters(out, sg.DeadLetters)
	}
}

// planText writes a plan on one line: stages in order, a parallel
// group's branches side by side in brackets, each step with its status
// and its compensation's.
func planText(plan []planview.Stage) string {
	step := func(st planview.Step) string {
		s := st.Name
		if st.Child != "" {
			s += " (child " + st.Child + ")"
		}
		s += " " + string(st.Status)
		if st.Compensation != "" {
			s += ", undo " + string(st.Compensation)
		}
		return s
	}
	stages := make([]string, 0, len(plan))
	for _, stage := range plan {
		if stage.Group == "" {
			stages = append(stages, step(stage.Steps[0]))
			continue
		}
		branches := make([]string, 0, len(stage.Steps))
		for _, st := range stage.Steps {
			branches = append(branches, step(st))
		}
		stages = append(stages, stage.Group+" ["+strings.Join(branches, " | ")+"]")
	}
	return strings.Join(stages, " → ")
}
