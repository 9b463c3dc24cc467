package service

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/alecthomas/kong"
	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/service/internal/console"
	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

type runCmd struct {
	HTTPAddr         string        `name:"http-addr" env:"HTTP_ADDR" default:"127.0.0.1:9464" help:"Address of the HTTP API (/v1), the web console (/ui/), /metrics, /healthz and /readyz; port 0 picks a free port (logged). Empty serves no HTTP."`
	APITokensFile    string        `name:"api-tokens-file" env:"IDEMSAGA_API_TOKENS_FILE" type:"path" help:"File of bearer tokens, one per line, each alone or as: <name> <read|start|operator> <definitions|*> <token>. Every /v1 request (and /metrics, unless --metrics-open) must carry one as Authorization: Bearer <token>; repairs are recorded under its name."`
	MetricsOpen      bool          `name:"metrics-open" env:"IDEMSAGA_METRICS_OPEN" help:"Serve /metrics without a token even when tokens are configured."`
	InsecureNoAuth   bool          `name:"insecure-no-auth" help:"Listen on a non-loopback address without API tokens (anyone who reaches it can start and cancel sagas)."`
	StepConcurrency  int           `name:"step-concurrency" default:"8" help:"Step commands handled at once."`
	ReplyConcurrency int           `name:"reply-concurrency" default:"4" help:"Replies applied at once."`
	MaxConns         int32         `name:"max-conns" default:"20" help:"Database connections of this process."`
	DrainTimeout     time.Duration `name:"drain-timeout" default:"30s" help:"How long SIGINT/SIGTERM waits for work in hand."`
	Migrate          bool          `help:"Apply migrations (and record the deployment) before starting."`
	AckWait          time.Duration `name:"ack-wait" default:"0s" help:"JetStream redelivery delay of unacknowledged messages (0: the longest step timeout + 30s, at least 60s)."`
	KeepFinished     time.Duration `name:"keep-finished" default:"168h" help:"How long finished sagas and their inbox records are kept (the replay window); a key can start a new saga after it."`
	KeepPublished    time.Duration `name:"keep-published" default:"0s" help:"How long published outbox rows are kept (0: deleted once the broker acknowledged them)."`
	RelayHandOff     time.Duration `name:"relay-hand-off" default:"10s" help:"How long the relay leaves an outbox row to the process that committed it; past it the relay publishes what is still there."`
	NoRetention      bool          `name:"no-retention" help:"Keep everything forever (run no cleaner)."`
	ArchiveDir       string        `name:"archive-dir" env:"IDEMSAGA_ARCHIVE_DIR" type:"path" placeholder:"DIR" help:"Write each finished saga the cleaner deletes, with its steps, attempts, repairs and callbacks, to gzip-compressed JSON Lines files in DIR (which must exist and be writable) before deleting it; read one with show --archive FILE."`
	SubmitTokenTTL   time.Duration `name:"submit-token-ttl" default:"1h" help:"Time to live of a submit token POST /v1/tokens issues without ttl_seconds (1m to 24h); requests may ask for up to 24h."`
	MetricsFile      string        `name:"metrics-file" hidden:"" help:"Write the engine's counters as JSON to this file every 500ms (for harnesses that kill workers)."`
	ShedOldestAge    time.Duration `name:"shed-oldest-age" env:"IDEMSAGA_SHED_OLDEST_AGE" default:"0s" help:"POST /v1/sagas/{definition} answers 503 with Retry-After, writing nothing, while the oldest message no worker was given yet has waited longer than this, or while the queued messages are predicted to wait longer than this: for each of the engine's consumers, its queue divided by the messages a second its workers took over the last 10 s in which that queue never ran dry, the longest of them (idemsaga_stream_drain_seconds). Until 3 s of such a pace are measured (at start-up, after an idle spell, while the workers keep up) nothing is predicted and only the age counts. 0: the lease grace."`
	ShedStreamMsgs   int           `name:"shed-stream-messages" env:"IDEMSAGA_SHED_STREAM_MESSAGES" default:"0" help:"Also answer starts 503 while more messages than this wait in the stream for a worker (0: no bound on the count, whose meaning depends on the throughput; the predicted wait of --shed-oldest-age follows it)."`
	NoShedding       bool          `name:"no-shedding" env:"IDEMSAGA_NO_SHEDDING" help:"Accept every start, however far behind the stream is (neither the age, the predicted wait nor the count sheds)."`
	ReconcileEvery   time.Duration `name:"reconcile-interval" env:"IDEMSAGA_RECONCILE_INTERVAL" default:"1m" help:"How often this process runs reconcile and sets the idemsaga_state_differences metric by check from what it found (failed and parked count sagas for a person; every other check must be 0); 0 runs none."`
	EmbeddedNATS     string        `name:"embedded-nats" env:"IDEMSAGA_EMBEDDED_NATS" type:"path" default:"" placeholder:"DIR" help:"Run a NATS server with JetStream inside this process, on 127.0.0.1, storing in DIR (created when missing; one process per folder), instead of connecting to --nats-url: for a single machine. Its URL is logged; other processes on the machine connect to it with NATS_URL. It stops after the drain. Admin commands need no NATS."`
	EmbeddedNATSPort int           `name:"embedded-nats-port" env:"IDEMSAGA_EMBEDDED_NATS_PORT" default:"0" help:"Port of --embedded-nats on 127.0.0.1; 0 picks a free one (logged). Fix one for other processes' NATS_URL."`
}

