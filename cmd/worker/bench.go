package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/internal/failpoint"
	"github.com/idemsaga/idemsaga/internal/metrics"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

type benchCmd struct {
	DBName         string        `name:"db-name" default:"idemsaga_bench" help:"Database created afresh on the DATABASE_URL server."`
	Sagas          int           `default:"10000" help:"Transfer sagas to run, after the warm-up."`
	WarmUp         int           `name:"warm-up" default:"200" help:"Transfer sagas run before the measured ones, so that the pools' connections and PostgreSQL's plans are made."`
	Concurrency    int           `default:"32" help:"Sagas in flight at once (a closed loop: each finished saga lets the next start)."`
	Pools          int           `default:"2" help:"Worker pools (engines) in this process, sharing the database and the stream."`
	MaxConns       int           `name:"max-conns" default:"0" help:"Database connections of each pool (0: 6 per CPU of this machine, shared among the pools, at least 4 each). pgbench's ceiling runs with as many clients as the pools have connections, so compare ratios of runs with the same value; keep pools x connections x 2 below the server's max_connections."`
	FailRate       float64       `name:"fail-rate" default:"0.05" help:"Fraction of transfers whose credit fails (they are compensated)."`
	DupRate        float64       `name:"dup-rate" default:"0.10" help:"Fraction of transfers submitted twice with the same key."`
	PgbenchSeconds int           `name:"pgbench-seconds" default:"10" help:"Length of the pgbench ceiling run (0: skip it)."`
	StatsWait      time.Duration `name:"stats-wait" default:"600ms" help:"Pause before each reading of PostgreSQL's counters. Its backends may hold theirs for up to 10 s when idle (PGSTAT_IDLE_INTERVAL): 11s makes commits and rows per saga exact; the default keeps runs short, and those figures then move by about 0.1 with what ran before."`
	Timeout        time.Duration `default:"10m" help:"How long the run may take."`
	CPUProfile     string        `name:"cpuprofile" help:"Write a CPU profile of the measured part to this file (go tool pprof)."`
	MemProfile     string        `name:"memprofile" help:"Write a heap profile at the end of the run to this file (go tool pprof)."`
	Prefill        int           `default:"0" help:"Finished transfer sagas (with their steps, inbox rows and ledger) written before the run, to measure how latency grows with the tables."`
	ReusePrefill   bool          `name:"reuse-prefill" help:"Run on the database --db-name left by an earlier run with the same --prefill, deleting that run's own sagas first, instead of creating and prefilling it afresh (ten million take a quarter of an hour); it is then kept. Without an earlier one, prefill and keep it."`
	Redeliver      float64       `default:"0" help:"Fraction of the commands crossing the broker delivered a second time under a new message id (1: every one twice); the inbox absorbs them."`
	RemoteStart    bool          `name:"remote-start" help:"Start sagas from a client without step workers, as a web tier or an admin tool does: every first command crosses the broker (the pools' relays poll every 5ms); the steps those dispatch still run at once. --lost-acks and --redeliver imply it."`
	LostAcks       float64       `name:"lost-acks" default:"0" help:"Fraction of first deliveries of commands not acknowledged after their commit (1: every command delivered twice; copies from --redeliver are first deliveries too): JetStream delivers them again at once, as after a lost ack, to either pool; the step workers' memory or inbox absorbs them. With it or --redeliver, sagas start from a client without step workers, so that every first command crosses the broker (the pools' relays poll every 5ms); the steps those dispatch still run at once."`
	Rate           float64       `default:"0" help:"Start this many sagas per second (an open loop, at most --concurrency in flight) instead of a closed loop; use half of the closed loop's throughput to measure latency at half of peak."`
	NATSURL        string        `name:"nats-url" help:"Use this NATS server (with JetStream) instead of one embedded in this process, so that the process holds only the workers; the broker's CPU is then counted apart (processes named nats-server). The benchmark uses a stream of its own there, IDEMSAGA_BENCH, deleted at the end."`
	MemoryEvery    time.Duration `name:"memory-every" default:"0s" help:"Also print the heap (after a GC) and resident memory at this interval during the run (0: only after the warm-up and at the end), to see whether memory stays flat."`
}

