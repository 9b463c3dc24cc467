package main

import (
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemsaga/idemsaga/examples/settlement"
)

// reportService is the reporting service the settlement example posts
// to, for chaos runs: it keeps one report per Idempotency-Key, answers a
// key posted again with the report it kept, and withdraws a report (or
// voids a key none came under) on POST /reports/{key}/withdraw, refusing
// a later report under a voided key with 409. It misbehaves on purpose:
// it loses answers after it kept the report, fails some requests with
// 500 before doing anything, and answers some after the caller's
// timeout. It refuses for good (422) the reports of one day in six, whose
// books are closed.
type reportService struct {
	loseAfter, failBefore, slowP float64
	slow                         time.Duration

	mu      sync.Mutex
	rng     *rand.Rand
	reports map[string]settlement.ReportRequest // by Idempotency-Key
	voided  map[string]bool
	counts  reportCounts
}

type reportCounts struct {
	Posts, Kept, Replays, Withdrawn, Refused, Lost, Failed, Slow int
}

func newReportService(seed uint64) *reportService {
	return &reportService{loseAfter: 0.05, failBefore: 0.04, slowP: 0.02, slow: chaosStepTimeout + 500*time.Millisecond,
		rng: rand.New(rand.NewPCG(seed, 11)), reports: map[string]settlement.ReportRequest{}, voided: map[string]bool{}}
}

// fault draws what happens to a request: lost after, failed before, or
// slow.
func (rs *reportService) fault() (lose, fail, slow bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	x := rs.rng.Float64()
	return x < rs.loseAfter, x >= rs.loseAfter && x < rs.loseAfter+rs.failBefore,
		x >= rs.loseAfter+rs.failBefore && x < rs.loseAfter+rs.failBefore+rs.slowP
}

func (rs *reportService) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	lose, fail, slow := rs.fault()
	if fail {
		rs.count(func(c *reportCounts) { c.Failed++ })
		http.Error(w, "try again", http.StatusInternalServerError)
		return
	}
	if slow {
		rs.count(func(c *reportCounts) { c.Slow++ })
		time.Sleep(rs.slow)
	}
	status, body := rs.handle(r)
	if lose {
		// Kept, and the answer lost: the connection drops.
		rs.count(func(c *reportCounts) { c.Lost++ })
		if hj, ok := w.(http.Hijacker); ok {
			if conn, _, err := hj.Hijack(); err == nil {
				_ = conn.Close()
				return
			}
		}
		status = http.StatusBadGateway
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(body)
}

func (rs *reportService) count(f func(*reportCounts)) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	f(&rs.counts)
}

func (rs *reportService) handle(r *http.Request) (int, any) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	key := r.Header.Get("Idempotency-Key")
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/reports":
		rs.counts.Posts++
		var req settlement.ReportRequest
		if key == "" || json.NewDecoder(r.Body).Decode(&req) != nil {
			return http.StatusBadRequest, map[string]string{"error": "a report needs an Idempotency-Key and a JSON body"}
		}
		if rs.voided[key] {
			return http.StatusConflict, map[string]string{"error": "this key's report was withdrawn"}
		}
		if have, ok := rs.reports[key]; ok {
			rs.counts.Replays++
			return http.StatusOK, settlement.Report{ID: key, Day: have.Day}
		}
		if closedBooks(req.Day) {
			rs.counts.Refused++
			return http.StatusUnprocessableEntity, map[string]string{"error": "the books of " + req.Day + " are closed"}
		}
		rs.reports[key] = req
		rs.counts.Kept++
		return http.StatusCreated, settlement.Report{ID: key, Day: req.Day}
	case r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/reports/") && strings.HasSuffix(r.URL.Path, "/withdraw"):
		forward := strings.TrimSuffix(strings.TrimPrefix(r.URL.Path, "/reports/"), "/withdraw")
		rep, ok := rs.reports[forward]
		if ok {
			rs.counts.Withdrawn++
		}
		delete(rs.reports, forward)
		rs.voided[forward] = true
		return http.StatusOK, settlement.Report{ID: forward, Day: rep.Day}
	}
	return http.StatusNotFound, map[string]string{"error": "no such route"}
}

// kept returns the reports kept, by key, and what the service counted.
func (rs *reportService) kept() (map[string]settlement.ReportRequest, reportCounts) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	out := make(map[string]settlement.ReportRequest, len(rs.reports))
	for k, r := range rs.reports {
		out[k] = r
	}
	return out, rs.counts
}

// closedBooks says whether the service refuses the reports of day: one
// day in six.
func closedBooks(day string) bool {
	d, err := time.Parse("2006-01-02", day)
	return err == nil && d.YearDay()%6 == 0
}
