package httpapi

import (
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// BulkRepaired is the body of POST /v1/repairs: one repair applied to
// every saga a filter matched.
type BulkRepaired struct {
	// Operation is the repair: retry, cancel, skip, close, pause or resume.
	Operation string `json:"operation"`
	// Key is the request's Idempotency-Key; each saga's repair is
	// recorded under it and the saga's ID.
	Key string `json:"key"`
	// DryRun is true when nothing was written: each item says what the
	// repair would do.
	DryRun bool `json:"dry_run"`
	// Items has one entry per saga the filter matched, newest first.
	Items []BulkItem `json:"items"`
	// NextCursor continues with the next page of the filter (the cursor
	// member); null when this page was the last.
	NextCursor *string `json:"next_cursor"`
}

// BulkItem is one saga's part of a bulk repair.
type BulkItem struct {
	ID         uuid.UUID `json:"id"`
	Definition string    `json:"definition"`
	// Before is the saga's state when its repair began.
	Before saga.State `json:"before"`
	// State is the saga's state after the repair (or, in a dry run, the
	// one it would leave); null when refused.
	State *saga.State `json:"state"`
	// Key is the key the saga's repair is recorded under.
	Key string `json:"key"`
	// Replayed: this request had already repaired the saga; nothing was
	// written.
	Replayed bool `json:"replayed"`
	// At is when the repair committed; null in a dry run or when refused.
	At *time.Time `json:"at"`
	// Problem, if set, is why the saga was not repaired, as a single
	// repair would have answered. The other sagas were not held up.
	Problem *Problem `json:"problem"`
}

const bulkHint = `send {"operation":"retry|cancel|skip|close|pause|resume","filter":{"definition":"<name>","state":"<state>"},"limit":100,"cursor":"<next_cursor>","dry_run":true,"reason":"<why>"} (a skip adds "step" and "result")`

// bulk handles POST /v1/repairs: a repair applied to every saga a filter
// matches, each in its own transaction, under the Idempotency-Key and
// the saga's ID, so that the same request sent again replays.
func (a *api) bulk(w http.ResponseWriter, r *http.Request) {
	key, p := requestKey(r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	body, p := a.readBody(w, r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	if p := requireJSON(w, r.Header); p != nil {
		writeProblem(w, p)
		return
	}
	req, p := decodeRepairBody(body, bulkHint, "operation", "filter", "limit", "cursor", "dry_run", "reason", "step", "result")
	if p != nil {
		writeProblem(w, p)
		return
	}
	malformed := func(detail string) {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid request body", detail+"; "+bulkHint))
	}
	var filter repairBody
	if len(req.Filter) > 0 {
		if filter, p = decodeRepairBody(req.Filter, bulkHint, "definition", "state"); p != nil {
			p.Detail = "in member \"filter\": " + p.Detail
			writeProblem(w, p)
			return
		}
	}
	if req.Operation == "" {
		malformed(`member "operation" is missing`)
		return
	}
	if !coversFilter(w, r, filter.Definition) {
		return
	}
	if req.Operation != "skip" && (req.Step != "" || req.Result != nil) {
		malformed(`members "step" and "result" belong to a skip`)
		return
	}
	b := engine.BulkRepair{Operation: req.Operation, DryRun: req.DryRun,
		Filter: engine.ListOptions{Definition: filter.Definition, State: saga.State(filter.State), Cursor: req.Cursor, Limit: engine.BulkLimitDefault},
		Skip:   engine.SkipStep{Step: req.Step, Result: req.Result},
		Repair: engine.Repair{Key: key, Reason: req.Reason, By: author(r)}}
	if req.Limit != nil {
		if *req.Limit < 1 || *req.Limit > engine.BulkLimitMax {
			malformed(fmt.Sprintf("limit %d must be from 1 to %d; continue with the cursor", *req.Limit, engine.BulkLimitMax))
			return
		}
		b.Filter.Limit = *req.Limit
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	res, err := a.cfg.Client.Bulk(ctx, b)
	switch {
	case errors.Is(err, engine.ErrUnknownRepair), errors.Is(err, engine.ErrInvalidFilter), errors.Is(err, engine.ErrInvalidCursor),
		errors.Is(err, engine.ErrInvalidResult), errors.Is(err, engine.ErrResultTooLarge):
		malformed(trimPrefix(err.Error()))
		return
	case errors.Is(err, engine.ErrStateForbids):
		// A skip without its step.
		malformed(strings.TrimPrefix(trimPrefix(err.Error()), "the saga's state does not allow this: "))
		return
	case errors.Is(err, saga.ErrInvalidKey):
		writeProblem(w, invalidKey(trimPrefix(err.Error())))
		return
	case err != nil && len(res.Items) == 0:
		if p, _ := repairProblem(err, uuid.Nil, key); p != nil && p.Status == http.StatusServiceUnavailable {
			writeProblem(w, p)
			return
		}
		a.internal(w, r, "repair the sagas", "retrying with the same Idempotency-Key is safe: each saga's repair answers from its record", err, "key", key)
		return
	case err != nil:
		// Stopped part way (the request's deadline): what was done stands,
		// and the same request again goes on from there.
		a.cfg.Logger.WarnContext(r.Context(), "http api: bulk repair stopped part way", "key", key, "done", len(res.Items), "error", err)
	}
	out := BulkRepaired{Operation: req.Operation, Key: res.Key, DryRun: req.DryRun, Items: make([]BulkItem, 0, len(res.Items))}
	if res.NextCursor != "" {
		out.NextCursor = &res.NextCursor
	}
	for _, it := range res.Items {
		item := BulkItem{ID: it.ID, Definition: it.Definition, Before: it.Before, Key: it.Key, Replayed: it.Replayed}
		if it.Err != nil {
			p, _ := repairProblem(it.Err, it.ID, it.Key)
			if p == nil {
				a.cfg.Logger.ErrorContext(r.Context(), "http api: could not repair a saga of a bulk repair", "id", it.ID, "key", it.Key, "error", it.Err)
				p = newProblem(http.StatusInternalServerError, ProblemInternal, "Internal server error",
					"this saga could not be repaired; the server's log has the details. Retrying the request with the same Idempotency-Key is safe")
			}
			item.Problem = p
		} else {
			st := it.State
			item.State = &st
			if !it.DryRun {
				at := it.At.UTC()
				item.At = &at
			}
		}
		out.Items = append(out.Items, item)
	}
	a.encode(w, r, http.StatusOK, out)
}
