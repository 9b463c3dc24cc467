package service

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

type reconcileCmd struct {
	StaleAfter time.Duration `name:"stale-after" default:"30s" help:"How overdue a lease, retry or unpublished outbox row may be before it is reported."`
	JSON       bool          `name:"json" help:"Print JSON."`
}

// ErrDifferences is returned by reconcile when it found any difference.
var ErrDifferences = errors.New("differences found")

// ReconcileResult is what `reconcile` finds.
type ReconcileResult struct {
	// Sagas counts sagas by state.
	Sagas map[saga.State]int64 `json:"sagas"`
	// Differences are the engine's and the checks' findings.
	Differences []engine.Difference `json:"differences"`
}

func (c *reconcileCmd) Run(ctx context.Context, f *Flags) error {
	pool, err := f.OpenDB(ctx, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := f.checkMigrated(ctx, pool); err != nil {
		return err
	}
	res, err := Reconcile(ctx, f, pool, c.StaleAfter)
	if err != nil {
		return err
	}
	if c.JSON {
		if err := printJSON(f.out, res); err != nil {
			return err
		}
	} else {
		states := make([]string, 0, len(res.Sagas))
		for st, n := range res.Sagas {
			states = append(states, fmt.Sprintf("%s %d", st, n))
		}
		slices.Sort(states)
		fmt.Fprintf(f.out, "sagas by state: %s\n", strings.Join(states, ", "))
		for _, d := range res.Differences {
			fmt.Fprintf(f.out, "DIFFERENCE %s\n", d)
		}
		fmt.Fprintf(f.out, "%d differences\n", len(res.Differences))
	}
	if len(res.Differences) > 0 {
		return fmt.Errorf("%d %w", len(res.Differences), ErrDifferences)
	}
	return nil
}

// Reconcile runs the engine's checks, for every definition the
// deployment recorded (the code of a definition is not needed), then
// the service's Checks.
func Reconcile(ctx context.Context, f *Flags, pool *pgxpool.Pool, staleAfter time.Duration) (ReconcileResult, error) {
	var res ReconcileResult
	cl, err := f.Client(pool)
	if err != nil {
		return res, err
	}
	descs, err := cl.Definitions(ctx)
	if err != nil {
		return res, err
	}
	defs := append([]*saga.Definition(nil), f.defs...)
	for _, d := range descs {
		// Every recorded version: sagas of an older one may still run.
		if !slices.ContainsFunc(defs, func(x *saga.Definition) bool { return x.Name() == d.Name && x.Version() == max(d.Version, 1) }) {
			def, err := saga.FromDescription(d)
			if err != nil {
				return res, err
			}
			defs = append(defs, def)
		}
	}
	if len(defs) > 0 {
		if res.Differences, err = engine.ReconcileSchema(ctx, pool, f.Schema, defs, staleAfter); err != nil {
			return res, err
		}
	}
	if res.Sagas, err = cl.Counts(ctx, ""); err != nil {
		return res, err
	}
	for _, chk := range f.cfg.Checks {
		found, err := chk.Func(ctx, pool)
		if err != nil {
			return res, fmt.Errorf("check %s: %w", chk.Name, err)
		}
		for _, d := range found {
			res.Differences = append(res.Differences, engine.Difference{What: chk.Name + ": " + d, Check: chk.Name})
		}
	}
	if res.Differences == nil {
		res.Differences = []engine.Difference{}
	}
	return res, nil
}
