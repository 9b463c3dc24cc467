// Command dbos runs the transfer workload of `worker bench` on DBOS
// Transact Go (v1.8.0), so that the two can be compared on one machine in
// one sitting (bench/JOURNAL.md, "Issue 5, fifth pass" and "sixth pass":
// the same failure spread and the same connections as worker bench).
//
// It is a module of its own: the engine never depends on DBOS.
//
//	cd bench/compare/dbos && go run . --workflows 10000
//
// Each Transfer workflow runs a "deduct" step and a "credit" step, and a
// compensating "refund" step when the credit hits the frozen account. Each
// step's business write is one statement shaped like the transfer
// example's: the balance change, then the ledger row keyed by workflow and
// step. --steps picks how DBOS runs it:
//
//   - transaction (the default): dbos.RunAsTransaction on a data source
//     that is the system database's own pool, so the business write and
//     DBOS's record of the step commit in one transaction, exactly once,
//     as an idemsaga step's business write and inbox row do. The
//     application's tables live in the system database.
//   - step: dbos.RunAsStep, the write in autocommit on an application
//     database of its own; DBOS records the step after it, so the step
//     runs at least once and the ledger key makes it idempotent.
//
// The load is the bench's: a closed loop of --concurrency workflows (32),
// 5% compensated, 10% submitted twice with the same workflow ID, after a
// warm-up of 200. It reports workflows per second, latency, CPU per
// workflow of this process and of every PostgreSQL process, commits per
// workflow, and whether money was conserved (exit status 1 if not). The
// databases (dbosbench_sys, and dbosbench_app for --steps step) are made
// afresh on the server of --database-url ($DATABASE_URL) and dropped at
// the end.
package main

