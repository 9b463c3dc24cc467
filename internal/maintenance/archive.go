package maintenance

import (
	"bufio"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/saga"
)

// SagaReader reads the sagas of a batch the cleaner is about to delete,
// as archive lines, in the cleaner's transaction (which holds their row
// locks). It returns one line per ID, in the order given.
type SagaReader interface {
	ReadSagas(ctx context.Context, tx pgx.Tx, ids []uuid.UUID) ([]*saga.ArchivedSaga, error)
}

// archiveSeq numbers the archive files of this process.
var archiveSeq atomic.Uint64

// archiveName is the name of an archive file written at now by process
// pid of host: names sort by time, and never collide between processes
// (host and pid) or within one (seq).
func archiveName(now time.Time, host string, pid int, seq uint64) string {
	return fmt.Sprintf("sagas-%s-%s-%d-%06d.jsonl.gz", now.UTC().Format("20060102T150405.000000000Z"), safeHost(host), pid, seq)
}

// safeHost keeps a host name to letters, digits and dots (anything else
// becomes _), so that it cannot make a path or split the name's
// dash-separated fields.
func safeHost(h string) string {
	h = strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '.':
			return r
		}
		return '_'
	}, h)
	if h == "" {
		return "host"
	}
	return h
}

// archiveDirError says what to fix when dir cannot take an archive.
func archiveDirError(dir string, err error) error {
	return fmt.Errorf("idemsaga: retention: cannot write an archive in %q (%w): create the directory and let this process write to it, or unset the archive directory (RetentionConfig.ArchiveDir, worker run --archive-dir) to delete without archiving", dir, err)
}

// checkArchiveDir checks that dir is a directory this process can
// create, write and remove a file in.
func checkArchiveDir(dir string) error {
	f, err := os.CreateTemp(dir, ".idemsaga-check-*")
	if err != nil {
		return archiveDirError(dir, err)
	}
	name := f.Name()
	_, werr := f.WriteString("idemsaga\n")
	cerr := f.Close()
	rerr := os.Remove(name)
	if err := errors.Join(werr, cerr, rerr); err != nil {
		return archiveDirError(dir, err)
	}
	return nil
}

// writeArchive writes lines to a new archive file in dir and makes it
// durable: written under a hidden temporary name, synced, renamed, and
// the directory synced. It returns the file's path once a crash can no
// longer lose it; on error it leaves no file behind, except one the
// directory's sync failed for.
func writeArchive(dir string, lines []*saga.ArchivedSaga) (string, error) {
	host, _ := os.Hostname()
	name := archiveName(time.Now(), host, os.Getpid(), archiveSeq.Add(1))
	final := filepath.Join(dir, name)
	tmp := filepath.Join(dir, "."+name+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o640)
	if err != nil {
		return "", archiveDirError(dir, err)
	}
	if err := writeLines(f, lines); err != nil {
		_ = f.Close()
		_ = os.Remove(tmp)
		return "", archiveDirError(dir, err)
	}
	if err := f.Close(); err != nil {
		_ = os.Remove(tmp)
		return "", archiveDirError(dir, err)
	}
	if err := os.Rename(tmp, final); err != nil {
		_ = os.Remove(tmp)
		return "", archiveDirError(dir, err)
	}
	if err := syncDir(dir); err != nil {
		// The file may not survive a crash: the sagas stay, and the next
		// pass archives them again (readers dedupe by saga ID).
		return "", archiveDirError(dir, fmt.Errorf("sync the directory after writing %s: %w", name, err))
	}
	return final, nil
}

// writeLines writes lines to f as gzip-compressed JSON Lines and syncs f.
func writeLines(f *os.File, lines []*saga.ArchivedSaga) error {
	bw := bufio.NewWriterSize(f, 64<<10)
	zw := gzip.NewWriter(bw)
	enc := json.NewEncoder(zw)
	enc.SetEscapeHTML(false)
	for _, l := range lines {
		if err := enc.Encode(l); err != nil {
			return fmt.Errorf("encode saga %s: %w", l.Saga.ID, err)
		}
	}
	if err := zw.Close(); err != nil {
		return err
	}
	if err := bw.Flush(); err != nil {
		return err
	}
	return f.Sync()
}

// syncDir makes a rename in dir durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	err = d.Sync()
	return errors.Join(err, d.Close())
}
