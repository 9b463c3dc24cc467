package service

import (
	"context"
	"net"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// runEmbedded runs `run --embedded-nats dir` until the returned function
// is called, which drains it and returns its log; it returns once the
// worker runs, with the URL the embedded server logged.
func runEmbedded(t *testing.T, cfg Config, dir string, args ...string) (url string, stop func() string) {
	t.Helper()
	var log string
	stop = runInBackground(t, cfg, "worker running", func(l string) { log = l }, append([]string{"run", "--http-addr", "", "--embedded-nats", dir}, args...)...)
	m := embeddedURL.FindStringSubmatch(log)
	if m == nil {
		t.Fatalf("run did not log the embedded server's URL:\n%s", log)
	}
	return m[1], stop
}

var embeddedURL = regexp.MustCompile(`embedded NATS with JetStream running.* url=(nats://127\.0\.0\.1:[0-9]+)`)

// TestRunWithEmbeddedNATS: `run --embedded-nats` on a folder of its own
// needs no NATS server: a saga started by another process finishes, the
// logged URL takes connections, the drain stops the server, and a second
// run on the same folder goes on with the stream the first stored.
func TestRunWithEmbeddedNATS(t *testing.T) {
	_, url := testenv.DBWithURL(t)
	t.Setenv("DATABASE_URL", url)
	t.Setenv("NATS_URL", "")
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	_, _, err := runIn(t, shop, "migrate")
	require.NoError(t, err)
	dir := filepath.Join(t.TempDir(), "nats")

	natsURL, stop := runEmbedded(t, shop, dir)
	nc, err := nats.Connect(natsURL)
	require.NoError(t, err, "the logged URL takes connections")
	nc.Close()
	out, _, err := runIn(t, Config{Name: "shopadmin"}, "start", "greet", "--key", "e-1", "--input", `{}`, "--wait", "--timeout", "30s")
	require.NoError(t, err)
	require.Contains(t, out, "byed")
	log := stop()
	require.Regexp(t, `(?s)draining.*embedded NATS stopped.*stopped cleanly`, log)
	_, err = nats.Connect(natsURL, nats.MaxReconnects(0), nats.Timeout(time.Second))
	require.Error(t, err, "the server stopped with the process")

	// The same folder, on a port given: the stream the first made is there.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	secondStart := time.Now()
	natsURL, stop = runEmbedded(t, shop, dir, "--embedded-nats-port", strconv.Itoa(port))
	require.Equal(t, "nats://127.0.0.1:"+strconv.Itoa(port), natsURL)
	nc = testenv.Connect(t, natsURL)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	stream, err := js.Stream(context.Background(), engine.StreamDefault)
	require.NoError(t, err)
	require.True(t, stream.CachedInfo().Created.Before(secondStart), "stream created %s, by the first run", stream.CachedInfo().Created)
	out, _, err = runIn(t, Config{Name: "shopadmin"}, "start", "greet", "--key", "e-2", "--input", `{}`, "--wait", "--timeout", "30s")
	require.NoError(t, err)
	require.Contains(t, out, "byed")

	// A port held by another server is refused, naming the likely holder.
	_, _, err = runIn(t, shop, "run", "--http-addr", "", "--embedded-nats", t.TempDir(), "--embedded-nats-port", strconv.Itoa(port))
	require.ErrorContains(t, err, "cannot listen on 127.0.0.1:"+strconv.Itoa(port))
	require.ErrorContains(t, err, "systemctl stop nats-server")
	require.ErrorContains(t, err, "--embedded-nats-port 0")
	require.NotContains(t, stop(), "level=ERROR")
}

// TestEmbeddedNATSRefusesAnotherServer: --embedded-nats with a NATS URL
// or a NATS security flag is refused before anything starts, saying
// which to drop.
func TestEmbeddedNATSRefusesAnotherServer(t *testing.T) {
	t.Setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none") // never reached
	t.Setenv("NATS_URL", "")
	shop := Config{Name: "shop", Definitions: []*saga.Definition{greetDefinition()}}
	dir := t.TempDir()

	_, _, err := runIn(t, shop, "run", "--embedded-nats", dir, "--nats-url", "nats://u:s3cret@10.0.0.1:4222")
	require.ErrorContains(t, err, "--embedded-nats (IDEMSAGA_EMBEDDED_NATS) runs a NATS server in this process, and --nats-url or NATS_URL (nats://u:xxxxx@10.0.0.1:4222) names another: give one of them")
	require.NotContains(t, err.Error(), "s3cret")

	_, _, err = runIn(t, shop, "run", "--embedded-nats", dir, "--nats-url", NATSURLDefault)
	require.ErrorContains(t, err, "give one of them", "the default's own value, given, is still another server")

	t.Setenv("NATS_URL", "nats://10.0.0.1:4222")
	_, _, err = runIn(t, shop, "run", "--embedded-nats", dir)
	require.ErrorContains(t, err, "give one of them (unset NATS_URL, or drop --embedded-nats)")
	t.Setenv("IDEMSAGA_EMBEDDED_NATS", dir)
	_, _, err = runIn(t, shop, "run")
	require.ErrorContains(t, err, "give one of them", "from the environment too")
	t.Setenv("NATS_URL", "")

	_, _, err = runIn(t, shop, "run", "--nats-creds", filepath.Join(dir, "x.creds"))
	require.ErrorContains(t, err, "without authentication or TLS, and --nats-creds is for a server that has them")
	_, _, err = runIn(t, shop, "run", "--embedded-nats-port", "70000")
	require.ErrorContains(t, err, "--embedded-nats-port 70000 is not a port")
	t.Setenv("IDEMSAGA_EMBEDDED_NATS", "") // none, not the current folder
	_, _, err = runIn(t, shop, "run", "--embedded-nats-port", "4222")
	require.ErrorContains(t, err, "--embedded-nats-port 4222 is the port of --embedded-nats, which is not given")
}
