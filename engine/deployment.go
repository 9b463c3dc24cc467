package engine

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/idemsaga/idemsaga/internal/orchestrate"
	"github.com/idemsaga/idemsaga/internal/store"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/idemsaga/idemsaga/internal/pguuid"
	"github.com/idemsaga/idemsaga/saga"
)

// ErrDeploymentMismatch is returned at start by an engine or client whose
// shared settings (stream, subject prefix, lease grace) or definitions
// differ from those the deployment recorded.
var ErrDeploymentMismatch = errors.New("idemsaga: this process's settings differ from the deployment's")

// HeartbeatIntervalDefault is how often a running engine renews its row in
// idemsaga.workers; a row older than three intervals is not live.
const HeartbeatIntervalDefault = orchestrate.HeartbeatInterval

// who names this process in what it records.
func who() string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s pid %d", host, os.Getpid())
}

// setting is one shared setting: its name, this process's value and the
// flag that sets it, for messages.
type setting struct{ name, value, flag string }

func sharedSettings(cfg *Config, worker bool) []setting {
	s := []setting{
		{"schema", cfg.Schema, "--schema / IDEMSAGA_SCHEMA / Config.Schema"},
		{"subject_prefix", cfg.SubjectPrefix, "--subject-prefix / IDEMSAGA_SUBJECT_PREFIX / Config.SubjectPrefix"},
		{"lease_grace", cfg.LeaseGrace.String(), "--lease-grace / IDEMSAGA_LEASE_GRACE / Config.LeaseGrace"},
	}
	if worker {
		s = append(s, setting{"stream", cfg.Stream, "--stream / IDEMSAGA_STREAM / Config.Stream"})
	}
	return s
}

