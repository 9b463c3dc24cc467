package engine_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/internal/testenv"
	"github.com/idemsaga/idemsaga/saga"
)

// vaultIn is the input of the codec test's sagas; Secret is the marker
// that must never be found at rest.
type vaultIn struct {
	Secret string `json:"secret"`
	Fail   bool   `json:"fail,omitempty"`
}

func payloadKey(t *testing.T, id string) engine.PayloadKey {
	t.Helper()
	b := make([]byte, 32)
	_, err := rand.Read(b)
	require.NoError(t, err)
	return engine.PayloadKey{ID: id, Secret: b}
}

// TestCodecSealsAtRest: with a Codec, no saga's data is kept in the clear
// anywhere the engine writes it (the sagas, their steps, the inbox, the
// callbacks, the outbox), while every handler, condition, child input and
// compensation reads it in the clear, and Get returns it so. Many sagas
// run at once, through a database step, an external step under a
// condition that reads the first one's result, a child saga whose input
// is built from the parent's, and a callback step; some fail at the end
// and compensate. A client with the keyring rotated (a new key first)
// reads them all; one that lacks the old key cannot, and says why; one
// without a codec (an admin tool) reads them with their data sealed.
func TestCodecSealsAtRest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testenv.DB(t)
	_, nc := testenv.NATS(t)
	stream := testenv.Name("SEAL")
	k1, k2 := payloadKey(t, "k1"), payloadKey(t, "k2")
	codec, err := engine.NewAESGCM(k1)
	require.NoError(t, err)

	var mu sync.Mutex
	seen := map[string]int{} // what handlers read in the clear, by step
	read := func(sc *saga.StepContext) vaultIn {
		var in vaultIn
		if err := sc.DecodeInput(&in); err != nil {
			panic(err)
		}
		if !strings.HasPrefix(in.Secret, "MARKER-") {
			panic(fmt.Sprintf("step %s read its input sealed: %s", sc.Step, sc.Input))
		}
		mu.Lock()
		seen[sc.Step+"/"+string(sc.Phase)]++
		mu.Unlock()
		return in
	}
	echo := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		in := read(sc)
		if sc.Phase == saga.PhaseCompensate && !strings.Contains(string(sc.Results[sc.Step]), in.Secret) {
			panic(fmt.Sprintf("compensation of %s read its forward result sealed: %s", sc.Step, sc.Results[sc.Step]))
		}
		return json.Marshal(map[string]string{"echo": in.Secret})
	}
	inner := saga.MustNew("inner", dbStep("keep", "kept", echo, fastPolicy))
	child := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		in := read(sc)
		var open struct {
			Echo string `json:"echo"`
		}
		if err := json.Unmarshal(sc.Results["open"], &open); err != nil || open.Echo != in.Secret {
			panic(fmt.Sprintf("the child's input was built from a sealed result: %s", sc.Results["open"]))
		}
		return json.Marshal(vaultIn{Secret: open.Echo})
	}
	notifyRuns := func(sc *saga.StepContext) bool {
		var open struct {
			Echo string `json:"echo"`
		}
		if ok, err := sc.DecodeResult("open", &open); !ok || err != nil || !strings.HasPrefix(open.Echo, "MARKER-") {
			panic(fmt.Sprintf("the condition read a sealed result: %s", sc.Results["open"]))
		}
		return true
	}
	last := func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
		if read(sc).Fail {
			return nil, saga.Permanent(fmt.Errorf("refused"))
		}
		return echo(ctx, sc)
	}
	def := saga.MustNew("vault",
		saga.Step{Name: "open", Reaches: "opened", Kind: saga.DatabaseStep, Forward: echo, Compensate: echo, Retry: fastPolicy, CompensateRetry: fastPolicy},
		saga.Step{Name: "notify", Reaches: "notified", Kind: saga.ExternalStep, Forward: echo, Compensate: echo, Retry: fastPolicy, CompensateRetry: fastPolicy,
			When: saga.Condition{Reads: []string{"open"}, Func: notifyRuns}},
		saga.Step{Name: "inner", Reaches: "innered", Kind: saga.ChildStep, Child: inner, Forward: child, Retry: fastPolicy, CompensateRetry: fastPolicy},
		saga.Step{Name: "confirm", Reaches: "confirmed", Kind: saga.CallbackStep, Wait: time.Hour, Forward: echo, Compensate: echo, Retry: fastPolicy, CompensateRetry: fastPolicy},
		saga.Step{Name: "seal", Reaches: "sealed", Kind: saga.DatabaseStep, Forward: last, Retry: fastPolicy},
	)
	e := startEngine(t, pool, nc, stream, []*saga.Definition{def, inner}, func(c *engine.Config) { c.Codec = codec })
	cl := e.Client()

	const n = 12
	ids := make([]uuid.UUID, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			res, err := cl.Start(ctx, def, fmt.Sprintf("vault-%d", i), vaultIn{Secret: fmt.Sprintf("MARKER-%d", i), Fail: i%4 == 0})
			require.NoError(t, err)
			ids[i] = res.ID
		})
	}
	wg.Wait()
	// Answer each callback with a result that holds the marker too.
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	for i, id := range ids {
		for {
			sg, err := cl.Get(ctx, id)
			require.NoError(t, err)
			if sg.State == "innered" {
				break
			}
			require.NoError(t, wctx.Err(), "saga %d reaches its callback step", i)
			time.Sleep(10 * time.Millisecond)
		}
		_, err := cl.Complete(ctx, engine.Callback{Token: saga.CallbackToken(id, "confirm"), EventID: "ev-" + id.String(),
			Result: json.RawMessage(fmt.Sprintf(`{"confirmed":"MARKER-%d"}`, i))})
		require.NoError(t, err)
	}
	for i, id := range ids {
		sg, err := cl.Wait(wctx, id)
		require.NoError(t, err)
		want := saga.State("sealed")
		if i%4 == 0 {
			want = saga.StateCompensated
		}
		require.Equal(t, want, sg.State, "saga %d: %s", i, sg.Error)
		require.JSONEq(t, fmt.Sprintf(`{"secret":"MARKER-%d"%s}`, i, map[bool]string{true: `,"fail":true`}[i%4 == 0]), string(sg.Input), "Get opens the input")
		if want == "sealed" {
			require.JSONEq(t, fmt.Sprintf(`{"confirmed":"MARKER-%d"}`, i), string(sg.Results["confirm"]), "and the results")
			require.JSONEq(t, fmt.Sprintf(`{"keep":{"echo":"MARKER-%d"}}`, i), string(sg.Results["inner"]), "the child's results, opened for the parent")
		}
	}
	mu.Lock()
	require.Equal(t, n, seen["open/forward"])
	require.Equal(t, n/4, seen["open/compensate"], "the compensations read their forward results in the clear")
	mu.Unlock()

	// Nothing in the clear at rest.
	for _, q := range []string{
		`select count(*) from idemsaga.sagas where input::text like '%MARKER%' or results::text like '%MARKER%'`,
		`select count(*) from idemsaga.steps where result::text like '%MARKER%'`,
		`select count(*) from idemsaga.inbox where result::text like '%MARKER%'`,
		`select count(*) from idemsaga.callbacks where result::text like '%MARKER%'`,
		`select count(*) from idemsaga.outbox where position('MARKER' in convert_from(payload, 'UTF8')) > 0`,
	} {
		require.Zero(t, countRows(t, ctx, pool, q), q)
	}
	require.Equal(t, 2*n, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas where input::text like '"idemsaga:sealed:%'`), "every input sealed, the children's too")

	// A client with the keyring rotated reads them; without the old key,
	// or without any key, it cannot, and says why.
	rotated, err := engine.NewAESGCM(k2, k1)
	require.NoError(t, err)
	newOnly, err := engine.NewAESGCM(k2)
	require.NoError(t, err)
	clientWith := func(c saga.Codec) *engine.Client {
		cl, err := engine.NewClient(engine.Config{Pool: pool, Definitions: []*saga.Definition{def, inner}, Stream: stream, SubjectPrefix: "t." + stream,
			LeaseGrace: 10 * time.Second, Logger: quietLogger(), Codec: c})
		require.NoError(t, err)
		return cl
	}
	sg, err := clientWith(rotated).Get(ctx, ids[1])
	require.NoError(t, err)
	require.JSONEq(t, `{"secret":"MARKER-1"}`, string(sg.Input))
	_, err = clientWith(newOnly).Get(ctx, ids[1])
	require.ErrorContains(t, err, `sealed with key "k1", which is not in the keyring (k2)`)
	sg, err = clientWith(nil).Get(ctx, ids[1])
	require.NoError(t, err, "a process without keys (an admin tool) reads the sagas")
	require.True(t, strings.HasPrefix(string(sg.Input), `"idemsaga:sealed:`), "with their data sealed: %s", sg.Input)
	require.NotContains(t, string(sg.Results["open"]), "MARKER")

	// The retention archive keeps them as kept: sealed.
	execSQL(t, pool, `update idemsaga.sagas set finished_at = finished_at - interval '30 days'`)
	dir := t.TempDir()
	var archived int64
	for pass := 0; pass < 3 && archived < 2*n; pass++ {
		// (A child is kept while its parent is: it goes a pass later.)
		res, err := archiveCleaner(t, pool, dir, 0).CleanOnce(ctx)
		require.NoError(t, err)
		archived += res.Archived
	}
	require.Equal(t, int64(2*n), archived, "every saga, parents and children")
	_, lines := readArchives(t, dir)
	require.Len(t, lines, 2*n)
	for _, l := range lines {
		b, err := json.Marshal(l)
		require.NoError(t, err)
		require.NotContains(t, string(b), "MARKER", "archived sealed")
	}
	require.Zero(t, countRows(t, ctx, pool, `select count(*) from idemsaga.sagas`))
}
