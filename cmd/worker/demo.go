package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/schollz/progressbar/v3"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

type demoCmd struct {
	DBName    string        `name:"db-name" default:"idemsaga_demo" help:"Database the demo creates afresh on the DATABASE_URL server (dropped and recreated at each run)."`
	Transfers int           `default:"300" help:"Transfers to submit."`
	Accounts  int           `default:"20" help:"Accounts to seed; the last one is frozen, so credits to it fail and are compensated."`
	Pools     int           `default:"2" help:"Worker pools (engines) sharing the database and the stream."`
	Timeout   time.Duration `default:"3m" help:"How long to wait for every saga to finish."`
	Serve     bool          `help:"Keep the metrics endpoint up after the summary, until Ctrl-C."`
	HTTPAddr  string        `name:"http-addr" env:"HTTP_ADDR" default:"127.0.0.1:9464" help:"Address of the metrics endpoint with --serve (port 0 picks one)."`
	Redeliver float64       `default:"0.1" help:"Fraction of commands the demo publishes a second time under a new message id, as a broker redelivery would; the inbox absorbs them."`
}

func (d *demoCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	if d.Transfers < 1 || d.Accounts < 3 || d.Pools < 1 {
		return errors.New("--transfers and --pools must be at least 1, --accounts at least 3")
	}
	if d.Redeliver < 0 || d.Redeliver > 1 {
		return fmt.Errorf("--redeliver %g must be a fraction between 0 and 1", d.Redeliver)
	}
	log := newLogger("warn")
	if g.LogLevel == "debug" {
		log = newLogger(g.LogLevel)
	}

	// A fresh database on the configured server, and an embedded NATS
	// server with JetStream in a temporary folder.
	dsn, pool, err := freshDatabase(ctx, g, d.DBName, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	ns, _, stopNATS, err := embeddedNATS("idemsaga-demo-")
	if err != nil {
		return err
	}
	defer stopNATS()

	frozen := int64(d.Accounts)
	const balance = 10_000
	seeded, err := transfer.Seed(ctx, pool, d.Accounts, balance, frozen)
	if err != nil {
		return err
	}

	fmt.Printf("idemsaga demo: %d transfers, %d accounts (account %d frozen), %d worker pools, embedded NATS at %s, database %s\n",
		d.Transfers, d.Accounts, frozen, d.Pools, ns.ClientURL(), d.DBName)
	fmt.Printf("  10%% of credits go to the frozen account, 3%% of transfers overdraw, 10%% are submitted twice, %.0f%% of commands are delivered twice\n\n", d.Redeliver*100)

	// One registry; each pool's series carry a pool label.
	reg := prometheus.NewRegistry()
	regs := []*prometheus.Registry{reg}
	engines, stopPools, err := startPools(ctx, d.Pools, dsn, ns.ClientURL(), 8, func(i int, cfg *engine.Config) {
		cfg.Logger = log
		cfg.Registerer = prometheus.WrapRegistererWith(prometheus.Labels{"pool": strconv.Itoa(i + 1)}, reg)
		cfg.LeaseGrace, cfg.RelayPollInterval = 10*time.Second, 20*time.Millisecond
	})
	if err != nil {
		return err
	}
	defer stopPools()

	// Simulated redeliveries: copy a fraction of the commands back into the
	// stream under a fresh message id, so the broker's dedup cannot drop
	// them and the step workers' inbox must.
	stopCopies := func() {}
	if d.Redeliver > 0 {
		if stopCopies, err = redeliverCommands(ns.ClientURL(), engine.SubjectPrefixDefault, d.Redeliver); err != nil {
			return err
		}
		defer stopCopies()
	}

	// The workload: 10% of credits go to the frozen account, 3% of
	// transfers ask for more than the source holds, 10% are submitted twice
	// with the same key (half of those at the same moment).
	rng := rand.New(rand.NewPCG(42, uint64(d.Transfers)))
	type job struct {
		key   string
		in    transfer.Input
		twice bool
	}
	jobs := make([]job, d.Transfers)
	for i := range jobs {
		from := 1 + rng.Int64N(frozen-1)
		to := 1 + (from+rng.Int64N(frozen-2))%(frozen-1)
		amount := 1 + rng.Int64N(100)
		switch {
		case i%10 == 3:
			to = frozen
		case i%33 == 5:
			amount = 10 * balance
		}
		jobs[i] = job{key: fmt.Sprintf("demo-%05d", i), in: transfer.Input{From: from, To: to, Amount: amount}, twice: i%10 == 7}
	}

	// The progress bar's clocks start with the sagas: they otherwise start
	// at its first update, whose rate is then every saga already finished
	// over a few microseconds.
	bar := progressbar.NewOptions(d.Transfers,
		progressbar.OptionSetWriter(os.Stderr),
		progressbar.OptionSetDescription("sagas finished"),
		progressbar.OptionShowCount(),
		progressbar.OptionShowIts(),
		progressbar.OptionSetItsString("sagas"),
		progressbar.OptionThrottle(100*time.Millisecond),
		progressbar.OptionClearOnFinish(),
	)
	bar.StartWithoutRender()
	start := time.Now()
	var submitted, dupReplies atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	errc := make(chan error, 1)
	submit := func(i, copyNo int) {
		defer wg.Done()
		sem <- struct{}{}
		defer func() { <-sem }()
		res, err := engines[(i+copyNo)%len(engines)].Client().Start(ctx, transfer.Definition, jobs[i].key, jobs[i].in)
		if err != nil {
			select {
			case errc <- err:
			default:
			}
			return
		}
		submitted.Add(1)
		if res.Duplicate {
			dupReplies.Add(1)
		}
	}
	for i := range jobs {
		copies := 1
		if jobs[i].twice {
			copies = 2
		}
		for c := range copies {
			wg.Add(1)
			go submit(i, c)
		}
	}
	wg.Wait()
	select {
	case err := <-errc:
		return fmt.Errorf("submit: %w", err)
	default:
	}
	// A client that reuses a key for a different transfer is refused.
	_, reuseErr := engines[0].Client().Start(ctx, transfer.Definition, jobs[0].key, transfer.Input{From: 1, To: 2, Amount: 999})
	keyReuseRefused := errors.Is(reuseErr, saga.ErrIdempotencyKeyReused)

	// Wait for every saga to finish, with a progress bar.
	deadline := time.Now().Add(d.Timeout)
	for {
		var done, total int
		if err := pool.QueryRow(ctx, `select count(*) filter (where finished_at is not null), count(*) from idemsaga.sagas`).Scan(&done, &total); err != nil {
			return err
		}
		_ = bar.Set(done)
		if done == total {
			_ = bar.Finish()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d sagas still running after %s; inspect them with `worker status <id>` against database %s", total-done, d.Timeout, d.DBName)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	elapsed := time.Since(start)
	// Let the redelivered copies still queued be consumed (and absorbed).
	stopCopies()
	for range 100 {
		var pending int
		if err := pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&pending); err != nil {
			return err
		}
		if pending == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)

	rep, err := transfer.Audit(ctx, pool, seeded)
	if err != nil {
		return err
	}
	var deductFailed int
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where state = 'compensated' and error like '%insufficient funds%'`).Scan(&deductFailed); err != nil {
		return err
	}
	sum := func(name string, labels ...string) int {
		return int(counterSum(regs, name, labels...))
	}
	var p50, p99 float64
	if err := pool.QueryRow(ctx, `select coalesce(percentile_cont(0.5) within group (order by extract(epoch from finished_at - created_at)), 0),
  coalesce(percentile_cont(0.99) within group (order by extract(epoch from finished_at - created_at)), 0)
from idemsaga.sagas where finished_at is not null`).Scan(&p50, &p99); err != nil {
		return err
	}
	recon, err := reconcile(ctx, pool, []*saga.Definition{transfer.Definition}, 30*time.Second, seeded)
	if err != nil {
		return err
	}
	conserved := "conserved"
	if rep.Total != seeded {
		conserved = "NOT conserved"
	}
	reconText := "0 differences: engine and ledger invariants hold"
	if n := len(recon.Differences); n > 0 {
		reconText = fmt.Sprintf("%d DIFFERENCES", n)
	}
	fmt.Println()
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	row := func(k, format string, args ...any) { fmt.Fprintf(w, "  %s\t%s\n", k, fmt.Sprintf(format, args...)) }
	row("transfers", "%d (%d requests; %d answered as duplicates of an existing saga)", d.Transfers, submitted.Load(), dupReplies.Load())
	row("completed", "%d credited", rep.ByState["credited"])
	row("compensated", "%d (%d credits refused by the frozen account and refunded, %d deductions refused for insufficient funds)",
		rep.ByState["compensated"], rep.ByState["compensated"]-deductFailed, deductFailed)
	row("failed", "%d", rep.ByState["failed"])
	row("duplicates absorbed", "start %d, broker %d, step workers' memory %d, inbox %d, orchestrator %d",
		sum("idemsaga_duplicates_absorbed_total", "layer", "start"), sum("idemsaga_duplicates_absorbed_total", "layer", "broker"),
		sum("idemsaga_duplicates_absorbed_total", "layer", "recent"), sum("idemsaga_duplicates_absorbed_total", "layer", "inbox"),
		sum("idemsaga_duplicates_absorbed_total", "layer", "orchestrator"))
	row("key reused, other input", "refused=%v", keyReuseRefused)
	row("lease takeovers", "%d, retries %d", sum("idemsaga_lease_takeovers_total"), sum("idemsaga_retries_scheduled_total"))
	row("throughput", "%.0f sagas/s (%s wall time)", float64(d.Transfers)/elapsed.Seconds(), elapsed.Round(time.Millisecond))
	row("latency", "p50 %s, p99 %s (submit to terminal state)", secs(p50), secs(p99))
	row("money", "seeded %d, held now %d: %s", seeded, rep.Total, conserved)
	row("reconcile", "%s", reconText)
	_ = w.Flush()
	if len(recon.Differences) > 0 || !keyReuseRefused {
		for _, diff := range recon.Differences {
			fmt.Printf("  DIFFERENCE: %s\n", diff)
		}
		return fmt.Errorf("reconcile: %d differences found", len(recon.Differences))
	}
	fmt.Printf("\ninspect a saga: DATABASE_URL=%q go run ./cmd/worker show %s\n", redact(dsn), jobs[3].key)
	if d.Serve {
		ln, err := net.Listen("tcp", d.HTTPAddr)
		if err != nil {
			return fmt.Errorf("listen on --http-addr %s: %w (pick a free port, or 0 for any)", d.HTTPAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() { _ = srv.Serve(ln) }()
		fmt.Printf("metrics at http://%s/metrics; Ctrl-C to stop\n", ln.Addr())
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		return srv.Shutdown(sctx)
	}
	return nil
}

func secs(s float64) string {
	return (time.Duration(s * float64(time.Second))).Round(100 * time.Microsecond).String()
}

func counterSum(regs []*prometheus.Registry, name string, labels ...string) float64 {
	total := 0.0
	for _, reg := range regs {
		// A failed collector (the backlog's query) leaves the counters.
		families, _ := reg.Gather()
		for _, f := range families {
			if f.GetName() != name {
				continue
			}
		metric:
			for _, m := range f.GetMetric() {
				for i := 0; i+1 < len(labels); i += 2 {
					found := false
					for _, lp := range m.GetLabel() {
						if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
							found = true
						}
					}
					if !found {
						continue metric
					}
				}
				total += m.GetCounter().GetValue()
			}
		}
	}
	return total
}

func validDBName(s string) bool {
	if s == "" || len(s) > 63 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '_') {
			return false
		}
	}
	return true
}

// withDBName returns dsn pointing at database name instead.
func withDBName(dsn, name string) (string, error) {
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := url.Parse(dsn)
		if err != nil {
			return "", fmt.Errorf("DATABASE_URL: %w", err)
		}
		u.Path = "/" + name
		return u.String(), nil
	}
	if _, err := pgx.ParseConfig(dsn); err != nil {
		return "", fmt.Errorf("DATABASE_URL: %w", err)
	}
	return dsn + " dbname=" + name, nil
}

func redact(dsn string) string {
	if u, err := url.Parse(dsn); err == nil && u.User != nil {
		if _, has := u.User.Password(); has {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
			return u.String()
		}
	}
	return dsn
}

func parseURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	return u, nil
}
