package saga

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"iter"
	"time"

	"github.com/google/uuid"
)

// ArchiveFormat is the layout of the ArchivedSaga lines this version
// writes. ReadArchive refuses a line of a later format rather than
// misread it; a later format only adds members.
const ArchiveFormat = 1

// ArchivedSaga is one line of a retention archive: a finished saga with
// everything the engine's tables held about it, read in the transaction
// that deleted it (the engine's RetentionConfig.ArchiveDir). An archive
// file is gzip-compressed JSON Lines, one ArchivedSaga a line, named
// sagas-<UTC time>-<host>-<pid>-<counter>.jsonl.gz so that names sort by
// time and never collide between processes.
//
// A saga is in at least one archive file once it is deleted, and may be
// in two: a process that stops between writing a file and committing
// the deletion archives the saga again in a later file. Readers dedupe
// by Saga.ID; the copies are alike but for ArchivedAt.
type ArchivedSaga struct {
	// Format is the ArchiveFormat of the writer.
	Format int `json:"format"`
	// ArchivedAt is when the cleaner read the saga, on the database clock.
	ArchivedAt time.Time `json:"archived_at"`
	// Saga is the saga as inspection shows it (the engine's Client.Get):
	// its input, results and error, its step executions, the timeline of
	// its attempts, its callbacks, repairs, dead letters and children.
	// A child is kept while its parent is, so it is archived on its own
	// line, in the same or a later file.
	Saga Instance `json:"saga"`
	// InputHash is the SHA-256 of the saga's canonical input, by which a
	// start under its key was told the same intent or a reused key.
	InputHash []byte `json:"input_hash"`
	// TraceContext is the W3C trace context of the saga's start, nil when
	// the start was not traced.
	TraceContext map[string]string `json:"trace_context,omitempty"`
	// Inbox holds the dedup records of the saga's step keys, oldest
	// first.
	Inbox []InboxRecord `json:"inbox,omitempty"`
	// Description is the saga's definition at its version, as the
	// deployment recorded it; nil when none was recorded.
	Description *Description `json:"description,omitempty"`
}

// InboxRecord is the dedup record of one step key: the outcome a command
// delivered again under that key was answered with.
type InboxRecord struct {
	StepKey uuid.UUID `json:"step_key"`
	Step    string    `json:"step"`
	Phase   Phase     `json:"phase"`
	// Attempt is the attempt that wrote the record's outcome.
	Attempt int `json:"attempt"`
	// Outcome is succeeded, failed, retry, started, waiting or tombstone
	// (an operator's skip: nothing ran under the key).
	Outcome string `json:"outcome"`
	// Unknown is set when an attempt's outcome at another system was
	// lost: it may have taken effect.
	Unknown bool `json:"unknown,omitempty"`
	// Verified is set when the step's Verify answered, after the last
	// unknown attempt, that the key took no effect.
	Verified  bool            `json:"verified,omitempty"`
	Result    json.RawMessage `json:"result,omitempty"`
	Error     string          `json:"error,omitempty"`
	CreatedAt time.Time       `json:"created_at"`
}

// ErrArchiveFormat is returned by ReadArchive for a line of a format
// this version does not know.
var ErrArchiveFormat = errors.New("idemsaga: archive line of an unknown format")

// ReadArchive yields the lines of an archive file r, in order: r is the
// file as written (gzip-compressed JSON Lines). It stops at the first
// error, which it yields with the number of the line.
//
//	f, _ := os.Open(name)
//	for a, err := range saga.ReadArchive(f) {
//		if err != nil { ... }
//		fmt.Println(a.Saga.ID, a.Saga.State)
//	}
func ReadArchive(r io.Reader) iter.Seq2[*ArchivedSaga, error] {
	return func(yield func(*ArchivedSaga, error) bool) {
		zr, err := gzip.NewReader(bufio.NewReader(r))
		if err != nil {
			yield(nil, fmt.Errorf("idemsaga: read archive: not a gzip file (archives are gzip-compressed JSON Lines): %w", err))
			return
		}
		defer zr.Close()
		dec := json.NewDecoder(zr)
		for line := 1; ; line++ {
			var a ArchivedSaga
			err := dec.Decode(&a)
			if errors.Is(err, io.EOF) {
				return
			}
			if err == nil && (a.Format < 1 || a.Format > ArchiveFormat) {
				err = fmt.Errorf("%w: format %d (this version reads 1 to %d)", ErrArchiveFormat, a.Format, ArchiveFormat)
			}
			if err != nil {
				yield(nil, fmt.Errorf("idemsaga: read archive line %d: %w", line, err))
				return
			}
			if !yield(&a, nil) {
				return
			}
		}
	}
}
