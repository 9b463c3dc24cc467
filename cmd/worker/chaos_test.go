package main_test

import (
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/testenv"
)

var fullChaos = flag.Bool("chaos.full", false, "run the full chaos runs (5,000 transfers, 2,000 orders, 5,000 cross-border transfers, 60 nights; a kill every second) instead of the small ones")

// TestChaos runs `worker chaos`: worker processes killed with SIGKILL,
// one paused with SIGSTOP past its leases, NATS restarted, database
// connections cut, while transfers (10% failing, 20% submitted twice) run,
// and then while orders run against a payment service that loses answers
// after charging, fails before charging, and answers after the step's
// timeout, and while cross-border transfers run their FX conversions as
// child sagas, and while the nightly settlement's schedule runs through
// nights of a clock that passes one a second, every worker down for
// five of them. Every saga must end terminal with zero differences: the
// engine's invariants and the examples' own (money conserved, per
// currency across accounts and the FX desk; no order charged twice,
// every charge shipped or refunded, stock conserved; each night settled
// and reported once, or compensated when its books are closed, and no
// night missed but those the catch-up skips after the outage). Every
// other transfer and order starts through a worker's HTTP API. The
// small versions run in the normal suite; -chaos.full runs the full ones.
func TestChaos(t *testing.T) {
	t.Parallel()
	for _, sagaKind := range []string{"transfer", "order", "crossborder", "settlement"} {
		t.Run(sagaKind, func(t *testing.T) {
			t.Parallel()
			chaos(t, sagaKind)
		})
	}
}

func chaos(t *testing.T, sagaKind string) {
	name := "idemsaga_chaos_test_" + strings.ToLower(testenv.Name("c")[2:])
	t.Cleanup(func() {
		ctx := context.Background()
		if conn, err := pgx.Connect(ctx, testenv.AdminURL()); err == nil {
			_, _ = conn.Exec(ctx, "drop database if exists "+name+" with (force)")
			_ = conn.Close(ctx)
		}
	})
	args := []string{"chaos", "--saga", sagaKind, "--db-name", name, "--transfers", "500", "--orders", "300", "--nights", "20", "--max-kills", "4", "--kill-every", "700ms"}
	if *fullChaos {
		args = []string{"chaos", "--saga", sagaKind, "--db-name", name}
	}
	if sagaKind == "transfer" || sagaKind == "order" {
		// Every other saga through a worker's HTTP API: a transfer's
		// start then commits with its first step in the worker being
		// killed.
		args = append(args, "--http-starts")
	}
	raceLog := filepath.Join(t.TempDir(), "race")
	r := worker(t, []string{"DATABASE_URL=" + testenv.AdminURL(), "GORACE=log_path=" + raceLog}, args...)
	t.Log(r.stdout)
	if r.code != 0 {
		t.Log(r.stderr)
		reports, _ := filepath.Glob(raceLog + "*")
		for _, f := range reports {
			b, _ := os.ReadFile(f)
			t.Logf("race report %s:\n%s", f, b)
		}
	}
	require.Equal(t, 0, r.code, "exit code of worker chaos")
	require.Contains(t, r.stdout, "differences: 0")
	require.Contains(t, r.stdout, "failed 0")
}
