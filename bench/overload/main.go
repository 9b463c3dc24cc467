// Command overload floods running workers' HTTP APIs with transfer sagas
// (POST /v1/sagas/transfer), faster than they can run them, honouring
// 503 + Retry-After, then waits for every saga to end and reports what the
// overload cost: lease takeovers, the highest attempt reached, saga times,
// and the starts shed. It works against any build's `worker run`, so that
// builds can be compared (bench/JOURNAL.md, "overload").
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// removeStream deletes a stream, if it exists.
func removeStream(url, name string) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		return err
	}
	return nil
}

func main() {
	urls := flag.String("urls", "http://127.0.0.1:9464", "Base URLs of the workers' APIs, comma-separated; requests go round robin.")
	db := flag.String("database-url", os.Getenv("DATABASE_URL"), "The workers' database.")
	n := flag.Int("n", 20000, "Transfers to start.")
	conc := flag.Int("c", 200, "Requests in flight at once.")
	accounts := flag.Int64("accounts", 1000, "Accounts seeded (worker seed --accounts).")
	timeout := flag.Duration("timeout", 15*time.Minute, "How long the run may take.")
	natsURL := flag.String("nats-url", "nats://127.0.0.1:4222", "NATS server of -delete-stream.")
	deleteStream := flag.String("delete-stream", "", "Delete this JetStream stream and exit (the cleanup after a run).")
	flag.Parse()
	if *deleteStream != "" {
		if err := removeStream(*natsURL, *deleteStream); err != nil {
			fmt.Fprintln(os.Stderr, "overload:", err)
			os.Exit(1)
		}
		return
	}
	if err := run(strings.Split(*urls, ","), *db, *n, *conc, *accounts, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, "overload:", err)
		os.Exit(1)
	}
}

func run(urls []string, db string, n, conc int, accounts int64, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		return err
	}
	defer pool.Close()
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: conc}}
	var shed, failed atomic.Int64
	// firstShed is when the first 503 came, in ns after begin (0: none).
	var firstShed atomic.Int64
	jobs := make(chan int)
	var wg sync.WaitGroup
	begin := time.Now()
	for w := range conc {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for i := range jobs {
				from := 1 + rng.Int64N(accounts)
				to := 1 + (from+rng.Int64N(accounts-1))%accounts
				body := fmt.Sprintf(`{"from":%d,"to":%d,"amount":1}`, from, to)
				for try := 0; ctx.Err() == nil; try++ {
					status, after, err := post(ctx, client, urls[(i+try)%len(urls)], "ovl-"+strconv.Itoa(i), body)
					if err == nil && (status == http.StatusCreated || status == http.StatusOK) {
						break
					}
					if status == http.StatusServiceUnavailable && after > 0 {
						shed.Add(1)
						firstShed.CompareAndSwap(0, int64(time.Since(begin)))
						sleep(ctx, after)
						continue
					}
					failed.Add(1)
					sleep(ctx, 200*time.Millisecond)
				}
			}
		})
	}
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	submitted := time.Since(begin)
	fmt.Printf("submitted %d transfers in %s (%d answered 503 and sent again after Retry-After, %d other failures)\n", n, submitted.Round(time.Millisecond), shed.Load(), failed.Load())
	if f := firstShed.Load(); f > 0 {
		fmt.Printf("first 503 %s after the first request\n", time.Duration(f).Round(time.Millisecond))
	}
	for {
		var running int
		if err := pool.QueryRow(ctx, `select count(*) from idemsaga.sagas where finished_at is null`).Scan(&running); err != nil {
			return err
		}
		if running == 0 {
			break
		}
		if !sleep(ctx, 200*time.Millisecond) {
			return fmt.Errorf("%d sagas still running after %s", running, timeout)
		}
	}
	elapsed := time.Since(begin)
	var maxAttempt, beyond, ended int
	var p50, p99, maxT float64
	q := `select max(attempt), count(*) filter (where attempt > 1) from idemsaga.steps`
	if err := pool.QueryRow(ctx, q).Scan(&maxAttempt, &beyond); err != nil {
		return err
	}
	if err := pool.QueryRow(ctx, `select count(*) from idemsaga.step_attempts`).Scan(&ended); err != nil {
		return err
	}
	q = `select percentile_cont(0.5) within group (order by extract(epoch from finished_at - created_at)),
percentile_cont(0.99) within group (order by extract(epoch from finished_at - created_at)),
max(extract(epoch from finished_at - created_at)) from idemsaga.sagas`
	if err := pool.QueryRow(ctx, q).Scan(&p50, &p99, &maxT); err != nil {
		return err
	}
	states := map[string]int{}
	rows, err := pool.Query(ctx, `select state::text, count(*) from idemsaga.sagas group by 1`)
	if err != nil {
		return err
	}
	for rows.Next() {
		var s string
		var c int
		if err := rows.Scan(&s, &c); err != nil {
			return err
		}
		states[s] = c
	}
	rows.Close()
	metrics := map[string]float64{}
	for _, u := range urls {
		if err := scrape(ctx, client, u, metrics); err != nil {
			return err
		}
	}
	fmt.Printf("all ended %s after the first request; states %v\n", elapsed.Round(time.Millisecond), states)
	fmt.Printf("saga time (created to finished): median %.2fs, p99 %.2fs, max %.2fs\n", p50, p99, maxT)
	fmt.Printf("highest attempt %d; %d steps beyond attempt 1; %d attempts ended other than by their outcome\n", maxAttempt, beyond, ended)
	fmt.Printf("lease takeovers %.0f; commands requeued at their attempt %.0f (queued %.0f, resent %.0f); starts shed %.0f\n",
		metrics["idemsaga_lease_takeovers_total"], metrics["idemsaga_commands_requeued_total"],
		metrics[`idemsaga_commands_requeued_total{how="queued"}`], metrics[`idemsaga_commands_requeued_total{how="resent"}`],
		metrics["idemsaga_starts_shed_total"])
	return nil
}

func post(ctx context.Context, c *http.Client, base, key, body string) (int, time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/sagas/transfer", strings.NewReader(body))
	if err != nil {
		return 0, 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	res, err := c.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer res.Body.Close()
	_, _ = io.Copy(io.Discard, res.Body)
	secs, _ := strconv.Atoi(res.Header.Get("Retry-After"))
	return res.StatusCode, time.Duration(secs) * time.Second, nil
}

// scrape adds the counters of one worker's /metrics: the sum of each
// family, and of each "how" label.
func scrape(ctx context.Context, c *http.Client, base string, into map[string]float64) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return err
	}
	res, err := c.Do(req)
	if err != nil {
		return err
	}
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if line == "" || line[0] == '#' {
			continue
		}
		sp := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[sp+1:], 64)
		if err != nil {
			continue
		}
		name, labels, _ := strings.Cut(line[:sp], "{")
		into[name] += v
		if i := strings.Index(labels, `how="`); i >= 0 {
			how, _, _ := strings.Cut(labels[i+5:], `"`)
			into[name+`{how="`+how+`"}`] += v
		}
	}
	return nil
}

func sleep(ctx context.Context, d time.Duration) bool {
	select {
	case <-ctx.Done():
		return false
	case <-time.After(d):
		return true
	}
}
