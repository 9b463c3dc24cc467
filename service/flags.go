package service

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/seal"
	"github.com/idemsaga/idemsaga/migrations"
	"github.com/idemsaga/idemsaga/saga"
)

// DatabaseURLDefault is used when neither --database-url nor DATABASE_URL
// is set.
const DatabaseURLDefault = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// NATSURLDefault is used when neither --nats-url nor NATS_URL is set.
const NATSURLDefault = "nats://127.0.0.1:4222"

// Flags are the global flags every command shares, each with an
// environment variable as fallback. The settings marked "shared" must be
// the same in every process of a deployment; each process checks its own
// against the deployment's record at start (`migrate` records them).
type Flags struct {
	DatabaseURL string `name:"database-url" env:"DATABASE_URL" default:"${database_url}" help:"PostgreSQL connection string; TLS through its sslmode, sslrootcert, sslcert and sslkey parameters."`
	NATSURL     string `name:"nats-url" env:"NATS_URL" default:"${nats_url}" help:"NATS server(s) with JetStream, comma-separated; tls:// for TLS."`
	NATSCreds   string `name:"nats-creds" env:"NATS_CREDS" type:"path" help:"NATS credentials file (JWT and NKey seed), as nsc or a NATS operator issues."`
	NATSNKey    string `name:"nats-nkey" env:"NATS_NKEY" type:"path" help:"File holding an NKey seed to authenticate to NATS with."`
	NATSCert    string `name:"nats-tls-cert" env:"NATS_TLS_CERT" type:"path" help:"Client certificate (PEM) for NATS mutual TLS; needs --nats-tls-key."`
	NATSKey     string `name:"nats-tls-key" env:"NATS_TLS_KEY" type:"path" help:"Private key (PEM) of --nats-tls-cert."`
	NATSCA      string `name:"nats-tls-ca" env:"NATS_TLS_CA" type:"path" help:"CA certificate(s) (PEM) to verify the NATS server with."`

	Schema                string        `name:"schema" env:"IDEMSAGA_SCHEMA" default:"idemsaga" help:"PostgreSQL schema of the deployment's tables (shared): two deployments, each with its own --stream and --subject-prefix, share a database in two schemas. Apply migrate with it first."`
	Stream                string        `name:"stream" env:"IDEMSAGA_STREAM" default:"${stream}" help:"JetStream stream name (shared)."`
	SubjectPrefix         string        `name:"subject-prefix" env:"IDEMSAGA_SUBJECT_PREFIX" default:"${prefix}" help:"Prefix of every subject (shared)."`
	StreamReplicas        int           `name:"stream-replicas" env:"IDEMSAGA_STREAM_REPLICAS" help:"Replicas of the stream, 1 to 5 (3 with a JetStream cluster). A new stream gets it (default 1); an existing one is updated to it. Unset: an existing stream keeps its own."`
	StreamStorage         string        `name:"stream-storage" env:"IDEMSAGA_STREAM_STORAGE" enum:",file,memory" default:"" help:"Storage of a new stream: file (default) or memory; an existing stream with other storage is refused."`
	StreamMaxAge          time.Duration `name:"stream-max-age" env:"IDEMSAGA_STREAM_MAX_AGE" help:"Drop stream messages older than this (PostgreSQL drives a lost command again at its lease). Unset: none for a new stream; an existing one keeps its own."`
	StreamDuplicateWindow time.Duration `name:"stream-duplicate-window" env:"IDEMSAGA_STREAM_DUPLICATE_WINDOW" help:"Nats-Msg-Id dedup window of the stream (a fast path only; default 2m for a new stream). Unset: an existing stream keeps its own."`
	LeaseGrace            time.Duration `name:"lease-grace" env:"IDEMSAGA_LEASE_GRACE" default:"30s" help:"Added to a step's timeout to make its lease (shared)."`
	PayloadKeysFile       string        `name:"payload-keys-file" env:"IDEMSAGA_PAYLOAD_KEYS_FILE" type:"path" help:"Seal sagas' inputs and results at rest with AES-256-GCM: a file of keys, one a line as <id> <base64 of 32 random bytes>; the first seals, every one opens (rotate by putting a new key first). Every process of the deployment needs it to run steps; without it a process shows sealed data as it is."`
	LogLevel              string        `name:"log-level" env:"LOG_LEVEL" default:"info" enum:"debug,info,warn,error" help:"Log level (debug, info, warn, error)."`
	LogFormat             string        `name:"log-format" env:"LOG_FORMAT" default:"text" enum:"text,json" help:"Log format (text or json)."`

	cfg  *Config
	defs []*saga.Definition
	// codec is --payload-keys-file's keyring, read by OpenDB.
	codec       saga.Codec
	out, errOut io.Writer
}

