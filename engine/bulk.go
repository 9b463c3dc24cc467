package engine

import (
	"context"
	"fmt"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/saga"
)

// Bounds of Bulk.
const (
	// BulkLimitDefault is how many sagas one Bulk call repairs when
	// BulkRepair.Filter.Limit is not set.
	BulkLimitDefault = 100
	// BulkLimitMax is the largest BulkRepair.Filter.Limit.
	BulkLimitMax = 1000
	// bulkKeyMax leaves room in a key for the saga ID it is derived with.
	bulkKeyMax = 255 - 1 - 36
)

// BulkRepair is one repair applied to every saga a filter matches.
type BulkRepair struct {
	// Operation is the repair: one of Repairs (retry, cancel, skip,
	// close, pause, resume).
	Operation string
	// Filter selects the sagas, as List does, newest first. Definition or
	// State must be set. Limit bounds one call (default
	// BulkLimitDefault, at most BulkLimitMax); Cursor continues after
	// the last saga of a previous call (BulkResult.NextCursor).
	Filter ListOptions
	// Skip names the step and result of a bulk skip (Operation "skip").
	Skip SkipStep
	// Repair is the request: its Key makes the whole bulk request safe
	// to send again (each saga's repair is recorded under the key and
	// the saga's ID, so a saga repaired by the first request is
	// answered from its record, Replayed); empty makes up one, returned
	// in BulkResult.Key. Reason and By are recorded with each repair.
	Repair Repair
	// DryRun repairs nothing: each saga's repair runs in a transaction
	// that is rolled back, and its item says what it would do.
	DryRun bool
}

// BulkResult is what Bulk did, saga by saga.
type BulkResult struct {
	// Key is the bulk request's key (BulkRepair.Repair.Key, or the one
	// made up for it): send the request again with it to replay it.
	Key string
	// Items has one entry per saga the filter matched, in List's order.
	Items []BulkItem
	// NextCursor continues with the next page of the filter (the
	// Filter's Cursor); empty when this page was the last.
	NextCursor string
}

// BulkItem is one saga's part of a Bulk.
type BulkItem struct {
	// Definition is the saga's.
	Definition string
	// RepairResult is the saga's repair (or, for a dry run, what it would
	// do); ID and Before are set even when Err is.
	RepairResult
	// Err, if not nil, is why this saga was not repaired (ErrStateForbids,
	// ErrStepInFlight, ErrRepairKeyReused, ...). It does not stop the
	// others.
	Err error
}

// BulkKey returns the key under which Bulk records its repair of saga id
// for the bulk request key: the request's key and the saga's ID.
func BulkKey(key string, id uuid.UUID) string { return key + "/" + id.String() }

// Bulk applies one repair to every saga Filter matches, up to its
// Limit: each saga in its own transaction under its own key, derived
// from the request's (BulkKey), so that the same bulk request sent again
// replays each saga's repair instead of repeating it, and another
// request under the same key is refused for each saga
// (ErrRepairKeyReused). One saga's refusal is reported in its item and
// does not stop the others. With DryRun nothing is written: each item
// says what the repair would do.
//
// A saga the first request repaired may no longer match the filter (a
// retried saga is not failed any more): a resend then leaves it alone,
// which is what a replay must do too.
func (cl *Client) Bulk(ctx context.Context, b BulkRepair) (BulkResult, error) {
	return cl.bulk(ctx, nil, b)
}

// BulkTx is Bulk in the caller's transaction tx: each saga's repair is a
// savepoint in it, so a refusal is reported in its item and the other
// repairs take effect when tx commits, all of them or none. The sagas are
// those Filter matches as committed when BulkTx begins. See "Repairs in
// your transaction" in the package documentation.
func (cl *Client) BulkTx(ctx context.Context, tx pgx.Tx, b BulkRepair) (BulkResult, error) {
	return cl.bulk(ctx, tx, b)
}

// bulk is Bulk, in tx if not nil.
func (cl *Client) bulk(ctx context.Context, tx pgx.Tx, b BulkRepair) (BulkResult, error) {
	known := false
	for _, op := range Repairs {
		known = known || op == b.Operation
	}
	if !known {
		return BulkResult{}, fmt.Errorf("%w: %q; the repairs are %v", ErrUnknownRepair, b.Operation, Repairs)
	}
	if b.Filter.Definition == "" && b.Filter.State == "" {
		return BulkResult{}, fmt.Errorf("%w: a bulk repair needs a definition or a state to select its sagas", ErrInvalidFilter)
	}
	switch {
	case b.Filter.Limit == 0:
		b.Filter.Limit = BulkLimitDefault
	case b.Filter.Limit < 0 || b.Filter.Limit > BulkLimitMax:
		return BulkResult{}, fmt.Errorf("%w: limit %d must be from 1 to %d; continue with the cursor", ErrInvalidFilter, b.Filter.Limit, BulkLimitMax)
	}
	if b.Operation == "skip" {
		if err := cl.c.CheckSkip(orchestrate.Skip(b.Skip)); err != nil {
			return BulkResult{}, err
		}
	}
	res := BulkResult{Key: b.Repair.Key}
	if res.Key == "" {
		res.Key = uuid.NewString()
	}
	if len(res.Key) > bulkKeyMax {
		return BulkResult{}, fmt.Errorf("%w: a bulk request's key is at most %d characters (each saga's is derived from it with its ID)", saga.ErrInvalidKey, bulkKeyMax)
	}
	if err := saga.CheckKey(res.Key); err != nil {
		return BulkResult{}, err
	}
	sagas, err := cl.List(ctx, b.Filter)
	if err != nil {
		return BulkResult{}, err
	}
	if len(sagas) == b.Filter.Limit {
		res.NextCursor = Cursor(sagas[len(sagas)-1])
	}
	for _, sg := range sagas {
		if err := ctx.Err(); err != nil {
			return res, fmt.Errorf("idemsaga: bulk %s: stopped after %d of %d sagas: %w", b.Operation, len(res.Items), len(sagas), err)
		}
		r := b.Repair
		r.Key = BulkKey(res.Key, sg.ID)
		one, err := cl.repair(ctx, tx, sg.ID, b.Operation, b.Skip, r, b.DryRun)
		one.ID, one.Operation, one.Key, one.DryRun = sg.ID, b.Operation, r.Key, b.DryRun
		if one.Before == "" {
			one.Before = sg.State
		}
		res.Items = append(res.Items, BulkItem{Definition: sg.Definition, RepairResult: one, Err: err})
	}
	return res, nil
}