func (r *runCmd) Run(ctx context.Context, f *Flags, kctx *kong.Context) error {
	log := f.Logger()
	if len(f.defs) == 0 {
		return fmt.Errorf("%s has no saga definitions to run: give service.Config its Definitions (this binary can start, show and repair sagas, not run their steps)", name(*f.cfg))
	}
	if err := r.checkEmbeddedNATS(f, kctx); err != nil {
		return err
	}
	var tokens *httpapi.Tokens
	if r.APITokensFile != "" {
		var err error
		if tokens, err = httpapi.LoadTokens(r.APITokensFile); err != nil {
			return err
		}
	}
	if r.HTTPAddr != "" && (tokens == nil || tokens.Len() == 0) && !r.InsecureNoAuth && !loopback(r.HTTPAddr) {
		return fmt.Errorf("--http-addr %s is reachable from other machines, and no API tokens are configured: give --api-tokens-file (IDEMSAGA_API_TOKENS_FILE), listen on 127.0.0.1, or pass --insecure-no-auth", r.HTTPAddr)
	}
	if r.SubmitTokenTTL < engine.MinSubmitTokenTTL || r.SubmitTokenTTL > engine.MaxSubmitTokenTTL || r.SubmitTokenTTL%time.Second != 0 {
		return fmt.Errorf("--submit-token-ttl %s is not a whole number of seconds from %s to %s; give one such as 30m", r.SubmitTokenTTL, engine.MinSubmitTokenTTL, engine.MaxSubmitTokenTTL)
	}
	pool, err := f.OpenDB(ctx, r.MaxConns)
	if err != nil {
		return err
	}
	defer pool.Close()
	if r.Migrate {
		if err := (&migrateCmd{}).Run(ctx, f); err != nil {
			return err
		}
	}
	if err := f.checkMigrated(ctx, pool); err != nil {
		return err
	}
	stopNATS := func() {}
	if r.EmbeddedNATS != "" {
		srv, err := startEmbeddedNATS(r.EmbeddedNATS, r.EmbeddedNATSPort, log)
		if err != nil {
			return err
		}
		stopNATS = sync.OnceFunc(func() {
			srv.Shutdown()
			srv.WaitForShutdown()
			log.Info("embedded NATS stopped")
		})
		// After the connection's close, deferred below.
		defer stopNATS()
		f.NATSURL = srv.ClientURL()
		log.Info("embedded NATS with JetStream running; other processes on this machine connect with NATS_URL", "url", f.NATSURL, "store", r.EmbeddedNATS)
	}
	nc, err := f.ConnectNATS(hostPID(name(*f.cfg)))
	if err != nil {
		return err
	}
	defer nc.Close()
	closed := make(chan struct{})
	nc.SetClosedHandler(func(*nats.Conn) { close(closed) })
	reg := prometheus.NewRegistry()
	cfg := f.EngineConfig(pool)
	cfg.NATS, cfg.Logger, cfg.Registerer = nc, log, reg
	cfg.StepConcurrency, cfg.ReplyConcurrency = r.StepConcurrency, r.ReplyConcurrency
	cfg.AckWait, cfg.RelayHandOff = r.AckWait, r.RelayHandOff
	cfg.Retention = engine.RetentionConfig{FinishedSagas: r.KeepFinished, PublishedOutbox: r.KeepPublished, ArchiveDir: r.ArchiveDir}
	if r.NoRetention {
		// Kept forever: finished sagas, and published rows if any are kept.
		cfg.Retention.FinishedSagas = engine.KeepForever
		if r.KeepPublished > 0 {
			cfg.Retention.PublishedOutbox = engine.KeepForever
		}
	}
	if r.ShedOldestAge < 0 || r.ShedStreamMsgs < 0 {
		return fmt.Errorf("--shed-oldest-age (%s) and --shed-stream-messages (%d) must not be negative: 0 takes the default (the lease grace; no bound on the count), and --no-shedding sheds nothing", r.ShedOldestAge, r.ShedStreamMsgs)
	}
	cfg.ShedOldestAge, cfg.ShedStreamMessages = r.ShedOldestAge, r.ShedStreamMsgs
	if r.NoShedding {
		cfg.ShedOldestAge, cfg.ShedStreamMessages = engine.NoShedding, 0
	}
	switch {
	case r.ReconcileEvery < 0:
		return fmt.Errorf("--reconcile-interval (%s) must not be negative: 0 runs no reconcile in this process", r.ReconcileEvery)
	case r.ReconcileEvery == 0:
		cfg.ReconcileInterval = engine.NoReconcile
	default:
		cfg.ReconcileInterval = r.ReconcileEvery
	}
	tp, err := newTracerProvider(ctx, name(*f.cfg), log)
	if err != nil {
		return err
	}
	if tp != nil {
		cfg.TracerProvider = tp
	}
	// After the engine's drain.
	defer shutdownTracing(tp, log)
	e, err := engine.New(cfg)
	if err != nil {
		return err
	}
	if r.MetricsFile != "" {
		stopMetrics := writeMetricsEvery(reg, r.MetricsFile, 500*time.Millisecond)
		defer stopMetrics()
	}
	// The signal that ends ctx drains the engine (below); Start's context
	// must not stop it at once.
	if err := e.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	var ops *opsServer
	if r.HTTPAddr != "" {
		api, err := httpapi.New(httpapi.Config{Client: e.Client(), Tokens: tokens, Logger: log, SubmitTokenTTL: r.SubmitTokenTTL, Gatherer: reg,
			TraceRequests: tp != nil, ShedFunc: e.ShedStart})
		if err != nil {
			_ = e.Stop(context.Background())
			return err
		}
		metrics := promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)})
		if tokens != nil && tokens.Len() > 0 && !r.MetricsOpen {
			metrics = tokens.Require(metrics)
		}
		if ops, err = newOpsServer(r.HTTPAddr, reg, e.Ready, log, api, metrics); err != nil {
			_ = e.Stop(context.Background())
			return err
		}
	}
	log.Info("worker running; SIGINT or SIGTERM drains and stops", "pid", os.Getpid(), "stream", f.Stream, "definitions", len(f.defs))
	<-ctx.Done()
	log.Info("draining")
	sctx, cancel := context.WithTimeout(context.Background(), r.DrainTimeout)
	defer cancel()
	// Stop taking HTTP requests first, so that every saga an answer
	// promised is relayed by this process's final flush.
	if ops != nil {
		if err := ops.Shutdown(sctx); err != nil {
			log.Warn("http server shutdown", "error", err)
		}
	}
	if err := e.Stop(sctx); err != nil {
		// What still runs past the drain is cancelled: each attempt
		// records what it knows, rather than leave it to its lease.
		log.Warn("drain: work still in hand after --drain-timeout; cancelling it", "drain_timeout", r.DrainTimeout)
		cctx, cancel := context.WithTimeout(context.Background(), cancelTimeout)
		defer cancel()
		if err := e.StopAndCancel(cctx); err != nil {
			return fmt.Errorf("drain: %w", err)
		}
	}
	if err := nc.Drain(); err != nil {
		log.Warn("nats drain", "error", err)
	} else if r.EmbeddedNATS != "" {
		// The server goes with this process: let the drain end first.
		select {
		case <-closed:
		case <-sctx.Done():
			log.Warn("nats drain did not end before --drain-timeout")
		}
	}
	stopNATS()
	log.Info("stopped cleanly")
	return nil
}