import (
	"context"
	"encoding/gob"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net/url"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/dbos-inc/dbos-transact-golang/dbos"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

const (
	appDBName      = "dbosbench_app"
	sysDBName      = "dbosbench_sys"
	numAccounts    = 1000
	frozenAccount  = 1001
	initialBalance = int64(1_000_000_000)
	frozenBalance  = int64(0)
)

// TransferInput is the workflow input (JSON-serialized by DBOS into the system DB).
type TransferInput struct {
	From   int64
	To     int64
	Amount int64
}

// StepError is the permanent failure of a step (0 rows updated: frozen account
// or insufficient funds). It is an exported, gob-registered type so DBOS can
// checkpoint it as-is instead of warning and storing only its message.
type StepError struct {
	Step    string
	Account int64
	Reason  string
}

func (e *StepError) Error() string {
	return fmt.Sprintf("%s on account %d: %s", e.Step, e.Account, e.Reason)
}

func init() { gob.Register(&StepError{}) }

// appPool holds the application's tables: its own database for
// --steps step, the system database for --steps transaction (then it is
// also DBOS's system pool and the data source ds).
var (
	appPool *pgxpool.Pool
	ds      *dbos.DataSource
	asTxn   bool
)

// ledgerSQL is a step's business write, shaped like idemsaga's transfer
// example: the balance change, then the ledger row keyed by (workflow_id,
// step) from it. Nothing is written when the account cannot take the
// change (0 rows: a failure).
func ledgerSQL(delta int64) string {
	if delta < 0 {
		return `with a as (update accounts set balance = balance + $4::bigint where id = $3 and balance >= -$4::bigint and not frozen returning id)
insert into ledger (workflow_id, step, account_id, amount) select $1, $2, id, $4::bigint from a`
	}
	return `with a as (update accounts set balance = balance + $4::bigint where id = $3 and not frozen returning id)
insert into ledger (workflow_id, step, account_id, amount) select $1, $2, id, $4::bigint from a`
}

func refused(step string, account, delta int64) error {
	reason := "account frozen"
	if delta < 0 {
		reason = "insufficient funds or account frozen"
	}
	return &StepError{Step: step, Account: account, Reason: reason}
}

// runStep runs one step's business write the way --steps says (see the
// package comment).
func runStep(ctx dbos.Context, wfID, step string, account, delta int64) error {
	opts := []dbos.StepOption{dbos.WithStepName(step), dbos.WithStepMaxRetries(0)}
	if asTxn {
		_, err := dbos.RunAsTransaction(ctx, ds, func(ctx context.Context, tx dbos.Tx) (bool, error) {
			res, err := tx.Exec(ctx, ledgerSQL(delta), wfID, step, account, delta)
			if err != nil {
				return false, err
			}
			if n, err := res.RowsAffected(); err != nil || n == 0 {
				return false, errors.Join(err, refused(step, account, delta))
			}
			return true, nil
		}, opts...)
		return err
	}
	_, err := dbos.RunAsStep(ctx, func(ctx context.Context) (bool, error) {
		// At least once: a re-execution of a step that already took
		// effect fails on the ledger's key, which rolls its balance
		// change back with it: that is "already applied".
		tag, err := appPool.Exec(ctx, ledgerSQL(delta), wfID, step, account, delta)
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "23505" {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if tag.RowsAffected() == 0 {
			return false, refused(step, account, delta)
		}
		return true, nil
	}, opts...)
	return err
}

// Transfer is the durable workflow.
func Transfer(ctx dbos.Context, in TransferInput) (string, error) {
	wfID, err := dbos.GetWorkflowID(ctx)
	if err != nil {
		return "", err
	}
	// Steps are not retried (WithStepMaxRetries(0), DBOS's default made
	// visible): a refused change is a permanent failure, as in the bench.
	if err := runStep(ctx, wfID, "deduct", in.From, -in.Amount); err != nil {
		return "", fmt.Errorf("deduct failed: %w", err)
	}
	if err := runStep(ctx, wfID, "credit", in.To, in.Amount); err == nil {
		return "credited", nil
	}
	// Credit failed (frozen account): compensate.
	if err := runStep(ctx, wfID, "refund", in.From, in.Amount); err != nil {
		return "", fmt.Errorf("refund failed: %w", err)
	}
	return "compensated", nil
}

// workload parameters for workflow i
func params(i int) TransferInput {
	from := int64(1 + (i*7919)%1000)
	to := 1 + (from+1+int64(i%999))%1000
	if fails(i) {
		to = frozenAccount
	}
	return TransferInput{From: from, To: to, Amount: int64(1 + i%97)}
}

func isDuplicate(i int) bool { return (i*31)%1000 < 100 }

// fails reports whether workflow i's credit fails: every 20th (5%), spread
// evenly as in worker bench, not in runs of 50.
func fails(i int) bool { return (i+1)%20 == 0 }

type runStats struct {
	latencies   []time.Duration
	credited    int64
	compensated int64
	failed      int64
	dupSubmits  int64
	dupBadID    int64
	firstErr    error
}

func runPhase(dctx dbos.Context, prefix string, n, concurrency int) (*runStats, time.Duration) {
	st := &runStats{latencies: make([]time.Duration, n)}
	var next int64 = -1
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(atomic.AddInt64(&next, 1))
				if i >= n {
					return
				}
				id := fmt.Sprintf("%s-%07d", prefix, i)
				in := params(i)
				t0 := time.Now()
				h, err := dbos.RunWorkflow(dctx, Transfer, in, dbos.WithWorkflowID(id))
				if err != nil {
					atomic.AddInt64(&st.failed, 1)
					mu.Lock()
					if st.firstErr == nil {
						st.firstErr = fmt.Errorf("%s RunWorkflow: %w", id, err)
					}
					mu.Unlock()
					continue
				}
				if isDuplicate(i) {
					// Duplicate submit with the same workflow ID: DBOS's default
					// WorkflowIDReusePolicyReturnExisting returns a (polling) handle
					// to the existing workflow instead of starting a second one.
					h2, err := dbos.RunWorkflow(dctx, Transfer, in, dbos.WithWorkflowID(id))
					atomic.AddInt64(&st.dupSubmits, 1)
					if err != nil || h2.GetWorkflowID() != id {
						atomic.AddInt64(&st.dupBadID, 1)
						mu.Lock()
						if st.firstErr == nil {
							st.firstErr = fmt.Errorf("%s duplicate RunWorkflow: %v", id, err)
						}
						mu.Unlock()
					}
				}
				res, err := h.GetResult()
				st.latencies[i] = time.Since(t0)
				switch {
				case err != nil:
					atomic.AddInt64(&st.failed, 1)
					mu.Lock()
					if st.firstErr == nil {
						st.firstErr = fmt.Errorf("%s GetResult: %w", id, err)
					}
					mu.Unlock()
				case res == "credited":
					atomic.AddInt64(&st.credited, 1)
				case res == "compensated":
					atomic.AddInt64(&st.compensated, 1)
				default:
					atomic.AddInt64(&st.failed, 1)
				}
			}
		}()
	}
	wg.Wait()
	return st, time.Since(start)
}