type benchResult struct {
	Sagas         int
	Elapsed       time.Duration
	P50, P95, P99 time.Duration
	// StartP50 and StartP99 are of the Start call alone; StepP50 and
	// StepP99 of a forward step from its dispatch to its success, on the
	// database clock.
	StartP50, StartP99, StepP50, StepP99 time.Duration
	// RelPages is the pages found or read per saga, by table or index.
	RelPages                       map[string]float64
	TxPerSaga, RowsPerSaga         float64
	ReadsPerSaga, HitsPerSaga      float64
	MsgsPerSaga                    float64
	WorkerCPUPerSaga, PGCPUPerSaga time.Duration
	// NATSCPUPerSaga is the external broker's (--nats-url), 0 when it is
	// embedded and counted with the workers.
	NATSCPUPerSaga time.Duration
	PgbenchTPS     float64
	Differences    int
	// Absorbed is the duplicates the pools absorbed per saga, by layer
	// (idemsaga_duplicates_absorbed_total).
	Absorbed map[string]float64
	// Heap in use after a GC, and resident memory, after the warm-up and
	// at the end of the run.
	HeapBefore, HeapAfter uint64
	RSSBefore, RSSAfter   uint64
}

func (b *benchCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	if b.Sagas < 1 || b.Concurrency < 1 || b.Pools < 1 || b.FailRate < 0 || b.FailRate > 1 || b.DupRate < 0 || b.DupRate > 1 ||
		b.Redeliver < 0 || b.Redeliver > 1 || b.LostAcks < 0 || b.LostAcks > 1 || b.Prefill < 0 || b.Rate < 0 || b.WarmUp < 0 {
		return errors.New("--sagas, --concurrency and --pools must be at least 1; --fail-rate, --dup-rate, --redeliver and --lost-acks between 0 and 1; --prefill, --rate and --warm-up not negative")
	}
	if b.MaxConns < 0 || b.MaxConns > maxBenchConns {
		return fmt.Errorf("--max-conns %d: give each pool's database connections, from 1 to %d, or 0 for 6 per CPU shared among the pools", b.MaxConns, maxBenchConns)
	}
	if b.MaxConns == 0 {
		b.MaxConns = defaultBenchConns(runtime.NumCPU(), b.Pools)
	}
	ctx, cancel := context.WithTimeout(ctx, b.Timeout)
	defer cancel()

	const accounts = 1000
	dsn, pool, seeded, reused, err := reusePrefilled(ctx, g, b, accounts)
	if err != nil {
		return err
	}
	if !reused {
		dsn, pool, err = freshDatabase(ctx, g, b.DBName, 4)
		if err != nil {
			return err
		}
		seeded, err = transfer.Seed(ctx, pool, accounts+1, 1_000_000_000, accounts+1)
		if err != nil {
			pool.Close()
			return err
		}
		if b.Prefill > 0 {
			if err := prefill(ctx, pool, b.Prefill); err != nil {
				pool.Close()
				return err
			}
		}
	}
	defer pool.Close()

	viaBroker := b.RemoteStart || b.LostAcks > 0 || b.Redeliver > 0
	natsURL, stream, prefix := b.NATSURL, engine.StreamDefault, engine.SubjectPrefixDefault
	if natsURL == "" {
		ns, _, stopNATS, err := embeddedNATS("idemsaga-bench-")
		if err != nil {
			return err
		}
		defer stopNATS()
		natsURL = ns.ClientURL()
	} else {
		stream, prefix = "IDEMSAGA_BENCH", "idemsaga-bench"
		defer deleteStream(natsURL, stream)
	}
	if b.Redeliver > 0 {
		stopCopies, err := redeliverCommands(natsURL, prefix, b.Redeliver)
		if err != nil {
			return err
		}
		defer stopCopies()
	}

	if b.LostAcks > 0 {
		// Through the step workers' failpoint, added to any set by
		// IDEMSAGA_FAILPOINTS, and as they were at the end.
		spec := fmt.Sprintf("%s=error@%g", failpoint.StepRedeliver, b.LostAcks)
		if env := os.Getenv(failpoint.EnvVar); env != "" {
			spec = env + ";" + spec
		}
		if err := failpoint.Enable(spec); err != nil {
			return fmt.Errorf("--lost-acks with %s: %w", failpoint.EnvVar, err)
		}
		defer func() {
			failpoint.Disable()
			_ = failpoint.FromEnv()
		}()
	}

	// Waiters are told when their saga finishes, by whichever pool.
	var waitMu sync.Mutex
	waiters := map[uuid.UUID]chan struct{}{}
	finishedEarly := map[uuid.UUID]bool{}
	onFinished := func(id uuid.UUID, _ string, _ saga.State) {
		waitMu.Lock()
		defer waitMu.Unlock()
		if ch, ok := waiters[id]; ok {
			close(ch)
			delete(waiters, id)
			return
		}
		finishedEarly[id] = true
	}
	waitFor := func(id uuid.UUID) <-chan struct{} {
		waitMu.Lock()
		defer waitMu.Unlock()
		ch := make(chan struct{})
		if finishedEarly[id] {
			delete(finishedEarly, id)
			close(ch)
			return ch
		}
		waiters[id] = ch
		return ch
	}

	// Handlers beyond the pool's connections wait for one in the pool,
	// which costs far less than PostgreSQL switching among more backends
	// than it has cores (bench/JOURNAL.md, sixth pass).
	per := max(4, b.Concurrency/b.Pools)
	regs := make([]*prometheus.Registry, b.Pools)
	engines, stopPools, err := startPools(ctx, b.Pools, dsn, natsURL, int32(b.MaxConns), func(i int, cfg *engine.Config) {
		regs[i] = prometheus.NewRegistry()
		cfg.Registerer = regs[i]
		cfg.Stream, cfg.SubjectPrefix = stream, prefix
		cfg.StepConcurrency, cfg.ReplyConcurrency, cfg.Retention.FinishedSagas = per, per, engine.KeepForever
		cfg.Logger, cfg.OnFinishedFunc = newLogger("error"), onFinished
		if viaBroker {
			cfg.RelayPollInterval = remotePoll
		}
	})
	if err != nil {
		return err
	}
	defer stopPools()
	// A pool's own client runs the first step in the pool's process, in
	// the start's transaction; remote, or with the broker's faults, sagas
	// start from a client without step workers, so that every first
	// command crosses the broker.
	clients := make([]*engine.Client, len(engines))
	for i, e := range engines {
		clients[i] = e.Client()
		if viaBroker {
			// Its own registry, counted with the pools' (duplicates
			// absorbed at the start).
			reg := prometheus.NewRegistry()
			regs = append(regs, reg)
			if clients[i], err = engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{transfer.Definition}, Stream: stream, SubjectPrefix: prefix, Registerer: reg}); err != nil {
				return err
			}
		}
	}
	jsConn, err := connectNATS(natsURL, "bench-stats")
	if err != nil {
		return err
	}
	defer jsConn.Close()
	js, err := jetstream.New(jsConn)
	if err != nil {
		return err
	}

	// starts holds each measured saga's Start call (the start transaction
	// and its commit), apart from the whole saga's latency.
	starts := make([]time.Duration, b.Sagas)
	run := func(n int, prefix string, latencies []time.Duration) error {
		jobs := make(chan int)
		errc := make(chan error, 1)
		var wg sync.WaitGroup
		for w := range b.Concurrency {
			cl := clients[w%len(clients)]
			wg.Go(func() {
				for i := range jobs {
					from := 1 + int64(i*7919%accounts)
					// Another account than from: 1 to accounts-1 further on.
					to := 1 + (from-1+int64(1+i%(accounts-1)))%accounts
					if spread(i, b.FailRate) {
						to = accounts + 1
					}
					in := transfer.Input{From: from, To: to, Amount: 1 + int64(i%97)}
					key := fmt.Sprintf("%s-%07d", prefix, i)
					start := time.Now()
					res, err := cl.Start(ctx, transfer.Definition, key, in)
					if latencies != nil {
						starts[i] = time.Since(start)
					}
					if err == nil && float64((i*31)%1000) < b.DupRate*1000 {
						_, err = cl.Start(ctx, transfer.Definition, key, in) // the client's retry
					}
					if err != nil {
						select {
						case errc <- err:
						default:
						}
						continue
					}
					select {
					case <-waitFor(res.ID):
					case <-ctx.Done():
						select {
						case errc <- fmt.Errorf("saga %s did not finish: %w", res.ID, ctx.Err()):
						default:
						}
						continue
					}
					if latencies != nil {
						latencies[i] = time.Since(start)
					}
				}
			})
		}
		start := time.Now()
		for i := range n {
			if b.Rate > 0 && latencies != nil {
				// Open loop: the i-th saga starts at i/rate, whatever the
				// engine's pace (up to --concurrency in flight).
				if d := time.Until(start.Add(time.Duration(float64(i) / b.Rate * float64(time.Second)))); d > 0 {
					time.Sleep(d)
				}
			}
			jobs <- i
		}
		close(jobs)
		wg.Wait()
		select {
		case err := <-errc:
			return err
		default:
			return nil
		}
	}

	broker := "embedded NATS (default fsync)"
	if b.NATSURL != "" {
		broker = "NATS at " + b.NATSURL
	}
	fmt.Printf("bench: %d sagas after a warm-up of %d, %d in flight, %d pools of %d connections, %.0f%% failing, %.0f%% submitted twice, %.4g%% of commands copied, %.4g%% delivered again after a lost ack, %d finished sagas prefilled; PostgreSQL %s, %s, GOMAXPROCS %d\n",
		b.Sagas, b.WarmUp, b.Concurrency, b.Pools, b.MaxConns, b.FailRate*100, b.DupRate*100, b.Redeliver*100, b.LostAcks*100, b.Prefill, pgVersion(ctx, pool), broker, runtime.GOMAXPROCS(0))
	if b.Rate > 0 {
		fmt.Printf("bench: open loop at %.0f sagas/s\n", b.Rate)
	}
	if err := run(b.WarmUp, "warm", nil); err != nil {
		return fmt.Errorf("warm-up: %w", err)
	}
	// Read first: the registries' backlog collectors query the database.
	absorbedBefore := absorbed(regs)
	before, err := snapshot(ctx, pool, js, stream, b.DBName, b.StatsWait, false)
	if err != nil {
		return err
	}
	latencies := make([]time.Duration, b.Sagas)
	if b.CPUProfile != "" {
		f, err := os.Create(b.CPUProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
	}
	start := time.Now()
	stopSampling := sampleMemory(b.MemoryEvery, start)
	err = run(b.Sagas, "bench", latencies)
	stopSampling()
	if err != nil {
		return err
	}
	elapsed := time.Since(start)
	if b.CPUProfile != "" {
		pprof.StopCPUProfile()
	}
	after, err := snapshot(ctx, pool, js, stream, b.DBName, b.StatsWait, true)
	if err != nil {
		return err
	}
	absorbedAfter := absorbed(regs)
	if b.MemProfile != "" {
		f, err := os.Create(b.MemProfile)
		if err != nil {
			return err
		}
		err = pprof.Lookup("heap").WriteTo(f, 0)
		f.Close()
		if err != nil {
			return fmt.Errorf("write the heap profile: %w", err)
		}
	}

	res := benchResult{Sagas: b.Sagas, Elapsed: elapsed,
		HeapBefore: before.heap, HeapAfter: after.heap, RSSBefore: before.rss, RSSAfter: after.rss}
	slices.Sort(latencies)
	pct := func(p float64) time.Duration { return latencies[min(len(latencies)-1, int(p*float64(len(latencies))))] }
	res.P50, res.P95, res.P99 = pct(0.50), pct(0.95), pct(0.99)
	slices.Sort(starts)
	res.StartP50, res.StartP99 = starts[len(starts)/2], starts[min(len(starts)-1, int(0.99*float64(len(starts))))]
	if res.StepP50, res.StepP99, err = stepLatency(ctx, pool, "bench-"); err != nil {
		return err
	}
	n := float64(b.Sagas)
	res.TxPerSaga = float64(after.commits-before.commits) / n
	res.RowsPerSaga = float64(after.rows-before.rows) / n
	res.ReadsPerSaga = float64(after.blksRead-before.blksRead) / n
	res.HitsPerSaga = float64(after.blksHit-before.blksHit) / n
	res.RelPages = map[string]float64{}
	for rel, v := range after.relPages {
		if d := float64(v-before.relPages[rel]) / n; d >= 0.05 {
			res.RelPages[rel] = d
		}
	}
	res.MsgsPerSaga = float64(after.msgs-before.msgs) / n
	res.Absorbed = map[string]float64{}
	for layer, v := range absorbedAfter {
		res.Absorbed[layer] = (v - absorbedBefore[layer]) / n
	}
	res.WorkerCPUPerSaga = time.Duration(float64(after.selfCPU-before.selfCPU) / n)
	res.PGCPUPerSaga = time.Duration(float64(after.pgCPU-before.pgCPU) / n)
	if b.NATSURL != "" {
		res.NATSCPUPerSaga = time.Duration(float64(after.natsCPU-before.natsCPU) / n)
	}

	recon, err := reconcile(ctx, pool, []*saga.Definition{transfer.Definition}, 30*time.Second, seeded)
	if err != nil {
		return err
	}
	res.Differences = len(recon.Differences)

	if b.PgbenchSeconds > 0 {
		res.PgbenchTPS, err = pgbenchCeiling(ctx, pool, dsn, b.Pools*b.MaxConns, b.PgbenchSeconds)
		if err != nil {
			fmt.Printf("  pgbench ceiling not measured: %v\n", err)
		}
	}
	res.print()
	if res.Differences > 0 {
		for _, d := range recon.Differences {
			fmt.Printf("  DIFFERENCE %s\n", d)
		}
		return fmt.Errorf("reconcile found %d differences: a benchmark that loses money is not a result", res.Differences)
	}
	return nil
}