// cancelTimeout bounds the wait for the work StopAndCancel cancels, after
// the drain ran out: handlers that honour their context return at once.
const cancelTimeout = 10 * time.Second

// checkEmbeddedNATS refuses --embedded-nats with a NATS server named
// (--nats-url or NATS_URL) or the flags that secure a connection to one:
// the embedded server listens on 127.0.0.1 only, without authentication
// or TLS.
func (r *runCmd) checkEmbeddedNATS(f *Flags, kctx *kong.Context) error {
	if r.EmbeddedNATS == "" {
		if r.EmbeddedNATSPort != 0 {
			return fmt.Errorf("--embedded-nats-port %d is the port of --embedded-nats, which is not given: give --embedded-nats DIR too, or drop --embedded-nats-port", r.EmbeddedNATSPort)
		}
		return nil
	}
	if os.Getenv("NATS_URL") != "" || flagGiven(kctx, "nats-url") {
		shown, _ := redactURLs(f.NATSURL)
		return fmt.Errorf("--embedded-nats (IDEMSAGA_EMBEDDED_NATS) runs a NATS server in this process, and --nats-url or NATS_URL (%s) names another: give one of them (unset NATS_URL, or drop --embedded-nats)", shown)
	}
	for _, sec := range []struct{ flag, value string }{
		{"--nats-creds", f.NATSCreds}, {"--nats-nkey", f.NATSNKey},
		{"--nats-tls-cert", f.NATSCert}, {"--nats-tls-key", f.NATSKey}, {"--nats-tls-ca", f.NATSCA},
	} {
		if sec.value != "" {
			return fmt.Errorf("--embedded-nats runs a NATS server on 127.0.0.1 without authentication or TLS, and %s is for a server that has them: drop %s (or its environment variable), or connect to that server with --nats-url instead", sec.flag, sec.flag)
		}
	}
	if r.EmbeddedNATSPort < 0 || r.EmbeddedNATSPort > 65535 {
		return fmt.Errorf("--embedded-nats-port %d is not a port: give one from 1 to 65535, or 0 for a free one", r.EmbeddedNATSPort)
	}
	return nil
}