// Definitions returns the service's definitions.
func (f *Flags) Definitions() []*saga.Definition { return f.defs }

// Stdout is where commands print their results.
func (f *Flags) Stdout() io.Writer { return f.out }

// Logger returns a logger to stderr at --log-level, as --log-format.
func (f *Flags) Logger() *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(f.LogLevel))
	opts := &slog.HandlerOptions{Level: l}
	var w io.Writer = os.Stderr
	if f.errOut != nil {
		w = f.errOut
	}
	if f.LogFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}

// EngineConfig returns the engine settings of the flags: the shared ones
// and the service's definitions, on pool.
func (f *Flags) EngineConfig(pool *pgxpool.Pool) engine.Config {
	return engine.Config{Pool: pool, Schema: f.Schema, Codec: f.codec, Definitions: f.defs, Stream: f.Stream, SubjectPrefix: f.SubjectPrefix, LeaseGrace: f.LeaseGrace, Logger: f.Logger(),
		StreamReplicas: f.StreamReplicas, StreamStorage: f.StreamStorage, StreamMaxAge: f.StreamMaxAge, StreamDuplicateWindow: f.StreamDuplicateWindow}
}

// Client returns a saga client configured like the deployment's workers.
func (f *Flags) Client(pool *pgxpool.Pool) (*engine.Client, error) {
	return engine.NewClient(f.EngineConfig(pool))
}

// OpenDB opens a pool of at most maxConns connections (0: pgx's default)
// and checks the database answers, with an error that says what to do
// when it does not. The error never holds the password.
func (f *Flags) OpenDB(ctx context.Context, maxConns int32) (*pgxpool.Pool, error) {
	if err := f.loadPayloadKeys(); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(f.DatabaseURL)
	if err != nil {
		return nil, errors.New("DATABASE_URL is not a valid PostgreSQL connection string (postgres://user@host:5432/db?sslmode=…): check its form")
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		// Per host: with several hosts a dead one costs this much of
		// each new connection (connect_timeout in the URL overrides it).
		cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open database: %s", redact(err.Error(), cfg.ConnConfig.Password))
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, dbError(cfg.ConnConfig, err)
	}
	return pool, nil
}

func dbError(c *pgx.ConnConfig, err error) error {
	var pgErr *pgconn.PgError
	at := dbHosts(c)
	switch {
	case errors.As(err, &pgErr) && pgErr.Code == "3D000":
		return fmt.Errorf("database %q does not exist on %s: create it (createdb -h %s -U %s %s) or point DATABASE_URL at another", c.Database, at, c.Host, c.User, c.Database)
	case errors.As(err, &pgErr) && (pgErr.Code == "28P01" || pgErr.Code == "28000"):
		return fmt.Errorf("PostgreSQL at %s refused user %q (%s): check the user and password in DATABASE_URL", at, c.User, pgErr.Code)
	}
	if strings.Contains(err.Error(), "read only connection") {
		return fmt.Errorf("no server of %s accepts writes (target_session_attrs): the primary is down or a failover is under way; promote a replica, or wait for the one in progress", at)
	}
	var netErr net.Error
	if errors.As(err, &netErr) || errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("cannot reach PostgreSQL at %s: start it (scripts/ensure-postgres.sh in the idemsaga repository sets one up) or set DATABASE_URL", at)
	}
	return fmt.Errorf("cannot use PostgreSQL at %s (%s): check DATABASE_URL", at, redact(err.Error(), c.Password))
}

// dbHosts names the server, or every server of a multi-host DATABASE_URL.
func dbHosts(c *pgx.ConnConfig) string {
	hosts := []string{fmt.Sprintf("%s:%d", c.Host, c.Port)}
	for _, f := range c.Fallbacks {
		if h := fmt.Sprintf("%s:%d", f.Host, f.Port); !slices.Contains(hosts, h) {
			hosts = append(hosts, h)
		}
	}
	return strings.Join(hosts, ", ")
}

