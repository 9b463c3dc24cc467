package engine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/internal/pgschema"
	"github.com/idemsaga/idemsaga/internal/store"
	"github.com/idemsaga/idemsaga/saga"
)

// StaleAfterDefault is how overdue a lease, a retry or an unpublished
// outbox row may be before Reconcile reports it.
const StaleAfterDefault = 30 * time.Second

// Difference is one broken engine invariant.
type Difference struct {
	// SagaID is the saga concerned, if any.
	SagaID *uuid.UUID `json:"saga_id,omitempty"`
	// What says what is wrong.
	What string `json:"what"`
	// Check names the invariant (Checks), as the state_differences
	// metric labels it.
	Check string `json:"check"`
}

// Checks names every invariant Reconcile checks, as Difference.Check and
// the idemsaga_state_differences metric give them. "failed" and "parked"
// list sagas that wait for a person; every other check must find nothing.
var Checks = func() []string {
	var names []string
	for _, r := range store.Rules {
		names = append(names, r.Check)
	}
	return append(names, checkFinalState, checkFinalSteps)
}()

// The checks of sagas in their final state, which Reconcile makes itself.
const (
	checkFinalState = "final_state"
	checkFinalSteps = "final_steps"
)

func (d Difference) String() string {
	if d.SagaID != nil {
		return fmt.Sprintf("saga %s: %s", d.SagaID, d.What)
	}
	return d.What
}

// Reconcile checks the engine's invariants across the database and
// returns every difference found (none when all hold):
//
//   - every running saga has exactly one step in flight, with a live lease
//     or a retry due no more than staleAfter ago (a paused saga's wait is
//     not overdue); a finished saga has none;
//   - a resumed saga's step in flight was sent again within staleAfter,
//     and no running saga that is not paused is past its deadline by more
//     than staleAfter (compensating ones excepted);
//   - a saga's state agrees with its steps: a saga in its final state has
//     every forward step succeeded, a compensated saga every compensation
//     it started succeeded;
//   - the engine and the inbox agree: no step recorded as failed took
//     effect, no step recorded as succeeded is missing from the inbox
//     (each step key's effect is recorded once, by the inbox's primary key);
//   - no saga ended compensated while a possibly-done step (an attempt's
//     outcome at another system was unknown) was not compensated: that
//     step may have taken effect and is still there, unless an operator
//     took it as not done (a cancel of the parked saga, whose repair names
//     it) or as done (a skip) and it has nothing to undo;
//   - the outbox is drained or draining: no row unpublished for longer than
//     staleAfter after it became the relay's (its hand-off passed), none
//     the broker refused;
//   - a saga started with a submit token is the one the token records as
//     having used it (the two are written in one statement);
//   - an operator's repairs hold: a step skipped (Client.Skip) is
//     succeeded and its key fenced in the inbox (a final record, so no
//     late delivery can take effect), and a closed saga (Client.Close)
//     has its close recorded;
//   - every running saga's definition version is recorded by the
//     deployment, so that any process can plan its moves;
//   - no command is parked in the dead-letter table: a running saga's
//     parked command waits for a worker of its definition version (or a
//     person), one of a finished saga for a person to drop it;
//   - sagas in StateFailed or StateParked are listed: they need a person.
//
// What the schema guards itself (steps, attempts and inbox rows without
// their saga, values outside a domain) is not checked again.
//
// defs gives the final state of each definition version; sagas of other
// definitions or versions are checked for everything else. staleAfter <= 0 means
// StaleAfterDefault.
//
// It reads the deployment of schema idemsaga; ReconcileSchema reads
// another's.
func Reconcile(ctx context.Context, pool *pgxpool.Pool, defs []*saga.Definition, staleAfter time.Duration) ([]Difference, error) {
	return ReconcileSchema(ctx, pool, "", defs, staleAfter)
}

// ReconcileSchema is Reconcile for the deployment of schema (Config.Schema;
// "" for SchemaDefault).
func ReconcileSchema(ctx context.Context, pool *pgxpool.Pool, schema string, defs []*saga.Definition, staleAfter time.Duration) ([]Difference, error) {
	sch, err := pgschema.New(schema)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: reconcile: %w", err)
	}
	if staleAfter <= 0 {
		staleAfter = StaleAfterDefault
	}
	finals := map[string]string{}
	lengths := map[string]int{}
	// Steps an operator may skip on a parked saga that have nothing to
	// undo: "name@version/step".
	var noUndo []string
	groups, groupStates := map[string]string{}, map[string]string{}
	for _, d := range defs {
		for i := range d.Len() {
			if g := d.Step(i).Group; g != "" {
				groups[d.Ref()+"/"+d.Step(i).Name] = g
				groupStates[d.Ref()+"/"+d.Step(i).Name] = string(d.Step(i).Reaches)
			}
		}
		finals[d.Ref()] = string(d.FinalState())
		lengths[d.Ref()] = d.Len()
		for i := range d.Len() {
			if d.Step(i).Compensate == nil {
				noUndo = append(noUndo, d.Ref()+"/"+d.Step(i).Name)
			}
		}
	}
	var diffs []Difference
	add := func(rows pgx.Rows, format, check string) error {
		for rows.Next() {
			var id *uuid.UUID
			var detail string
			if err := rows.Scan(&id, &detail); err != nil {
				rows.Close()
				return err
			}
			diffs = append(diffs, Difference{SagaID: id, What: fmt.Sprintf(format, detail), Check: check})
		}
		return rows.Err()
	}
	stale := staleAfter.Seconds()
	for _, r := range store.Rules {
		var args []any
		switch r.Takes {
		case store.StaleSeconds:
			args = []any{stale}
		case store.StepsWithoutUndo:
			args = []any{noUndo}
		case store.BranchGroups:
			args = []any{jsonText(groups)}
		case store.BranchStates:
			args = []any{jsonText(groupStates)}
		}
		rows, err := sch.Q(pool).Query(ctx, r.SQL, args...)
		if err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
		if err := add(rows, r.Difference, r.Check); err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
	}

	// Sagas in their final state: every forward step succeeded.
	rows, err := sch.Q(pool).Query(ctx, store.FinishedForwardSteps)
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var id uuid.UUID
		var def, state string
		var succeeded int
		if err := rows.Scan(&id, &def, &state, &succeeded); err != nil {
			return nil, fmt.Errorf("reconcile: %w", err)
		}
		final, known := finals[def]
		switch {
		case !known:
			continue
		case state != final:
			diffs = append(diffs, Difference{SagaID: &id, What: fmt.Sprintf("finished in state %q, which is not terminal for %q", state, def), Check: checkFinalState})
		case succeeded != lengths[def]:
			diffs = append(diffs, Difference{SagaID: &id, What: fmt.Sprintf("in final state %q with %d of %d forward steps succeeded or skipped", state, succeeded, lengths[def]), Check: checkFinalSteps})
		}
	}
	if err := rows.Err(); err != nil && !errors.Is(err, context.Canceled) {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	return diffs, nil
}

// jsonText is m as JSON text, a rule's parameter.
func jsonText(m map[string]string) string {
	b, _ := json.Marshal(m) // a map of strings always encodes
	return string(b)
}
