package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"syscall"

	"github.com/alecthomas/kong"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// Config describes a service: its sagas, its tables and what it adds to
// the standard commands. Everything is optional, but `run` needs
// Definitions: a binary without them is an admin tool, which starts,
// shows and repairs sagas from the definitions the deployment recorded
// while the workers that have their code run the steps.
type Config struct {
	// Name is the binary's name in help and messages. Defaults to the
	// base name of os.Args[0].
	Name string
	// Description is the one line `--help` starts with.
	Description string
	// Definitions are the sagas the service runs (`run` needs them).
	Definitions []*saga.Definition
	// DefinitionsFunc, if set, builds the definitions after the flags are
	// parsed, for definitions that depend on the service's own flags
	// (Flags). It is used instead of Definitions.
	DefinitionsFunc func() ([]*saga.Definition, error)
	// Migrations are the service's own tables, applied by `migrate` after
	// the engine's and checked by `run`.
	Migrations []Migration
	// Checks are the service's invariants, run by `reconcile` after the
	// engine's.
	Checks []Check
	// Flags, if set, is a pointer to a struct of the service's own global
	// flags, with kong tags (`help:"…" env:"…" default:"…"`).
	Flags any
	// Commands are the service's own commands, beside the standard ones.
	Commands []Command
}

// Migration is one schema of the service's own tables: numbered .sql
// files (001_….sql, 002_….sql), applied in order with
// github.com/jackc/tern/v2 and recorded in <Schema>.schema_version.
type Migration struct {
	// Schema holds the tables; it is created when missing. Required.
	Schema string
	// Files holds the .sql files at its root, or in a folder named
	// migrations (as `//go:embed migrations/*.sql` gives). Required.
	Files fs.FS
}

// Check is one invariant of the service's data, checked by `reconcile`:
// it returns a sentence per difference found (none when all is well).
type Check struct {
	// Name labels the check's differences.
	Name string
	// Func runs the check on the deployment's database.
	Func func(ctx context.Context, pool *pgxpool.Pool) ([]string, error)
}

// Command is a command of the service's own. Cmd is a pointer to a
// struct with kong tags for its flags and arguments and a method
// `Run(ctx context.Context, f *service.Flags) error`.
type Command struct {
	Name string
	Help string
	Cmd  any
}

// Main runs the command line of os.Args and exits: 0 on success, 1 on
// an error (printed on stderr), 2 on a usage error. SIGINT and SIGTERM
// cancel the command's context, which `run` takes as the signal to drain.
func Main(cfg Config) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := Run(ctx, cfg, os.Args[1:])
	stop()
	var exit *ExitError
	switch {
	case err == nil:
		os.Exit(0)
	case errors.As(err, &exit):
		if exit.Err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", name(cfg), exit.Err)
		}
		os.Exit(exit.Code)
	default:
		fmt.Fprintf(os.Stderr, "%s: %v\n", name(cfg), err)
		os.Exit(1)
	}
}

// ExitError is an error with the exit status Main uses for it: a usage
// error (2), or a saga that ended other than in its final state
// (`start --wait`: 3).
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}

func (e *ExitError) Unwrap() error { return e.Err }

func name(cfg Config) string {
	if cfg.Name != "" {
		return cfg.Name
	}
	return filepath.Base(os.Args[0])
}

// cli is the standard command set.
type cli struct {
	Flags

	Run         runCmd         `cmd:"" help:"Run a worker: outbox relay, step workers, orchestrator, reaper, cleaner and the HTTP API with /metrics, /healthz and /readyz, until SIGINT or SIGTERM, which drain it."`
	Steps       stepsCmd       `cmd:"" help:"Run step workers only: take step commands from the stream, run their attempts and answer each with a reply, which the engines of run relay and apply; scales steps apart from orchestration. Until SIGINT or SIGTERM, which drain it."`
	Migrate     migrateCmd     `cmd:"" help:"Create or update the engine's tables and the service's, and record this build's settings and definitions as the deployment's."`
	Start       startCmd       `cmd:"" help:"Start a saga (the same key and input give the same saga)."`
	List        listCmd        `cmd:"" help:"List sagas, newest first, filtered by definition, state, age or stuckness."`
	Show        showCmd        `cmd:"" aliases:"status" help:"Show a saga by ID or idempotency key, with every step and attempt."`
	Retry       retryCmd       `cmd:"" help:"Run a step again under its key at its next attempt: a failed saga's compensation, a parked saga's step, or a running step waiting out its backoff (now). One saga, or every saga a filter matches."`
	Cancel      cancelCmd      `cmd:"" help:"Stop a running or parked saga and compensate what it completed. One saga, or every saga a filter matches."`
	Skip        skipCmd        `cmd:"" help:"Mark a step succeeded with the result you give (a person checked it took effect, or undid it by hand) and go on. One saga, or every saga a filter matches."`
	Close       closeCmd       `cmd:"" help:"Close a failed or parked saga as handled: nothing runs for it any more. One saga, or every saga a filter matches."`
	Pause       pauseCmd       `cmd:"" help:"Hold a running saga, or every saga of a definition (--definition): no attempt starts and none is spent until resume."`
	Resume      resumeCmd      `cmd:"" help:"Let a paused saga or definition go on where it stopped, with the attempts it had."`
	Reconcile   reconcileCmd   `cmd:"" help:"Check the engine's invariants and the service's; print each difference and exit non-zero when any is found."`
	Workers     workersCmd     `cmd:"" help:"List the live workers and the definitions each runs."`
	DeadLetters deadLettersCmd `cmd:"" name:"dead-letters" help:"List, send again or drop commands parked because no worker that received them knew their definition, version or step."`
	Schedules   schedulesCmd   `cmd:"" help:"List the schedules, or pause or resume one: a paused schedule starts no saga, and its ticks meanwhile are skipped."`
	Events      eventsCmd      `cmd:"" help:"List or drop the events that could not start a saga (no key header, a refused body), kept with why."`
}