// ConnectNATS connects to --nats-url with the security flags, reconnecting
// forever after a loss. The error says what to do and never holds a
// password, token or seed.
func (f *Flags) ConnectNATS(clientName string) (*nats.Conn, error) {
	log := f.Logger()
	opts := []nats.Option{nats.Name(clientName), nats.Timeout(5 * time.Second),
		nats.MaxReconnects(-1), nats.ReconnectWait(250 * time.Millisecond),
		nats.DisconnectErrHandler(func(nc *nats.Conn, err error) {
			if err == nil && nc.IsClosed() {
				return // this process closed it
			}
			msg := ""
			if err != nil {
				msg = redactSecrets(err.Error())
			}
			log.Warn("NATS connection lost; reconnecting (steps wait, sagas are safe in PostgreSQL)", "error", msg)
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) { log.Info("NATS connection back", "server", nc.ConnectedServerId()) }),
	}
	security, err := f.natsSecurity()
	if err != nil {
		return nil, err
	}
	opts = append(opts, security...)
	shown, secrets := redactURLs(f.NATSURL)
	nc, err := nats.Connect(f.NATSURL, opts...)
	if err != nil {
		return nil, natsConnectError(shown, redact(err.Error(), secrets...), errors.Is(err, nats.ErrAuthorization))
	}
	return nc, nil
}

// redactURLs returns a comma-separated list of URLs with their user
// information replaced, and the secrets it held.
func redactURLs(list string) (string, []string) {
	var shown, secrets []string
	for _, raw := range strings.Split(list, ",") {
		raw = strings.TrimSpace(raw)
		if !strings.Contains(raw, "://") {
			raw = "nats://" + raw // as the NATS client reads it
		}
		u, err := url.Parse(raw)
		if err != nil || u.User == nil {
			if err != nil {
				shown = append(shown, "(an unparsable URL)")
				secrets = append(secrets, raw)
				continue
			}
			shown = append(shown, u.Redacted())
			continue
		}
		secrets = append(secrets, u.User.Username())
		if p, ok := u.User.Password(); ok {
			secrets = append(secrets, p)
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else {
			u.User = url.User("xxxxx") // a bare token
		}
		shown = append(shown, u.String())
	}
	return strings.Join(shown, ","), secrets
}

// redact replaces every secret in s.
func redact(s string, secrets ...string) string {
	for _, sec := range secrets {
		if len(sec) >= 3 {
			s = strings.ReplaceAll(s, sec, "xxxxx")
		}
	}
	return redactSecrets(s)
}

// redactSecrets hides what looks like an NKey seed (SU…, SA…, SO…).
func redactSecrets(s string) string {
	words := strings.Fields(s)
	for _, w := range words {
		if len(w) >= 56 && w[0] == 'S' && strings.ToUpper(w) == w {
			s = strings.ReplaceAll(s, w, "xxxxx")
		}
	}
	return s
}

// checkMigrated fails, saying to run migrate, when the engine's tables or
// the service's lack this build's migrations.
func (f *Flags) checkMigrated(ctx context.Context, pool *pgxpool.Pool) error {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("database unreachable (check DATABASE_URL and that PostgreSQL runs): %w", err)
	}
	defer conn.Release()
	if _, _, err := migrations.CheckSchema(ctx, conn.Conn(), f.Schema); err != nil {
		return f.migrateHint(err)
	}
	for _, m := range f.cfg.Migrations {
		files, err := m.files()
		if err != nil {
			return err
		}
		if _, _, err := migrations.CheckApplied(ctx, conn.Conn(), m.Schema, files); err != nil {
			return f.migrateHint(err)
		}
	}
	return nil
}

func (f *Flags) migrateHint(err error) error {
	return errors.New(strings.ReplaceAll(err.Error(), "`migrate`", "`"+name(*f.cfg)+" migrate`"))
}

// hostPID names this process in client names.
func hostPID(what string) string {
	host, _ := os.Hostname()
	return fmt.Sprintf("%s-%s-%d", what, host, os.Getpid())
}

// loadPayloadKeys reads --payload-keys-file into the codec, once. Its
// errors name the file, never a key.
func (f *Flags) loadPayloadKeys() error {
	if f.PayloadKeysFile == "" || f.codec != nil {
		return nil
	}
	b, err := os.ReadFile(f.PayloadKeysFile)
	if err != nil {
		return fmt.Errorf("cannot read the payload keys file %s (%v): create it with one key a line, `echo k1 $(openssl rand -base64 32) > %s`, or point --payload-keys-file at it", f.PayloadKeysFile, errors.Unwrap(err), f.PayloadKeysFile)
	}
	keys, err := seal.ParseKeys(string(b))
	if err != nil {
		return fmt.Errorf("%w (file %s)", err, f.PayloadKeysFile)
	}
	pk := make([]engine.PayloadKey, len(keys))
	for i, k := range keys {
		pk[i] = engine.PayloadKey{ID: k.ID, Secret: k.Secret}
	}
	f.codec, err = engine.NewAESGCM(pk...)
	return err
}