// Deploy records cfg's shared settings (Stream, SubjectPrefix, LeaseGrace)
// and the descriptions of its Definitions as the deployment's, replacing
// what was recorded; a definition version whose description changed while
// sagas run on it is refused (ErrDeploymentMismatch), and nothing is
// recorded. Engines and clients compare their own with these at
// start and refuse to run on a difference. Run it once per deploy, from
// the new build, before its workers start (the runtime's `migrate` does);
// processes already running are not stopped.
func Deploy(ctx context.Context, cfg Config) error {
	cfg = *cfg.WithDefaults()
	if err := cfg.validate(false); err != nil {
		return err
	}
	sch := cfg.schema()
	tx, err := cfg.Pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: record the deployment: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	by := who()
	for _, s := range sharedSettings(&cfg, true) {
		if _, err := sch.Q(tx).Exec(ctx, store.RecordSetting, s.name, s.value, by); err != nil {
			return fmt.Errorf("idemsaga: record setting %s: %w", s.name, err)
		}
	}
	for _, d := range cfg.Definitions {
		if !d.Runnable() {
			continue
		}
		desc := d.Describe()
		// A version's steps are what its running sagas were planned
		// with: one changed under them needs a version of its own.
		var recorded saga.Description
		var running int
		err := sch.Q(tx).QueryRow(ctx, `select d.description, (select count(*) from idemsaga.sagas s
  where s.definition = d.name and s.definition_version = d.version and s.finished_at is null)
from idemsaga.definitions d where d.name = $1 and d.version = $2 and d.fingerprint is distinct from $3`,
			d.Name(), d.Version(), desc.Fingerprint()).Scan(&recorded, &running)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return fmt.Errorf("idemsaga: read definition %s: %w", d.Ref(), err)
		}
		if err == nil && running > 0 {
			return fmt.Errorf("%w: definition %s changed (%s) while %d sagas run on it; nothing was recorded. Give the changed definition a new version (saga.WithVersion(def, %d)) so they finish on theirs, or let them finish first",
				ErrDeploymentMismatch, d.Ref(), describeDifference(recorded, desc), running, d.Version()+1)
		}
		if _, err := sch.Q(tx).Exec(ctx, store.RecordDefinition, d.Name(), desc, desc.Fingerprint(), by, d.Version()); err != nil {
			return fmt.Errorf("idemsaga: record definition %s: %w", d.Ref(), err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: record the deployment: %w", err)
	}
	return nil
}

// recordOrRead scans an insert-or-read statement. When another process
// recorded the row while the insert waited for it, the statement's
// snapshot sees neither its own insert nor that row: the statement runs
// again and reads it.
func recordOrRead(query func() pgx.Row, dest ...any) error {
	for range 3 {
		err := query().Scan(dest...)
		if !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
	}
	return errors.New("another process keeps recording it at the same moment; start again")
}

// describeDifference names what differs between the recorded
// description and this process's: the steps, and each differing field
// as "here vs recorded".
func describeDifference(recorded, here saga.Description) string {
	if recorded.Input != here.Input {
		return fmt.Sprintf("its input type is %q here, %q in the deployment", here.Input, recorded.Input)
	}
	if recorded.Deadline != here.Deadline {
		return fmt.Sprintf("its saga deadline is %q here, %q in the deployment", here.Deadline, recorded.Deadline)
	}
	if len(recorded.Steps) != len(here.Steps) {
		return fmt.Sprintf("it has %d steps here, %d in the deployment", len(here.Steps), len(recorded.Steps))
	}
	var diffs []string
	for i := range here.Steps {
		a, b := here.Steps[i], recorded.Steps[i]
		for _, f := range []struct {
			name        string
			here, there any
		}{
			{"name", a.Name, b.Name}, {"reaches", a.Reaches, b.Reaches}, {"kind", a.Kind, b.Kind}, {"compensates", a.Compensates, b.Compensates},
			{"retry", a.Retry, b.Retry}, {"compensate_retry", a.CompensateRetry, b.CompensateRetry}, {"wait", a.Wait, b.Wait},
		} {
			if f.here == f.there {
				continue
			}
			if p, ok := f.here.(saga.PolicyDescription); ok {
				for _, d := range policyDiffs(p, f.there.(saga.PolicyDescription)) {
					diffs = append(diffs, fmt.Sprintf("step %q %s.%s", a.Name, f.name, d))
				}
				continue
			}
			diffs = append(diffs, fmt.Sprintf("step %q %s %v here, %v in the deployment", a.Name, f.name, f.here, f.there))
		}
	}
	if len(diffs) == 0 {
		return "their descriptions differ"
	}
	return strings.Join(diffs, "; ")
}

func policyDiffs(here, there saga.PolicyDescription) []string {
	var out []string
	add := func(name string, a, b any) {
		if a != b {
			out = append(out, fmt.Sprintf("%s %v here, %v in the deployment", name, a, b))
		}
	}
	add("max_attempts", here.MaxAttempts, there.MaxAttempts)
	add("initial_backoff", here.InitialBackoff, there.InitialBackoff)
	add("max_backoff", here.MaxBackoff, there.MaxBackoff)
	add("multiplier", here.Multiplier, there.Multiplier)
	add("jitter", here.Jitter, there.Jitter)
	add("timeout", here.Timeout, there.Timeout)
	return out
}

// Definition returns the newest version of the named definition: this
// client's own, or, for a definition whose code is not in this process,
// the newest version a live worker runs (else the newest recorded),
// rebuilt from the description the deployment recorded (saga.FromDescription), which can
// start, read and repair sagas while workers that have the code run the
// steps. An unknown name is saga.ErrUnknownDefinition.
func (cl *Client) Definition(ctx context.Context, name string) (*saga.Definition, error) {
	return cl.c.Resolve(ctx, name)
}

// Definitions returns the descriptions the deployment recorded, by name
// and version (every version recorded, oldest first).
func (cl *Client) Definitions(ctx context.Context) ([]saga.Description, error) {
	rows, err := cl.c.DB().Query(ctx, `select description from idemsaga.definitions order by name, version`)
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list definitions: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[saga.Description])
}

// Worker is a running engine as it last reported itself.
type Worker struct {
	ID          uuid.UUID
	Host        string
	PID         int
	Definitions []string
	StartedAt   time.Time
	SeenAt      time.Time

	// Versions names each definition version the worker runs, as
	// "name@version".
	Versions []string
}

// Workers returns the engines that reported themselves within the last
// three heartbeat intervals, with the definitions each runs.
func (cl *Client) Workers(ctx context.Context) ([]Worker, error) {
	rows, err := cl.c.DB().Query(ctx, `select id, host, pid, definitions, versions, started_at, seen_at from idemsaga.workers
where seen_at > idemsaga.now() - $1 * interval '1 millisecond' order by started_at`, (3 * HeartbeatIntervalDefault).Milliseconds())
	if err != nil {
		return nil, fmt.Errorf("idemsaga: list workers: %w", err)
	}
	defer rows.Close()
	var out []Worker
	for rows.Next() {
		var w Worker
		if err := rows.Scan(&w.ID, &w.Host, &w.PID, &w.Definitions, &w.Versions, &w.StartedAt, &w.SeenAt); err != nil {
			return nil, fmt.Errorf("idemsaga: list workers: %w", err)
		}
		out = append(out, w)
	}
	return out, rows.Err()
}

