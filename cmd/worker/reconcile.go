package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

type reconcileCmd struct {
	StaleAfter  time.Duration `name:"stale-after" default:"30s" help:"How overdue a lease, retry or unpublished outbox row may be before it is reported."`
	ExpectTotal int64         `name:"expect-total" help:"Money the accounts should hold in total (default: what transfer seeding recorded)."`
	JSON        bool          `name:"json" help:"Print the differences as JSON."`
}

// errDifferences makes the command exit non-zero after printing them.
var errDifferences = errors.New("differences found")

func (r *reconcileCmd) Run(ctx context.Context, g *globals) error {
	pool, err := openDB(ctx, g.DatabaseURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	res, err := reconcile(ctx, pool, r.StaleAfter, r.ExpectTotal)
	if err != nil {
		return err
	}
	if r.JSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(res); err != nil {
			return err
		}
	} else {
		res.print()
	}
	if len(res.Differences) > 0 {
		return fmt.Errorf("%d %w", len(res.Differences), errDifferences)
	}
	return nil
}

type reconcileResult struct {
	Sagas       map[string]int      `json:"sagas"`
	Money       int64               `json:"money"`
	Expected    int64               `json:"expected_money"`
	Differences []engine.Difference `json:"differences"`
}

func (r reconcileResult) print() {
	fmt.Printf("sagas by state: %v\n", r.Sagas)
	fmt.Printf("money: held %d, expected %d\n", r.Money, r.Expected)
	for _, d := range r.Differences {
		fmt.Printf("DIFFERENCE %s\n", d)
	}
	fmt.Printf("%d differences\n", len(r.Differences))
}

// reconcile checks the engine's invariants and the transfer example's.
func reconcile(ctx context.Context, p *pgxpool.Pool, staleAfter time.Duration, expect int64) (reconcileResult, error) {
	res := reconcileResult{Sagas: map[string]int{}}
	diffs, err := engine.Reconcile(ctx, p, []*saga.Definition{transfer.Definition}, staleAfter)
	if err != nil {
		return res, err
	}
	res.Differences = diffs
	if expect == 0 {
		total, seeded, err := transfer.Seeded(ctx, p)
		if err != nil {
			return res, err
		}
		if !seeded {
			return res, errors.New("no seed recorded for the transfer accounts; pass --expect-total with the money the accounts should hold")
		}
		expect = total
	}
	rep, err := transfer.Audit(ctx, p, expect)
	if err != nil {
		return res, err
	}
	res.Money, res.Expected = rep.Total, expect
	for state, n := range rep.ByState {
		res.Sagas[state] = n
	}
	for _, d := range rep.Differences {
		// Unfinished and failed sagas are already reported by the engine.
		if containsAny(d, "is not finished", "failed and needs a person") {
			continue
		}
		res.Differences = append(res.Differences, engine.Difference{What: "transfer: " + d})
	}
	return res, nil
}

func containsAny(s string, subs ...string) bool {
	for _, sub := range subs {
		if strings.Contains(s, sub) {
			return true
		}
	}
	return false
}