func (r benchResult) print() {
	rate := float64(r.Sagas) / r.Elapsed.Seconds()
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	row := func(k, format string, args ...any) { fmt.Fprintf(w, "  %s\t%s\n", k, fmt.Sprintf(format, args...)) }
	fmt.Println()
	row("throughput", "%.0f sagas/s (%d in %s)", rate, r.Sagas, r.Elapsed.Round(time.Millisecond))
	row("latency", "p50 %s, p95 %s, p99 %s (submit to terminal state)", r.P50.Round(10*time.Microsecond), r.P95.Round(10*time.Microsecond), r.P99.Round(10*time.Microsecond))
	row("start, step", "start p50 %s, p99 %s (the Start call); step p50 %s, p99 %s (a forward step's dispatch to its success, database clock)",
		r.StartP50.Round(10*time.Microsecond), r.StartP99.Round(10*time.Microsecond), r.StepP50.Round(10*time.Microsecond), r.StepP99.Round(10*time.Microsecond))
	row("PostgreSQL", "%.2f commits and %.1f rows written per saga", r.TxPerSaga, r.RowsPerSaga)
	row("buffers", "%.1f pages read from outside shared_buffers and %.0f found in them per saga", r.ReadsPerSaga, r.HitsPerSaga)
	rels := slices.Collect(maps.Keys(r.RelPages))
	slices.SortFunc(rels, func(a, b string) int { return cmp.Compare(r.RelPages[b], r.RelPages[a]) })
	var by []string
	for _, rel := range rels[:min(len(rels), 10)] {
		by = append(by, fmt.Sprintf("%s %.1f", rel, r.RelPages[rel]))
	}
	row("pages by relation", "per saga: %s", strings.Join(by, ", "))
	row("JetStream", "%.2f messages per saga", r.MsgsPerSaga)
	a := r.Absorbed
	row("duplicates", "absorbed per saga: %.2f at the start, %.2f by the broker, %.2f by the step workers' memory, %.2f by the inbox, %.2f by the orchestrator",
		a[metrics.LayerStart], a[metrics.LayerBroker], a[metrics.LayerRecent], a[metrics.LayerInbox], a[metrics.LayerOrchestrator])
	if r.NATSCPUPerSaga > 0 {
		row("CPU per saga", "%s workers + %s NATS + %s PostgreSQL = %s", r.WorkerCPUPerSaga.Round(time.Microsecond), r.NATSCPUPerSaga.Round(time.Microsecond), r.PGCPUPerSaga.Round(time.Microsecond), r.cpu().Round(time.Microsecond))
	} else {
		row("CPU per saga", "%s workers (with the embedded NATS) + %s PostgreSQL = %s", r.WorkerCPUPerSaga.Round(time.Microsecond), r.PGCPUPerSaga.Round(time.Microsecond), r.cpu().Round(time.Microsecond))
	}
	if r.PgbenchTPS > 0 {
		row("pgbench ceiling", "%.0f TPS (UPDATE by key + INSERT per transaction, one client per connection of the pools)", r.PgbenchTPS)
		row("ratio", "%.2f (sagas/s x commits per saga / pgbench TPS); %.3f sagas per pgbench transaction (sagas/s / pgbench TPS)",
			rate*r.TxPerSaga/r.PgbenchTPS, rate/r.PgbenchTPS)
	}
	row("memory", "heap %s after warm-up, %s at the end; resident %s, then %s (this process: the workers, the embedded NATS if any, and the benchmark's own bookkeeping)",
		mib(r.HeapBefore), mib(r.HeapAfter), mib(r.RSSBefore), mib(r.RSSAfter))
	row("reconcile", "%d differences", r.Differences)
	_ = w.Flush()
	fmt.Printf("\n| sagas/s | p50 | p95 | p99 | commits/saga | rows/saga | msgs/saga | CPU/saga (all processes) | pgbench TPS | ratio | sagas/pgbench tx |\n")
	ratio, perTx := 0.0, 0.0
	if r.PgbenchTPS > 0 {
		ratio, perTx = rate*r.TxPerSaga/r.PgbenchTPS, rate/r.PgbenchTPS
	}
	fmt.Printf("| %.0f | %s | %s | %s | %.2f | %.1f | %.2f | %s | %.0f | %.2f | %.3f |\n", rate, r.P50.Round(100*time.Microsecond), r.P95.Round(100*time.Microsecond), r.P99.Round(100*time.Microsecond),
		r.TxPerSaga, r.RowsPerSaga, r.MsgsPerSaga, r.cpu().Round(time.Microsecond), r.PgbenchTPS, ratio, perTx)
}

