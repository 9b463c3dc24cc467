package main

import (
	"bytes"
	"context"
	crand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	natsserver "github.com/nats-io/nats-server/v2/server"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/tcpproxy"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

type chaosCmd struct {
	DBName      string        `name:"db-name" default:"idemsaga_chaos" help:"Database created afresh on the DATABASE_URL server."`
	Saga        string        `default:"transfer" enum:"transfer,order,crossborder,settlement" help:"What to run: transfers (database steps), orders (an external payment step, against a payment service that loses answers), cross-border transfers (an FX conversion as a child saga) or the nightly settlement (a scheduled saga, on a clock that passes a night a second)."`
	Transfers   int           `default:"5000" help:"Transfers to submit (--saga transfer or crossborder); 10% fail at credit and are compensated, 20% are submitted twice with the same key."`
	NoVerify    bool          `name:"no-verify" help:"Run the orders without their charge's Verify (--saga order), to compare: unknown outcomes are then decided by the give-up rule alone."`
	Naive       bool          `help:"Charge and refund the orders as a handler written without saga/httpcall does (--saga order), to compare: Go's default client, which resends a request on a dropped reused connection, and a 503 read as not charged."`
	NoRefund    bool          `name:"no-refund" help:"Give the orders' charge no compensation (--saga order), to compare: an order whose charge may have happened parks for a person; no order is undeliverable."`
	External    bool          `name:"external-charge" help:"Make the orders' charge an external step, confirmed by its answer alone, with no callback to wait for (--saga order)."`
	RateLimit   int           `name:"rate-limit" help:"The payment service answers 429 above this many requests per second (--saga order; 0: no limit)."`
	Calm        bool          `help:"The payment service loses, fails and delays nothing (--saga order): with --kill-every 0 --no-nats-restart --no-pause --no-cut-db, a run of the limits alone."`
	Orders      int           `default:"2000" help:"Orders to submit (--saga order); some declined, out of stock or undeliverable, 20% submitted twice with the same key."`
	Nights      int           `default:"60" help:"Nights the settlement's schedule runs through (--saga settlement), one a second on the database's clock; every worker is down for 5 of them."`
	Workers     int           `default:"3" help:"Worker processes kept running."`
	HTTPStarts  bool          `name:"http-starts" help:"Start every other saga through a worker's HTTP API, so that the workers being killed take starts too (a start no worker answers goes to the client)."`
	Attempts    int           `default:"10" help:"Attempts of each forward step, the first included: fewer make the last attempt's outcome decide more often (compensations keep 10)."`
	KillEvery   time.Duration `name:"kill-every" default:"1s" help:"Mean time between SIGKILLs of a random worker (0: none)."`
	MaxKills    int           `name:"max-kills" default:"0" help:"Stop killing after this many kills (0: no limit)."`
	NATSRestart bool          `name:"nats-restart" default:"true" negatable:"" help:"Restart the NATS server once, a third of the way through."`
	Pause       bool          `default:"true" negatable:"" help:"SIGSTOP a worker past its lease halfway through, then SIGCONT it."`
	CutDB       bool          `name:"cut-db" default:"true" negatable:"" help:"Cut every worker's PostgreSQL connection once, two thirds of the way through."`
	Deadline    time.Duration `default:"15m" help:"How long every saga has to finish once submitted."`
	Seed        uint64        `default:"1" help:"Random seed of the workload and the chaos."`
}

// chaosFigures is what the run prints, and what the tests read.
type chaosFigures struct {
	Sagas, Credited, Compensated, Failed int
	// ByState counts the sagas by state; Extra are the workload's own
	// lines (the order run's payment figures).
	ByState                           map[string]int
	Extra                             []string
	Submissions, StartDuplicates      int
	Kills, NATSRestarts, Pauses, Cuts int
	BrokerDuplicates, InboxDuplicates int
	RecentDuplicates                  int
	OrchestratorDuplicates, Stale     int
	LeaseTakeovers, Retries           int
	// LimitWaits counts the turns under a shared limit that waited;
	// Verified the answers of Verify, by answer.
	LimitWaits float64
	Verified   map[string]float64
	// EventStarts counts the events' starts, by outcome.
	EventStarts map[string]float64
	WallTime    time.Duration
	Differences []string
}

const (
	chaosStepTimeout = 2 * time.Second
	chaosLeaseGrace  = 3 * time.Second
	chaosMaxBackoff  = time.Second
)

func (c *chaosCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	if c.Transfers < 1 || c.Orders < 1 || c.Workers < 1 || c.Attempts < 1 || c.Nights < 10 {
		return errors.New("--transfers, --orders, --workers and --attempts must be at least 1, and --nights at least 10")
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	start := time.Now()
	rng := rand.New(rand.NewPCG(c.Seed, 7))

	// A fresh database.
	dsn, pool, err := freshDatabase(ctx, g, c.DBName, 8)
	if err != nil {
		return err
	}
	defer pool.Close()
	var work chaosWorkload = &transferChaos{}
	switch c.Saga {
	case "order":
		work = &orderChaos{noVerify: c.NoVerify, naive: c.Naive, noRefund: c.NoRefund, external: c.External, rateLimit: c.RateLimit, orderRate: g.OrderRate, calm: c.Calm}
	case "crossborder":
		work = &crossborderChaos{}
	case "settlement":
		work = &settlementChaos{nights: c.Nights}
	}
	if err := work.prepare(ctx, pool, c.Seed); err != nil {
		return err
	}
	defer work.close()
	total := work.count(c)

	// The workers reach PostgreSQL through a proxy the harness can cut.
	pgAddr, err := dbAddr(pool)
	if err != nil {
		return err
	}
	proxy, err := tcpproxy.New(pgAddr)
	if err != nil {
		return err
	}
	defer proxy.Close()
	workerDSN, err := withHostPort(dsn, proxy.Addr())
	if err != nil {
		return err
	}

	// An embedded NATS server that can be restarted on the same port with
	// the same storage.
	ns, dir, stopFirst, err := embeddedNATS("idemsaga-chaos-")
	if err != nil {
		return err
	}
	natsPort := ns.Addr().(*net.TCPAddr).Port
	var nsMu sync.Mutex
	// Stops whichever server runs last (the first may have been
	// restarted), then removes the folder.
	defer func() { nsMu.Lock(); ns.Shutdown(); ns.WaitForShutdown(); nsMu.Unlock(); stopFirst() }()

	fig := &chaosFigures{}
	if n, ok := work.(interface {
		withNATS(ctx context.Context, url string) error
	}); ok {
		if err := n.withNATS(ctx, ns.ClientURL()); err != nil {
			return err
		}
	}
	// The workers' API takes this run's own token: a port another run's
	// worker took between freeLoopback and this one's bind answers 401,
	// rather than starting this run's sagas in that run's database.
	token, err := chaosToken(dir)
	if err != nil {
		return err
	}
	workers := &workerSet{self: self, dir: dir, token: token, env: []string{
		"DATABASE_URL=" + workerDSN, "NATS_URL=" + ns.ClientURL(),
		"IDEMSAGA_STREAM=" + g.Stream, "IDEMSAGA_SUBJECT_PREFIX=" + g.SubjectPrefix,
		"IDEMSAGA_STEP_TIMEOUT=" + chaosStepTimeout.String(), "IDEMSAGA_MAX_ATTEMPTS=" + strconv.Itoa(c.Attempts), "IDEMSAGA_COMPENSATE_ATTEMPTS=10", "IDEMSAGA_MAX_BACKOFF=" + chaosMaxBackoff.String(),
		"IDEMSAGA_LEASE_GRACE=" + chaosLeaseGrace.String(), "LOG_LEVEL=error", "HTTP_ADDR=127.0.0.1:0",
		"IDEMSAGA_API_TOKENS_FILE=" + filepath.Join(dir, "tokens"),
	}}
	workers.env = append(workers.env, work.env()...)
	if a, ok := work.(interface{ args() []string }); ok {
		workers.args = a.args()
	}
	defer workers.killAll()
	for range c.Workers {
		if err := workers.start(); err != nil {
			return err
		}
	}
	fmt.Printf("chaos: %d %ss, %d workers, database %s (workers through a proxy at %s), NATS on port %d\n",
		total, c.Saga, c.Workers, c.DBName, proxy.Addr(), natsPort)
	work.describe()

	policy := saga.RetryPolicy{Timeout: chaosStepTimeout, MaxAttempts: c.Attempts, MaxBackoff: chaosMaxBackoff}
	def, err := work.definition(policy)
	if err != nil {
		return err
	}
	client, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def}, SubjectPrefix: g.SubjectPrefix, LeaseGrace: chaosLeaseGrace})
	if err != nil {
		return err
	}
	work.connect(client)

	// The workload, submitted while the chaos runs.
	var submitted, startDups atomic.Int64
	submitErr := make(chan error, 1)
	submitDone := make(chan struct{})
	driver, driven := work.(chaosDriver)
	go func() {
		defer close(submitDone)
		var err error
		if driven {
			err = driver.drive(ctx, pool, workers, c.Workers)
		} else {
			err = submitChaos(ctx, client, workers, def, work.jobs(total, c.Seed), c.HTTPStarts, &submitted, &startDups)
		}
		if err != nil {
			submitErr <- err
		}
	}()

	// The chaos.
	// progressErr is why the last count of finished sagas failed, for the
	// report: a count that cannot be read must not look like no progress.
	var progressErr error
	progress := func() float64 {
		if driven {
			return driver.progress(ctx, pool)
		}
		var done int
		// Children are not counted: their parents are.
		progressErr = pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is not null and parent_id is null`).Scan(&done)
		return float64(done) / float64(total)
	}
	deadline := time.Now().Add(c.Deadline)
	nextKill := time.Now().Add(jittered(rng, c.KillEvery))
	natsDone, pauseDone, cutDone := !c.NATSRestart, !c.Pause, !c.CutDB
	lastReport := time.Now()
	for {
		p := progress()
		select {
		case <-submitDone:
			if p >= 1 {
				goto finished
			}
		default:
		}
		select {
		case err := <-submitErr:
			return err
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sagas still running after %s: the chaos run failed; inspect database %s with `worker reconcile`", c.Deadline, c.DBName)
		}
		now := time.Now()
		if c.KillEvery > 0 && now.After(nextKill) && (c.MaxKills == 0 || fig.Kills < c.MaxKills) {
			if workers.killRandom(rng) {
				fig.Kills++
			}
			if err := workers.start(); err != nil {
				return err
			}
			nextKill = now.Add(jittered(rng, c.KillEvery))
		}
		if !natsDone && p >= 0.33 {
			natsDone = true
			nsMu.Lock()
			ns.Shutdown()
			ns.WaitForShutdown()
			time.Sleep(500 * time.Millisecond)
			ns, err = startEmbeddedNATS(filepath.Join(dir, "nats"), natsPort)
			nsMu.Unlock()
			if err != nil {
				return fmt.Errorf("restart NATS: %w", err)
			}
			fig.NATSRestarts++
			fmt.Printf("  %5.1f%%  NATS restarted\n", p*100)
		}
		if !pauseDone && p >= 0.5 {
			pauseDone = true
			if pid := workers.pauseRandom(rng, chaosStepTimeout+chaosLeaseGrace+2*time.Second); pid > 0 {
				fig.Pauses++
				fmt.Printf("  %5.1f%%  worker %d stopped with SIGSTOP past its leases\n", p*100, pid)
			}
		}
		if !cutDone && p >= 0.66 {
			cutDone = true
			n := proxy.Cut()
			fig.Cuts++
			fmt.Printf("  %5.1f%%  cut %d worker connections to PostgreSQL\n", p*100, n)
		}
		if time.Since(lastReport) > 2*time.Second {
			fmt.Printf("  %5.1f%%  finished, %d submitted, %d kills\n", p*100, submitted.Load(), fig.Kills)
			if progressErr != nil {
				fmt.Printf("          (finished sagas not counted: %v)\n", progressErr)
			}
			lastReport = time.Now()
		}
		time.Sleep(50 * time.Millisecond)
	}
finished:
	fig.WallTime = time.Since(start)
	// Let the workers drain and flush what they committed, then stop them.
	time.Sleep(500 * time.Millisecond)
	workers.stopAll(30 * time.Second)
	// A last clean worker publishes whatever a killed one left in the outbox.
	if err := flushOutbox(ctx, pool, workers); err != nil {
		return err
	}

	fig.Submissions, fig.StartDuplicates = int(submitted.Load()), int(startDups.Load())
	counters := workers.counters()
	fig.BrokerDuplicates = int(counters["idemsaga_duplicates_absorbed_total|layer=broker"])
	fig.OrchestratorDuplicates = int(counters["idemsaga_duplicates_absorbed_total|layer=orchestrator"])
	fig.Stale = int(sumPrefix(counters, "idemsaga_stale_replies_total"))
	fig.LeaseTakeovers = int(sumPrefix(counters, "idemsaga_lease_takeovers_total"))
	fig.Retries = int(sumPrefix(counters, "idemsaga_retries_scheduled_total"))
	fig.InboxDuplicates = int(counters["idemsaga_duplicates_absorbed_total|layer=inbox"])
	fig.RecentDuplicates = int(counters["idemsaga_duplicates_absorbed_total|layer=recent"])
	fig.LimitWaits = sumPrefix(counters, "idemsaga_limit_waits_total")
	fig.Verified, fig.EventStarts = map[string]float64{}, map[string]float64{}
	for k, v := range counters {
		if strings.HasPrefix(k, "idemsaga_event_starts_total|") {
			for _, l := range strings.Split(k, "|") {
				if o, ok := strings.CutPrefix(l, "outcome="); ok {
					fig.EventStarts[o] += v
				}
			}
		}
		if strings.HasPrefix(k, "idemsaga_verified_total|") {
			for _, l := range strings.Split(k, "|") {
				if a, ok := strings.CutPrefix(l, "answer="); ok {
					fig.Verified[a] += v
				}
			}
		}
	}
	if err := work.check(ctx, pool, def, fig); err != nil {
		return err
	}
	if !driven && fig.Sagas != total {
		fig.Differences = append(fig.Differences, fmt.Sprintf("%d sagas exist for %d %ss", fig.Sagas, total, c.Saga))
	}
	fig.print()
	if len(fig.Differences) > 0 {
		return fmt.Errorf("%d differences", len(fig.Differences))
	}
	return nil
}

func (f *chaosFigures) print() {
	fmt.Println()
	fmt.Printf("  sagas              %d (credited %d, compensated %d, failed %d; by state %v)\n", f.Sagas, f.Credited, f.Compensated, f.Failed, f.ByState)
	for _, l := range f.Extra {
		fmt.Printf("  %s\n", l)
	}
	fmt.Printf("  submissions        %d (%d answered as duplicates at start)\n", f.Submissions, f.StartDuplicates)
	fmt.Printf("  chaos              %d SIGKILLs, %d NATS restarts, %d SIGSTOP pauses, %d database cuts\n", f.Kills, f.NATSRestarts, f.Pauses, f.Cuts)
	fmt.Printf("  duplicates absorbed  start %d, broker %d, step workers' memory %d, inbox %d, orchestrator %d (stale replies %d)\n",
		f.StartDuplicates, f.BrokerDuplicates, f.RecentDuplicates, f.InboxDuplicates, f.OrchestratorDuplicates, f.Stale)
	fmt.Printf("  lease takeovers    %d, retries %d\n", f.LeaseTakeovers, f.Retries)
	fmt.Printf("  wall time          %s\n", f.WallTime.Round(time.Millisecond))
	for _, d := range f.Differences {
		fmt.Printf("  DIFFERENCE %s\n", d)
	}
	fmt.Printf("  differences: %d\n", len(f.Differences))
	fmt.Println("  (broker, inbox, orchestrator, takeover and retry counts come from the workers' last metric snapshots, so killed workers' last half second is missing)")
}

// shedError is a start a worker refused for now, to be sent again after.
type shedError struct {
	err   error
	after time.Duration
}

func (e *shedError) Error() string { return e.err.Error() }
func (e *shedError) Unwrap() error { return e.err }

// unreachableError is a start no worker's HTTP API answered.
type unreachableError struct{ err error }

func (e *unreachableError) Error() string { return e.err.Error() }
func (e *unreachableError) Unwrap() error { return e.err }

// chaosJob is one saga to start, under its key: by the client, or by
// start when set (an event published).
type chaosJob struct {
	key   string
	in    any
	start func(ctx context.Context) error
	// web starts it through a worker's HTTP API (submitChaos).
	web bool
}

// submitChaos starts the jobs while the chaos runs: 10% again at once,
// racing the first, and 10% again later; a client that gets an error
// retries with the same key, and waits out a Retry-After. With viaHTTP,
// every other job is started through a worker's HTTP API, so that the
// workers being killed take starts too; the rest through cl, a client
// without step workers, as a separate web tier would.
func submitChaos(ctx context.Context, cl *engine.Client, workers *workerSet, def *saga.Definition, jobs []chaosJob, viaHTTP bool, submitted, dups *atomic.Int64) error {
	web := &http.Client{Timeout: 10 * time.Second}
	var rng sync.Mutex
	pick := rand.New(rand.NewPCG(7, uint64(len(jobs))))
	viaWorker := func(j chaosJob) (duplicate bool, err error) {
		rng.Lock()
		addr := workers.addr(pick)
		rng.Unlock()
		if addr == "" {
			return false, errors.New("no worker is running")
		}
		body, err := json.Marshal(j.in)
		if err != nil {
			return false, err
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/sagas/"+def.Name(), bytes.NewReader(body))
		if err != nil {
			return false, err
		}
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", j.key)
		req.Header.Set("Authorization", "Bearer "+workers.token)
		resp, err := web.Do(req)
		if err != nil {
			return false, &unreachableError{err}
		}
		defer resp.Body.Close()
		text, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<12))
		switch resp.StatusCode {
		case http.StatusCreated:
			return false, nil
		case http.StatusOK:
			return true, nil
		case http.StatusUnauthorized:
			// Not this run's worker: its port was taken by another's.
			return false, &unreachableError{fmt.Errorf("%s is not this run's worker (%s)", addr, resp.Status)}
		}
		err = fmt.Errorf("worker %s answered %s: %s", addr, resp.Status, text)
		if secs, perr := strconv.Atoi(resp.Header.Get("Retry-After")); perr == nil && secs > 0 {
			// Shed: as a client would, it waits as asked, at no cost to
			// its attempts.
			return false, &shedError{err: err, after: time.Duration(secs) * time.Second}
		}
		return false, err
	}
	sem := make(chan struct{}, 16)
	var wg sync.WaitGroup
	errc := make(chan error, 1)
	submit := func(j chaosJob) {
		defer wg.Done()
		sem <- struct{}{}
		defer func() { <-sem }()
		for attempt := 0; ; attempt++ {
			var err error
			if j.start != nil {
				if err = j.start(ctx); err == nil {
					submitted.Add(1)
					return
				}
			} else {
				var dup bool
				var unreachable *unreachableError
				if j.web {
					dup, err = viaWorker(j)
				}
				if !j.web || errors.As(err, &unreachable) {
					// The client's job, or one no worker answered
					// (killed, stopped or still starting), as a web
					// tier with another route would.
					var res engine.StartResult
					res, err = cl.Start(ctx, def, j.key, j.in)
					dup = res.Duplicate
				}
				if err == nil {
					submitted.Add(1)
					if dup {
						dups.Add(1)
					}
					return
				}
			}
			var shed *shedError
			if errors.As(err, &shed) && ctx.Err() == nil {
				attempt--
				time.Sleep(shed.after)
				continue
			}
			if attempt == 20 || ctx.Err() != nil {
				select {
				case errc <- fmt.Errorf("submit %s: %w", j.key, err):
				default:
				}
				return
			}
			time.Sleep(100 * time.Millisecond) // a client retries with the same key
		}
	}
	for i := range jobs {
		jobs[i].web = viaHTTP && i%2 == 0
	}
	for i, j := range jobs {
		wg.Add(1)
		go submit(j)
		switch {
		case i%10 == 1: // again at once, racing the first
			wg.Add(1)
			go submit(j)
		case i%10 == 6 && i >= 50: // again later
			wg.Add(1)
			go submit(jobs[i-50])
		}
		if i%50 == 49 {
			time.Sleep(10 * time.Millisecond) // spread the load over the run
		}
	}
	wg.Wait()
	select {
	case err := <-errc:
		return err
	default:
		return nil
	}
}

func jittered(rng *rand.Rand, d time.Duration) time.Duration {
	if d <= 0 {
		return time.Hour
	}
	return d/2 + time.Duration(rng.Int64N(int64(d)))
}

func startEmbeddedNATS(dir string, port int) (*natsserver.Server, error) {
	ns, err := natsserver.NewServer(&natsserver.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		return nil, err
	}
	ns.Start()
	if !ns.ReadyForConnections(10 * time.Second) {
		return nil, errors.New("embedded NATS did not start within 10s")
	}
	return ns, nil
}

// workerSet runs and kills `worker run` processes.
type workerSet struct {
	self string
	dir  string
	env  []string
	// args are the workload's own flags of `run`.
	args []string
	// token is this run's bearer token for the workers' API.
	token string

	mu    sync.Mutex
	n     int
	procs map[int]*exec.Cmd
	// addrs are the running workers' HTTP addresses, by pid.
	addrs map[int]string
	files []string
	// held: start starts nothing (every worker is kept down).
	held bool
}

// hold keeps every worker down (start starts none) until released.
func (w *workerSet) hold(on bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.held = on
}

func (w *workerSet) start() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.held {
		return nil
	}
	if w.procs == nil {
		w.procs = map[int]*exec.Cmd{}
	}
	w.n++
	metrics := filepath.Join(w.dir, fmt.Sprintf("worker-%d.json", w.n))
	addr, err := freeLoopback()
	if err != nil {
		return err
	}
	cmd := exec.Command(w.self, append([]string{"run", "--ack-wait", "8s", "--max-conns", "6", "--metrics-file", metrics, "--http-addr", addr}, w.args...)...)
	cmd.Env = append(os.Environ(), w.env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start worker: %w", err)
	}
	if w.addrs == nil {
		w.addrs = map[int]string{}
	}
	w.procs[cmd.Process.Pid] = cmd
	w.addrs[cmd.Process.Pid] = addr
	w.files = append(w.files, metrics)
	go func() {
		_ = cmd.Wait()
		w.mu.Lock()
		delete(w.procs, cmd.Process.Pid)
		delete(w.addrs, cmd.Process.Pid)
		w.mu.Unlock()
	}()
	return nil
}

// addr is a running worker's HTTP address, "" when none runs.
func (w *workerSet) addr(rng *rand.Rand) string {
	if cmd := w.pick(rng); cmd != nil {
		w.mu.Lock()
		defer w.mu.Unlock()
		return w.addrs[cmd.Process.Pid]
	}
	return ""
}

// chaosToken writes a new bearer token to dir/tokens and returns it.
func chaosToken(dir string) (string, error) {
	b := make([]byte, 24)
	if _, err := crand.Read(b); err != nil {
		return "", err
	}
	token := hex.EncodeToString(b)
	if err := os.WriteFile(filepath.Join(dir, "tokens"), []byte(token+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write the workers' API token: %w", err)
	}
	return token, nil
}

// freeLoopback is a loopback address whose port was free a moment ago.
func freeLoopback() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("find a free port for a worker's HTTP API: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}

func (w *workerSet) pick(rng *rand.Rand) *exec.Cmd {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.procs) == 0 {
		return nil
	}
	pids := make([]int, 0, len(w.procs))
	for pid := range w.procs {
		pids = append(pids, pid)
	}
	return w.procs[pids[rng.IntN(len(pids))]]
}

func (w *workerSet) killRandom(rng *rand.Rand) bool {
	cmd := w.pick(rng)
	return cmd != nil && cmd.Process.Signal(syscall.SIGKILL) == nil
}

func (w *workerSet) pauseRandom(rng *rand.Rand, d time.Duration) int {
	for range 10 { // the one picked may have just been killed
		cmd := w.pick(rng)
		if cmd == nil || cmd.Process.Signal(syscall.SIGSTOP) != nil {
			time.Sleep(100 * time.Millisecond)
			continue
		}
		time.AfterFunc(d, func() { _ = cmd.Process.Signal(syscall.SIGCONT) })
		return cmd.Process.Pid
	}
	return 0
}

func (w *workerSet) stopAll(timeout time.Duration) {
	w.mu.Lock()
	procs := make([]*exec.Cmd, 0, len(w.procs))
	for _, p := range w.procs {
		procs = append(procs, p)
	}
	w.mu.Unlock()
	for _, p := range procs {
		_ = p.Process.Signal(syscall.SIGCONT)
		_ = p.Process.Signal(syscall.SIGTERM)
	}
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		w.mu.Lock()
		left := len(w.procs)
		w.mu.Unlock()
		if left == 0 {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
	w.killAll()
}

func (w *workerSet) killAll() {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, p := range w.procs {
		_ = p.Process.Kill()
	}
}

// counters adds up the last snapshot of every worker's counters.
func (w *workerSet) counters() map[string]float64 {
	w.mu.Lock()
	files := append([]string(nil), w.files...)
	w.mu.Unlock()
	total := map[string]float64{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		var m map[string]float64
		if json.Unmarshal(b, &m) != nil {
			continue
		}
		for k, v := range m {
			total[k] += v
		}
	}
	return total
}

func sumPrefix(m map[string]float64, prefix string) float64 {
	t := 0.0
	for k, v := range m {
		if strings.HasPrefix(k, prefix) {
			t += v
		}
	}
	return t
}

// flushOutbox runs one clean worker until the outbox is empty.
func flushOutbox(ctx context.Context, pool *pgxpool.Pool, w *workerSet) error {
	var left int
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&left); err != nil || left == 0 {
		return err
	}
	if err := w.start(); err != nil {
		return err
	}
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		if err := pool.QueryRow(ctx, `select count(*) from idemsaga.outbox where published_at is null`).Scan(&left); err != nil {
			return err
		}
		if left == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	w.stopAll(30 * time.Second)
	return nil
}

func dbAddr(pool *pgxpool.Pool) (string, error) {
	cc := pool.Config().ConnConfig
	if strings.HasPrefix(cc.Host, "/") {
		return "", errors.New("chaos needs PostgreSQL over TCP (a host name in DATABASE_URL), to put a proxy in front of it")
	}
	return net.JoinHostPort(cc.Host, strconv.Itoa(int(cc.Port))), nil
}

// withHostPort returns dsn pointing at addr instead.
func withHostPort(dsn, addr string) (string, error) {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return "", err
	}
	if strings.HasPrefix(dsn, "postgres://") || strings.HasPrefix(dsn, "postgresql://") {
		u, err := parseURL(dsn)
		if err != nil {
			return "", err
		}
		u.Host = net.JoinHostPort(host, port)
		return u.String(), nil
	}
	return dsn + " host=" + host + " port=" + port, nil
}
