package service

import (
	"fmt"
	"os"
	"time"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service/internal/planview"
)

// showArchived prints saga s.IDOrKey from the archive file s.Archive as
// show prints a live one, with its plan from the description archived
// with it, then when it was archived.
func (s *showCmd) showArchived(f *Flags) error {
	a, err := findArchived(s.Archive, s.IDOrKey)
	if err != nil {
		return err
	}
	// Archived as kept: sealed, with --payload-keys-file opened here.
	if err := f.loadPayloadKeys(); err != nil {
		return err
	}
	if err := seal.New(f.codec).OpenInstance(&a.Saga); err != nil {
		return err
	}
	if s.JSON {
		return printJSON(f.out, a)
	}
	var plan []planview.Stage
	if a.Description != nil {
		plan = planview.Of(*a.Description, a.Saga.Steps, a.Saga.Skipped)
	}
	printSaga(f.out, &a.Saga, plan)
	fmt.Fprintf(f.out, "\narchived %s in %s (deleted from the database by retention)\n", a.ArchivedAt.Format(time.RFC3339), s.Archive)
	return nil
}

// findArchived reads the archive file name for the saga with ID, or
// idempotency key, idOrKey. A saga written twice (archived again after a
// crash) is one saga; a key of sagas of several definitions is an error
// that lists them, as show's is.
func findArchived(name, idOrKey string) (*saga.ArchivedSaga, error) {
	file, err := os.Open(name)
	if err != nil {
		return nil, fmt.Errorf("open archive: %w", err)
	}
	defer file.Close()
	id, isID := uuid.Parse(idOrKey)
	var byID *saga.ArchivedSaga
	byKey := map[uuid.UUID]*saga.ArchivedSaga{}
	var order []uuid.UUID
	for a, err := range saga.ReadArchive(file) {
		if err != nil {
			return nil, fmt.Errorf("archive %s: %w", name, err)
		}
		switch {
		case isID == nil && a.Saga.ID == id:
			byID = a
		case a.Saga.Key == idOrKey:
			if _, seen := byKey[a.Saga.ID]; !seen {
				order = append(order, a.Saga.ID)
			}
			byKey[a.Saga.ID] = a
		}
	}
	if byID != nil {
		return byID, nil
	}
	switch len(order) {
	case 0:
		return nil, fmt.Errorf("%w: no saga has ID or key %q in the archive %s (another archive file may hold it)", saga.ErrNotFound, idOrKey, name)
	case 1:
		return byKey[order[0]], nil
	}
	defs := make([]string, len(order))
	for i, sid := range order {
		defs[i] = byKey[sid].Saga.Definition + " " + sid.String()
	}
	return nil, fmt.Errorf("key %q names sagas of several definitions in the archive %s %v; use the saga ID", idOrKey, name, defs)
}