// absorbed sums the duplicates the pools absorbed so far, by layer.
func absorbed(regs []*prometheus.Registry) map[string]float64 {
	total := map[string]float64{}
	for _, layer := range []string{metrics.LayerStart, metrics.LayerBroker, metrics.LayerRecent, metrics.LayerInbox, metrics.LayerOrchestrator} {
		total[layer] = counterSum(regs, metrics.Namespace+"_duplicates_absorbed_total", "layer", layer)
	}
	return total
}

// cpu is the CPU time per saga of every process involved.
func (r benchResult) cpu() time.Duration {
	return r.WorkerCPUPerSaga + r.NATSCPUPerSaga + r.PGCPUPerSaga
}

func mib(b uint64) string { return fmt.Sprintf("%.1f MiB", float64(b)/(1<<20)) }

// defaultBenchConns is the connections of each of pools pools: 6 per CPU
// in all (PostgreSQL runs on this machine), at least 4 each. On 2 CPUs, 6
// per pool gave 30% more sagas per second than 38, a third less of
// PostgreSQL's CPU per saga, and a tenth of the p99 at half of peak.
func defaultBenchConns(cpus, pools int) int {
	return max(4, 6*cpus/pools)
}

// maxBenchConns bounds --max-conns: pgbench's ceiling opens as many
// connections as the pools have, next to the pools' own, and PostgreSQL
// refuses connections past its max_connections (100 by default).
const maxBenchConns = 1000