// beat records this engine in idemsaga.workers, with the definition
// versions it runs, and sends again the dead letters of those versions.
// Start beats once before it returns, so that a process resolving a
// definition by name sees this engine's versions at once.
func (e *Engine) beat(ctx context.Context) {
	names := e.c.Names()
	host, _ := os.Hostname()
	bctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if _, err := e.c.DB().Exec(bctx, store.Heartbeat, pguuid.Of(e.id), host, os.Getpid(), names, e.c.VersionRefs()); err != nil && ctx.Err() == nil {
		e.cfg.Logger.Warn("heartbeat: could not record this worker; the admin CLI may think no worker runs its definitions", "error", err)
	}
	// Rows of processes that died without deleting theirs.
	_, _ = e.c.DB().Exec(bctx, store.DeleteDeadWorkers)
	// Commands parked while no worker ran their version: this one does.
	for {
		n, err := e.c.ResumeDeadLetters(bctx, orchestrate.ResumeBatch)
		if err != nil && ctx.Err() == nil {
			e.cfg.Logger.Warn("heartbeat: could not send parked commands again; the next heartbeat tries again", "error", err)
		}
		if n < orchestrate.ResumeBatch || err != nil {
			break
		}
	}
}

// heartbeat beats every interval until ctx ends, then deletes this
// engine's row.
func (e *Engine) heartbeat(ctx context.Context) {
	t := time.NewTicker(HeartbeatIntervalDefault)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			_, _ = e.c.DB().Exec(dctx, store.DeleteWorker, pguuid.Of(e.id))
			cancel()
			return
		case <-t.C:
			e.beat(ctx)
		}
	}
}

// checkDeployment records what the deployment has not recorded yet and
// compares the rest with this process's: the shared settings, and the
// descriptions of the runnable definitions. worker adds the stream, which
// a client does not use.
func checkDeployment(ctx context.Context, c *orchestrate.Core, cfg *Config, worker bool) error {
	// One transaction: a process that refuses to start records nothing.
	tx, err := cfg.Pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("idemsaga: check the deployment: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	by := who()
	var errs []error
	for _, s := range sharedSettings(cfg, worker) {
		var value, setBy string
		var setAt time.Time
		err := recordOrRead(func() pgx.Row {
			return c.Schema().Q(tx).QueryRow(ctx, store.CheckSetting, s.name, s.value, by)
		}, &value, &setBy, &setAt)
		if err != nil {
			return fmt.Errorf("idemsaga: check the deployment's %s: %w", s.name, err)
		}
		if value != s.value {
			errs = append(errs, fmt.Errorf("%w: %s is %q here but %q in the deployment (recorded by %s at %s); give every process the same %s, or record a new one for all with `migrate`",
				ErrDeploymentMismatch, s.name, s.value, value, setBy, setAt.Format(time.RFC3339), s.flag))
		}
	}
	for _, d := range c.Versions() {
		if !d.Runnable() {
			continue
		}
		desc := d.Describe()
		var fp, setBy string
		var setAt time.Time
		var recorded saga.Description
		err := recordOrRead(func() pgx.Row {
			return c.Schema().Q(tx).QueryRow(ctx, store.CheckDefinition,
				d.Name(), desc, desc.Fingerprint(), by, d.Version())
		}, &fp, &recorded, &setBy, &setAt)
		if err != nil {
			return fmt.Errorf("idemsaga: check definition %s against the deployment's: %w", d.Ref(), err)
		}
		if fp != desc.Fingerprint() {
			errs = append(errs, fmt.Errorf("%w: definition %s differs from the deployment's (recorded by %s at %s): %s; run the same build everywhere, give the changed definition a new version (saga.WithVersion), or record this one for all with `migrate` and restart the others",
				ErrDeploymentMismatch, d.Ref(), setBy, setAt.Format(time.RFC3339), describeDifference(recorded, desc)))
		}
	}
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("idemsaga: check the deployment: %w", err)
	}
	return nil
}