func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// postgresCPU sums utime+stime of every process whose comm is "postgres"; also
// returns the part belonging to backends of the two benchmark databases.
func postgresCPU() (all, ours time.Duration) {
	const clkTck = 100 // getconf CLK_TCK on Linux
	paths, _ := filepath.Glob("/proc/[0-9]*/stat")
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		s := string(b)
		lp, rp := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
		if lp < 0 || rp < lp || s[lp+1:rp] != "postgres" {
			continue
		}
		f := strings.Fields(s[rp+2:]) // f[0] is field 3 (state)
		if len(f) < 13 {
			continue
		}
		ut, _ := strconv.ParseInt(f[11], 10, 64)  // field 14
		stt, _ := strconv.ParseInt(f[12], 10, 64) // field 15
		d := time.Duration(ut+stt) * time.Second / clkTck
		all += d
		if cl, err := os.ReadFile(filepath.Join(filepath.Dir(p), "cmdline")); err == nil {
			c := string(cl)
			if strings.Contains(c, " "+appDBName+" ") || strings.Contains(c, " "+sysDBName+" ") {
				ours += d
			}
		}
	}
	return
}

// commits returns xact_commit of the app and the system database.
func commits(ctx context.Context, admin *pgx.Conn) (app, sys int64) {
	if _, err := admin.Exec(ctx, `select pg_stat_clear_snapshot()`); err != nil {
		log.Fatalf("pg_stat_clear_snapshot: %v", err)
	}
	if err := admin.QueryRow(ctx,
		`select coalesce(sum(xact_commit) filter (where datname = $1),0)::bigint,
		        coalesce(sum(xact_commit) filter (where datname = $2),0)::bigint
		   from pg_stat_database`, appDBName, sysDBName).Scan(&app, &sys); err != nil {
		log.Fatalf("pg_stat_database: %v", err)
	}
	return
}