// flagGiven reports whether the command line (not the environment or a
// default) gave the flag.
func flagGiven(kctx *kong.Context, name string) bool {
	if kctx == nil {
		return false
	}
	for _, p := range kctx.Path {
		if p.Flag != nil && p.Flag.Name == name {
			return true
		}
	}
	return false
}

// loopback reports whether addr (host:port) listens on loopback only.
func loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// readyKind names, without detail, what a readiness check found.
func readyKind(err error) string {
	msg := err.Error()
	switch {
	case strings.Contains(msg, "not started"):
		return "engine not started"
	case strings.Contains(msg, "migrat"):
		return "database not migrated"
	case strings.Contains(msg, "database"):
		return "database unreachable"
	case strings.Contains(msg, "broker"):
		return "broker not connected"
	}
	return "engine not ready"
}

// opsServer serves the API, the console, /metrics, /healthz and /readyz.
type opsServer struct {
	srv  *http.Server
	ln   net.Listener
	done chan error
}

func newOpsServer(addr string, reg *prometheus.Registry, ready func(context.Context) error, log *slog.Logger, api, metrics http.Handler) (*opsServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --http-addr %s: %w (pick a free port, or 0 for any)", addr, err)
	}
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		_ = ln.Close()
		return nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		_ = ln.Close()
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("/v1/", api)
	mux.Handle("GET /metrics", metrics)
	mux.Handle(console.Prefix, console.Handler())
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		defer cancel()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if err := ready(ctx); err != nil {
			// The reason goes to the log: it may name hosts and users,
			// and /readyz is open.
			log.Warn("not ready", "error", err)
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "not ready: %s (the worker's log says why)\n", readyKind(err))
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	s := &opsServer{ln: ln, done: make(chan error, 1),
		srv: &http.Server{Handler: problemsOutside(mux), ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute,
			ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}}
	go func() {
		err := s.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	log.Info("serving the API (/v1), the console (/ui/), /metrics, /healthz and /readyz", "addr", "http://"+ln.Addr().String())
	return s, nil
}