// remotePoll is the relays' poll interval when sagas start from a client
// without step workers, whose rows only a relay publishes.
const remotePoll = 5 * time.Millisecond

// spread reports whether the i-th saga is one of a fraction of them chosen
// evenly: with 0.05, every 20th. The failing transfers are spread so, not
// taken in runs (50 in a row out of every 1,000 did that before): a run of
// compensations is a burst of extra work, which at a fixed rate showed up
// as a stall every 1,000 sagas and set the tail latency.
func spread(i int, fraction float64) bool {
	return math.Floor(float64(i+1)*fraction) > math.Floor(float64(i)*fraction)
}

// sampleMemory prints the heap in use (after a GC) and the resident memory
// every interval until the returned function is called; interval 0 prints
// nothing.
func sampleMemory(every time.Duration, start time.Time) (stop func()) {
	if every <= 0 {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
			}
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			fmt.Printf("  memory at %-7s heap %s, resident %s\n", time.Since(start).Round(time.Second), mib(ms.HeapInuse), mib(residentMemory()))
		}
	})
	return func() { close(done); wg.Wait() }
}

type stats struct {
	commits, rows, msgs int64
	blksRead, blksHit   int64
	selfCPU, pgCPU      time.Duration
	natsCPU             time.Duration
	heap, rss           uint64
	// relPages is the pages found or read per table and index of the
	// engine's and the example's schemas (pg_statio_user_tables and
	// _indexes), to tell which one grows with the tables.
	relPages map[string]int64
}

