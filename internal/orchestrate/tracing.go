package orchestrate

import (
	"errors"

	"github.com/jackc/pgx/v5"
)

// ignoreNoRows makes a row that is not there no error.
func ignoreNoRows(err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	return err
}

// reapReason names why the reaper takes a step up, for its span.
func reapReason(due, expired, resend, waited bool) string {
	switch {
	case waited:
		return "wait expired"
	case resend:
		return "resend"
	case due:
		return "retry due"
	case expired:
		return "lease expired"
	}
	return ""
}