// Shutdown stops accepting and waits for requests in flight.
func (s *opsServer) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if serveErr := <-s.done; err == nil {
		err = serveErr
	}
	return err
}

// writeMetricsEvery writes reg's counters to path every interval (through
// a temporary file and a rename, so readers never see half a file) until
// the returned function is called, which writes them a last time.
func writeMetricsEvery(reg *prometheus.Registry, path string, every time.Duration) func() {
	done := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			_ = writeMetrics(reg, path)
			select {
			case <-done:
				_ = writeMetrics(reg, path)
				return
			case <-t.C:
			}
		}
	}()
	return func() { close(done); <-stopped }
}

func writeMetrics(reg *prometheus.Registry, path string) error {
	families, err := reg.Gather()
	if err != nil {
		return err
	}
	out := map[string]float64{}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			for _, lp := range m.GetLabel() {
				name += "|" + lp.GetName() + "=" + lp.GetValue()
			}
			switch {
			case m.GetCounter() != nil:
				out[name] = m.GetCounter().GetValue()
			case m.GetHistogram() != nil:
				out[name+"|count"] = float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	b, err := json.Marshal(out)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// opsMethods are the methods tried to fill in a 405's Allow header.
var opsMethods = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete, http.MethodOptions}

// problemsOutside answers the requests no route of mux takes as the API
// answers its own: a problem body, 404, or 405 with Allow.
func problemsOutside(mux *http.ServeMux) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, pattern := mux.Handler(r); pattern != "" {
			mux.ServeHTTP(w, r)
			return
		}
		var allow []string
		for _, m := range opsMethods {
			probe := r.Clone(r.Context())
			probe.Method = m
			if _, p := mux.Handler(probe); p != "" {
				allow = append(allow, m)
			}
		}
		if len(allow) == 0 {
			httpapi.WriteProblem(w, http.StatusNotFound, httpapi.ProblemNotFound, "Not found",
				"no route has the path "+strconv.Quote(r.URL.Path)+"; this server serves /v1/ (the API), /ui/ (the console), /metrics, /healthz and /readyz")
			return
		}
		w.Header().Set("Allow", strings.Join(allow, ", "))
		httpapi.WriteProblem(w, http.StatusMethodNotAllowed, httpapi.ProblemMethodNotAllowed, "Method not allowed",
			r.Method+" is not served on "+strconv.Quote(r.URL.Path)+"; it takes "+strings.Join(allow, ", "))
	})
}