// snapshot reads the counters a run is measured by. PostgreSQL's backends
// flush theirs with some delay (--stats-wait): a pause lets the last ones
// land. The processes' CPU is read on the measured side of the pause and
// of the snapshot's own work (last for the reading before the run, first
// for the one after), so that neither is counted. After the run, work
// still finishing when the last saga ended (outbox deletes, acks) is then
// in the database's counters and not in the CPU: a small bias down, for
// not counting up to 11 s of idle polling.
func snapshot(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, stream, db string, wait time.Duration, atEnd bool) (stats, error) {
	var s stats
	readCPU := func() {
		var ru syscall.Rusage
		if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err == nil {
			s.selfCPU = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
		}
		s.pgCPU, s.natsCPU = processCPU("postgres"), processCPU("nats-server")
	}
	if atEnd {
		readCPU()
	}
	time.Sleep(wait)
	if _, err := pool.Exec(ctx, `select pg_stat_clear_snapshot()`); err != nil {
		return s, err
	}
	if err := pool.QueryRow(ctx, `select xact_commit, blks_read, blks_hit from pg_stat_database where datname = $1`, db).Scan(&s.commits, &s.blksRead, &s.blksHit); err != nil {
		return s, fmt.Errorf("read pg_stat_database: %w", err)
	}
	if err := pool.QueryRow(ctx, `select coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint from pg_stat_user_tables`).Scan(&s.rows); err != nil {
		return s, fmt.Errorf("read pg_stat_user_tables: %w", err)
	}
	rows, err := pool.Query(ctx, `select relname, coalesce(heap_blks_hit + heap_blks_read, 0) from pg_statio_user_tables where schemaname in ('idemsaga', 'transfer')
union all select indexrelname, idx_blks_hit + idx_blks_read from pg_statio_user_indexes where schemaname in ('idemsaga', 'transfer')`)
	if err != nil {
		return s, fmt.Errorf("read pg_statio_user_tables: %w", err)
	}
	s.relPages = map[string]int64{}
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			rows.Close()
			return s, err
		}
		s.relPages[name] = n
	}
	if err := rows.Err(); err != nil {
		return s, err
	}
	st, err := js.Stream(ctx, stream)
	if err != nil {
		return s, err
	}
	s.msgs = int64(st.CachedInfo().State.LastSeq)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	s.heap, s.rss = ms.HeapInuse, residentMemory()
	if !atEnd {
		readCPU()
	}
	return s, nil
}

