package main

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

type reconcileResult struct {
	// Sagas and Orders count transfer and order sagas by state.
	Sagas  map[string]int `json:"sagas"`
	Orders map[string]int `json:"orders,omitempty"`
	// Crossborder counts cross-border transfers by state.
	Crossborder map[string]int      `json:"crossborder,omitempty"`
	Money       int64               `json:"money"`
	Expected    int64               `json:"expected_money"`
	Differences []engine.Difference `json:"differences"`
	// Order is the order example's audit, when it has orders.
	Order *order.Report `json:"order,omitempty"`
}

// reconcile checks the engine's invariants and the examples': the
// transfer's when transfers ran or accounts were seeded, the order's when
// orders ran, the cross-border transfer's when those ran.
func reconcile(ctx context.Context, p *pgxpool.Pool, defs []*saga.Definition, staleAfter time.Duration, expect int64) (reconcileResult, error) {
	res := reconcileResult{Sagas: map[string]int{}}
	if len(defs) > 0 {
		diffs, err := engine.Reconcile(ctx, p, defs, staleAfter)
		if err != nil {
			return res, err
		}
		res.Differences = diffs
	}
	var orders int
	if err := p.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1`, order.DefinitionName).Scan(&orders); err != nil {
		return res, err
	}
	if orders > 0 {
		rep, err := order.Audit(ctx, p)
		if err != nil {
			return res, err
		}
		res.Order, res.Orders = &rep, rep.ByState
		for _, d := range rep.Differences {
			if containsAny(d, "is not finished", "needs a person") {
				continue // the engine's own checks report these
			}
			res.Differences = append(res.Differences, engine.Difference{What: "order: " + d, Check: "order"})
		}
	}
	var crossings int
	if err := p.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1`, crossborder.DefinitionName).Scan(&crossings); err != nil {
		return res, err
	}
	if crossings > 0 {
		rep, err := crossborder.Audit(ctx, p)
		if err != nil {
			return res, err
		}
		res.Crossborder = rep.ByState
		for _, d := range rep.Differences {
			if containsAny(d, "is not finished", "needs a person") {
				continue // the engine's own checks report these
			}
			res.Differences = append(res.Differences, engine.Difference{What: "crossborder: " + d, Check: "crossborder"})
		}
	}
	total, seeded, err := transfer.Seeded(ctx, p)
	if err != nil {
		return res, err
	}
	if expect == 0 {
		if !seeded {
			var transfers int
			if err := p.QueryRow(ctx, `select count(*) from idemsaga.sagas where definition = $1`, transfer.Definition.Name()).Scan(&transfers); err != nil {
				return res, err
			}
			if transfers == 0 {
				return res, nil
			}
			return res, errors.New("no seed recorded for the transfer accounts (`worker seed` records one); pass --expect-total with the money the accounts should hold")
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
		res.Differences = append(res.Differences, engine.Difference{What: "transfer: " + d, Check: "transfer"})
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

// checks are the examples' invariants for the runtime's reconcile: money
// is conserved across transfers (against what seed recorded), and every
// order's charge, stock and shipment agree.
var checks = []service.Check{
	{Name: "examples", Func: func(ctx context.Context, p *pgxpool.Pool) ([]string, error) {
		res, err := reconcile(ctx, p, nil, time.Hour, 0)
		var out []string
		for _, d := range res.Differences {
			// Without the prefix: the check's name labels them.
			out = append(out, d.What)
		}
		return out, err
	}},
}