func pct(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	k := int(p*float64(len(sorted)-1) + 0.5)
	return sorted[k]
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func main() {
	concurrency := flag.Int("concurrency", 32, "closed-loop client goroutines")
	workflows := flag.Int("workflows", 10000, "measured workflows")
	warmup := flag.Int("warmup", 200, "warm-up workflows (not measured)")
	keep := flag.Bool("keep", false, "do not drop the databases at the end")
	defaultURL := os.Getenv("DATABASE_URL")
	if defaultURL == "" {
		defaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
	}
	databaseURL := flag.String("database-url", defaultURL, "PostgreSQL server to use, as a URL; its databases dbosbench_* are made afresh ($DATABASE_URL)")
	maxConns := flag.Int("max-conns", 0, "database connections of the application's pool, which DBOS shares for its system database with --steps transaction (0: 6 per CPU of this machine, as worker bench's pools have in all)")
	steps := flag.String("steps", "transaction", "how DBOS runs a step: transaction (RunAsTransaction, exactly once) or step (RunAsStep, at least once)")
	statsWait := flag.Duration("stats-wait", 11*time.Second, "pause before reading pg_stat_database: PostgreSQL 15 backends may hold pending counters up to 10 s (PGSTAT_IDLE_INTERVAL)")
	flag.Parse()
	switch *steps {
	case "transaction":
		asTxn = true
	case "step":
	default:
		log.Fatalf("--steps %q: use transaction or step", *steps)
	}
	switch {
	case *maxConns < 0 || *maxConns > 1000:
		log.Fatalf("--max-conns %d: give the pool's database connections, from 1 to 1000, or 0 for 6 per CPU", *maxConns)
	case *maxConns == 0:
		*maxConns = 6 * runtime.NumCPU()
	}

	ctx := context.Background()
	base, err := url.Parse(*databaseURL)
	if err != nil || base.Scheme == "" {
		log.Fatalf("--database-url %q is not a URL; give one such as postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable", *databaseURL)
	}
	dbURL := func(db string) string {
		u := *base
		u.Path = "/" + db
		return u.String()
	}
	databases := []string{sysDBName}
	appDB := sysDBName
	if !asTxn {
		databases, appDB = append(databases, appDBName), appDBName
	}

	// Fresh databases.
	admin, err := pgx.Connect(ctx, *databaseURL)
	if err != nil {
		log.Fatalf("connect to %s: %v", *databaseURL, err)
	}
	defer admin.Close(ctx)
	for _, db := range databases {
		if _, err := admin.Exec(ctx, "drop database if exists "+db+" with (force)"); err != nil {
			log.Fatalf("drop %s: %v", db, err)
		}
		if _, err := admin.Exec(ctx, "create database "+db); err != nil {
			log.Fatalf("create %s: %v", db, err)
		}
	}
	dropAll := func() {
		if *keep {
			fmt.Println("keeping databases", databases)
			return
		}
		for _, db := range databases {
			if _, err := admin.Exec(ctx, "drop database if exists "+db+" with (force)"); err != nil {
				log.Printf("drop %s: %v", db, err)
			}
		}
	}

	// App pool and schema.
	pcfg, err := pgxpool.ParseConfig(dbURL(appDB))
	if err != nil {
		log.Fatal(err)
	}
	// Sized as worker bench sizes its pools in all (--max-conns): more
	// connections than PostgreSQL has cores cost both engines alike
	// (bench/JOURNAL.md).
	pcfg.MaxConns = int32(*maxConns)
	appPool, err = pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		log.Fatalf("app pool: %v", err)
	}
	if _, err := appPool.Exec(ctx, `
		create table accounts(id bigint primary key, balance bigint not null, frozen bool not null default false);
		create table ledger(workflow_id text, step text, account_id bigint, amount bigint, primary key (workflow_id, step));`); err != nil {
		log.Fatalf("schema: %v", err)
	}
	if _, err := appPool.Exec(ctx,
		`insert into accounts(id, balance) select g, $1 from generate_series(1, $2::bigint) g`,
		initialBalance, numAccounts); err != nil {
		log.Fatalf("seed: %v", err)
	}
	if _, err := appPool.Exec(ctx, `insert into accounts(id, balance, frozen) values ($1, $2, true)`,
		frozenAccount, frozenBalance); err != nil {
		log.Fatalf("seed frozen: %v", err)
	}
	if _, err := appPool.Exec(ctx, `vacuum analyze accounts`); err != nil {
		log.Fatalf("vacuum: %v", err)
	}
	seededTotal := initialBalance*numAccounts + frozenBalance

	// DBOS: system database dbosbench_sys, all other settings default. For
	// transaction steps its pool is the application's, which makes the data
	// source share the system database: one transaction per step.
	cfg := dbos.Config{
		AppName: "dbosbench",
		Logger:  slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	if asTxn {
		cfg.SystemDBPool = appPool
	} else {
		cfg.DatabaseURL = dbURL(sysDBName)
	}
	dctx, err := dbos.NewContext(ctx, cfg)
	if err != nil {
		log.Fatalf("dbos.NewContext: %v", err)
	}
	if asTxn {
		if ds, err = dbos.NewDataSource(dctx, appPool, dbos.WithDataSourceName("app")); err != nil {
			log.Fatalf("dbos.NewDataSource: %v", err)
		}
	}
	dbos.RegisterWorkflow(dctx, Transfer, dbos.WithWorkflowName("Transfer"))
	if err := dbos.Launch(dctx); err != nil {
		log.Fatalf("dbos.Launch: %v", err)
	}

	// Warm-up.
	wst, wdur := runPhase(dctx, "warm", *warmup, *concurrency)
	fmt.Printf("warm-up: %d workflows in %.2fs (credited %d, compensated %d, failed %d)\n",
		*warmup, wdur.Seconds(), wst.credited, wst.compensated, wst.failed)
	if wst.firstErr != nil {
		fmt.Println("warm-up first error:", wst.firstErr)
	}

	// Measured part.
	time.Sleep(*statsWait)
	ca0, cs0 := commits(ctx, admin)
	pgAll0, pgOurs0 := postgresCPU()
	cpu0 := processCPU()
	st, dur := runPhase(dctx, "bench", *workflows, *concurrency)
	cpu1 := processCPU()
	pgAll1, pgOurs1 := postgresCPU()
	time.Sleep(*statsWait)
	ca1, cs1 := commits(ctx, admin)
	// Background commit rate of the idle system (DBOS queue runner polling etc.),
	// part of which falls inside the [c0, c1] window.
	time.Sleep(*statsWait)
	ca2, cs2 := commits(ctx, admin)
	bgRate := float64((ca2-ca1)+(cs2-cs1)) / statsWait.Seconds()

	n := *workflows
	lat := append([]time.Duration(nil), st.latencies...)
	sort.Slice(lat, func(a, b int) bool { return lat[a] < lat[b] })
	rate := float64(n) / dur.Seconds()
	procUS := float64((cpu1 - cpu0).Microseconds()) / float64(n)
	pgUS := float64((pgAll1 - pgAll0).Microseconds()) / float64(n)
	pgOursUS := float64((pgOurs1 - pgOurs0).Microseconds()) / float64(n)
	commitsPerWf := float64((ca1-ca0)+(cs1-cs0)) / float64(n)

	// Correctness.
	expComp := int64(0)
	for i := 0; i < n; i++ {
		if fails(i) {
			expComp++
		}
	}
	var total, nonZeroWf, badAccounts, refunds, ledgerWfs int64
	q := func(sql string, dst *int64) {
		if err := appPool.QueryRow(ctx, sql).Scan(dst); err != nil {
			log.Fatalf("check %q: %v", sql, err)
		}
	}
	q(`select sum(balance)::bigint from accounts`, &total)
	q(`select count(*) from (select workflow_id from ledger group by workflow_id having sum(amount) <> 0) x`, &nonZeroWf)
	q(fmt.Sprintf(`select count(*) from accounts a left join (select account_id, sum(amount) s from ledger group by 1) l
		on l.account_id = a.id where a.balance <> (case when a.id = %d then %d else %d end) + coalesce(l.s, 0)`,
		frozenAccount, frozenBalance, initialBalance), &badAccounts)
	q(`select count(*) from ledger where step = 'refund' and workflow_id like 'bench-%'`, &refunds)
	q(`select count(distinct workflow_id) from ledger where workflow_id like 'bench-%'`, &ledgerWfs)

	sysPool := appPool
	if !asTxn {
		if sysPool, err = pgxpool.New(ctx, dbURL(sysDBName)); err != nil {
			log.Fatal(err)
		}
	}
	var sysSuccess, sysTotal int64
	if err := sysPool.QueryRow(ctx,
		`select count(*) filter (where status = 'SUCCESS'), count(*) from dbos.workflow_status where workflow_uuid like 'bench-%'`).
		Scan(&sysSuccess, &sysTotal); err != nil {
		log.Printf("dbos.workflow_status check: %v", err)
	}
	if sysPool != appPool {
		sysPool.Close()
	}

	conserved := total == seededTotal && nonZeroWf == 0 && badAccounts == 0
	compOK := st.compensated == expComp && refunds == expComp && st.failed == 0 && st.credited+st.compensated == int64(n)

	fmt.Printf("measured: %d workflows, concurrency %d, %d connections, GOMAXPROCS default, %.2fs\n", n, *concurrency, *maxConns, dur.Seconds())
	fmt.Printf("results: credited %d, compensated %d (%.2f%%; expected %d), failed %d; duplicate submits %d (bad %d)\n",
		st.credited, st.compensated, 100*float64(st.compensated)/float64(n), expComp, st.failed, st.dupSubmits, st.dupBadID)
	if st.firstErr != nil {
		fmt.Println("first error:", st.firstErr)
	}
	fmt.Printf("check: sum(balance)=%d seeded=%d; workflows with nonzero ledger sum=%d; accounts not matching ledger=%d; refund rows=%d; ledger workflows=%d; dbos workflow_status bench rows=%d (SUCCESS %d)\n",
		total, seededTotal, nonZeroWf, badAccounts, refunds, ledgerWfs, sysTotal, sysSuccess)
	fmt.Printf("cpu: process %.1f s, postgres(all) %.1f s, postgres(bench dbs only) %.1f s (%.0f µs/wf); commits app %d + sys %d\n",
		(cpu1 - cpu0).Seconds(), (pgAll1 - pgAll0).Seconds(), (pgOurs1 - pgOurs0).Seconds(), pgOursUS, ca1-ca0, cs1-cs0)
	fmt.Printf("idle background commits: %.2f/s (the commit window is %.1fs long, so ~%.0f of the counted commits are background)\n",
		bgRate, dur.Seconds()+statsWait.Seconds(), bgRate*(dur.Seconds()+statsWait.Seconds()))
	fmt.Printf("dbos (%s steps): %.0f wf/s, p50 %.2f ms, p95 %.2f ms, p99 %.2f ms, CPU/wf %.0f µs process + %.0f µs postgres = %.0f µs, %.2f commits/wf, conserved=%v, compensated_ok=%v\n",
		*steps, rate, ms(pct(lat, 0.50)), ms(pct(lat, 0.95)), ms(pct(lat, 0.99)), procUS, pgUS, procUS+pgUS, commitsPerWf, conserved, compOK)

	if err := dbos.Shutdown(dctx, 10*time.Second); err != nil {
		log.Printf("dbos.Shutdown: %v", err)
	}
	appPool.Close()
	dropAll()
	if !conserved || !compOK {
		os.Exit(1)
	}
}