// Run runs one command line (args without the program name) and returns
// its error; Main is Run plus the exit status.
func Run(ctx context.Context, cfg Config, args []string) error {
	return run(ctx, cfg, args, os.Stdout, os.Stderr)
}

var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

func (cfg *Config) validate() error {
	for i, m := range cfg.Migrations {
		switch {
		case !schemaName.MatchString(m.Schema):
			return fmt.Errorf("service: Config.Migrations[%d].Schema %q must be a lower-case SQL identifier", i, m.Schema)
		case m.Schema == "idemsaga":
			return fmt.Errorf("service: Config.Migrations[%d].Schema is the engine's own schema; pick another", i)
		case m.Files == nil:
			return fmt.Errorf("service: Config.Migrations[%d].Files is nil", i)
		}
	}
	for i, c := range cfg.Commands {
		if c.Name == "" || c.Cmd == nil {
			return fmt.Errorf("service: Config.Commands[%d] needs a Name and a Cmd", i)
		}
	}
	return nil
}

func run(ctx context.Context, cfg Config, args []string, stdout, stderr io.Writer) error {
	if err := cfg.validate(); err != nil {
		return err
	}
	c := &cli{}
	c.Flags.cfg = &cfg
	c.Flags.out, c.Flags.errOut = stdout, stderr
	opts := []kong.Option{
		kong.Name(name(cfg)),
		kong.Description(cfg.Description),
		kong.UsageOnError(),
		kong.Writers(stdout, stderr),
		kong.Vars{"database_url": DatabaseURLDefault, "nats_url": NATSURLDefault, "stream": engine.StreamDefault, "prefix": engine.SubjectPrefixDefault},
		kong.BindTo(ctx, (*context.Context)(nil)),
		kong.Exit(func(code int) { panic(exitPanic{code}) }),
	}
	if cfg.Flags != nil {
		opts = append(opts, kong.Embed(cfg.Flags))
	}
	for _, cmd := range cfg.Commands {
		opts = append(opts, kong.DynamicCommand(cmd.Name, cmd.Help, "", cmd.Cmd))
	}
	parser, err := kong.New(c, opts...)
	if err != nil {
		return fmt.Errorf("service: %w", err)
	}
	kctx, err := parseArgs(parser, args)
	if err != nil {
		return err
	}
	if kctx == nil {
		return nil // --help
	}
	if cfg.DefinitionsFunc != nil {
		defs, err := cfg.DefinitionsFunc()
		if err != nil {
			return &ExitError{Code: 2, Err: err}
		}
		c.Flags.defs = defs
	} else {
		c.Flags.defs = cfg.Definitions
	}
	kctx.Bind(&c.Flags)
	return kctx.Run(&c.Flags)
}

// exitPanic carries kong's exit (after --help, or a usage error it
// printed) out of Parse without ending the process.
type exitPanic struct{ code int }

func parseArgs(parser *kong.Kong, args []string) (kctx *kong.Context, err error) {
	defer func() {
		if r := recover(); r != nil {
			p, ok := r.(exitPanic)
			if !ok {
				panic(r)
			}
			kctx = nil
			if p.code != 0 {
				err = &ExitError{Code: 2}
			}
		}
	}()
	kctx, err = parser.Parse(args)
	if err != nil {
		parser.Errorf("%s", err)
		if pe, ok := err.(*kong.ParseError); ok && pe.Context != nil {
			_ = pe.Context.PrintUsage(true)
		}
		return nil, &ExitError{Code: 2}
	}
	return kctx, nil
}