// residentMemory is this process's resident set size, from /proc (Linux;
// 0 elsewhere).
func residentMemory() uint64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				kb, _ := strconv.ParseUint(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// stepLatency returns the median and 99th percentile of the time from
// dispatch to success of the forward steps of the sagas whose keys start
// with prefix, on the database clock.
func stepLatency(ctx context.Context, pool *pgxpool.Pool, prefix string) (p50, p99 time.Duration, err error) {
	var a, b float64
	err = pool.QueryRow(ctx, `select coalesce(percentile_cont(0.5) within group (order by d), 0), coalesce(percentile_cont(0.99) within group (order by d), 0)
from (select extract(epoch from st.updated_at - st.dispatched_at) as d
  from idemsaga.sagas s join idemsaga.steps st on st.saga_id = s.id
  where s.idem_key like $1 || '%' and st.phase = 'forward' and st.status = 'succeeded') x`, prefix).Scan(&a, &b)
	if err != nil {
		return 0, 0, fmt.Errorf("read step latency: %w", err)
	}
	return time.Duration(a * float64(time.Second)), time.Duration(b * float64(time.Second)), nil
}

// processCPU adds up the CPU time of every process of this name on this
// machine, from /proc (Linux; 0 elsewhere). Clock ticks are 100/s.
func processCPU(name string) time.Duration {
	entries, _ := os.ReadDir("/proc")
	var ticks int64
	for _, e := range entries {
		if _, err := strconv.Atoi(e.Name()); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		line := string(b)
		open, close := strings.IndexByte(line, '('), strings.LastIndexByte(line, ')')
		if open < 0 || close < open || line[open+1:close] != name {
			continue
		}
		fields := strings.Fields(line[close+1:])
		if len(fields) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(fields[11], 10, 64)
		s, _ := strconv.ParseInt(fields[12], 10, 64)
		ticks += u + s
	}
	return time.Duration(ticks) * 10 * time.Millisecond
}

// pgbenchScript is the ceiling's transaction: an UPDATE by primary key and
// an INSERT, as one transaction.
const pgbenchScript = `\set aid random(1, 100000)
begin;
update bench_accounts set balance = balance + 1 where id = :aid;
insert into bench_ledger (account_id, amount) values (:aid, 1);
end;
`

var tpsLine = regexp.MustCompile(`tps = ([0-9.]+) \(without initial connection time\)`)

// pgbenchCeiling runs pgbench with a script shaped like one step
// transaction (an UPDATE by primary key plus an INSERT) on clients
// connections, as many as the workers' pools hold, and returns its TPS.
func pgbenchCeiling(ctx context.Context, pool *pgxpool.Pool, dsn string, clients, seconds int) (float64, error) {
	if _, err := exec.LookPath("pgbench"); err != nil {
		return 0, errors.New("pgbench is not installed; Debian and Ubuntu ship it in the server package (apt-get install postgresql), not in postgresql-client")
	}
	for _, q := range []string{
		`create table if not exists bench_accounts (id bigint primary key, balance bigint not null)`,
		`create table if not exists bench_ledger (id bigint generated always as identity primary key, account_id bigint not null, amount bigint not null, created_at timestamptz not null default now())`,
		`truncate bench_accounts, bench_ledger`,
		`insert into bench_accounts select g, 1000000 from generate_series(1, 100000) g`,
		`vacuum analyze bench_accounts`,
	} {
		if _, err := pool.Exec(ctx, q); err != nil {
			return 0, err
		}
	}
	script := filepath.Join(os.TempDir(), fmt.Sprintf("idemsaga-pgbench-%d.sql", os.Getpid()))
	// One transaction per run, as a step's: pgbench runs each line of a
	// script as a transaction of its own unless BEGIN and END bracket them,
	// and its TPS counts runs.
	if err := os.WriteFile(script, []byte(pgbenchScript), 0o644); err != nil {
		return 0, err
	}
	defer os.Remove(script)
	cc := pool.Config().ConnConfig
	cmd := exec.CommandContext(ctx, "pgbench", "-n", "-f", script, "-c", strconv.Itoa(clients), "-j", strconv.Itoa(min(clients, runtime.NumCPU())),
		"-T", strconv.Itoa(seconds), "-h", cc.Host, "-p", strconv.Itoa(int(cc.Port)), "-U", cc.User, cc.Database)
	cmd.Env = append(os.Environ(), "PGPASSWORD="+cc.Password)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pgbench: %w: %s", err, out)
	}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if m := tpsLine.FindStringSubmatch(sc.Text()); m != nil {
			return strconv.ParseFloat(m[1], 64)
		}
	}
	return 0, fmt.Errorf("pgbench printed no TPS: %s", out)
}

// pgVersion names the server's version, and says so when autovacuum is
// off there (as on some CI machines): dead rows then stay for the whole
// run, which a production server would not let happen.
func pgVersion(ctx context.Context, pool *pgxpool.Pool) string {
	var v, autovacuum string
	_ = pool.QueryRow(ctx, `select current_setting('server_version'), current_setting('autovacuum')`).Scan(&v, &autovacuum)
	if autovacuum == "off" {
		v += " with autovacuum off"
	}
	return v
}
