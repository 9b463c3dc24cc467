package sagatest_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/sagatest"
)

// A saga whose second step fails twice with a minute of backoff, run to
// its end in a test: the kit skips the backoff.
func Example() {
	t := &exampleT{}
	defer t.cleanup()

	type greeting struct {
		Name string `json:"name"`
	}
	def := saga.WithInput(saga.MustNew("greet",
		saga.Step{Name: "write", Reaches: "written", Kind: saga.DatabaseStep,
			Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, in greeting) (string, error) {
				return "hello " + in.Name, nil
			})},
		saga.Step{Name: "send", Reaches: "sent", Kind: saga.ExternalStep,
			Retry: saga.RetryPolicy{InitialBackoff: time.Minute, MaxBackoff: time.Hour, Jitter: -1},
			Forward: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
				if sc.Attempt < 3 {
					return nil, saga.NotApplied(errors.New("mail server busy: nothing sent"))
				}
				return nil, nil
			}},
	), func(g greeting) error {
		if g.Name == "" {
			return errors.New("name is required")
		}
		return nil
	})

	env := sagatest.New(t, sagatest.Config{Definitions: []*saga.Definition{def}})
	sg := env.Run(t, def, "greet-ann", greeting{Name: "Ann"})
	fmt.Println(sg.State, len(sg.Attempts), "attempts")
	for _, a := range sg.Attempts {
		fmt.Println(a.Step, a.Attempt, a.Outcome)
	}
	// Output:
	// sent 4 attempts
	// write 1 succeeded
	// send 1 retry
	// send 2 retry
	// send 3 succeeded
}

// exampleT is the kit's sagatest.T outside a test function; in a test,
// pass the *testing.T.
type exampleT struct{ cleanups []func() }

func (t *exampleT) Helper()                      {}
func (t *exampleT) Cleanup(f func())             { t.cleanups = append(t.cleanups, f) }
func (t *exampleT) Errorf(f string, args ...any) { fmt.Fprintf(os.Stderr, f+"\n", args...) }
func (t *exampleT) Fatalf(f string, args ...any) { panic(fmt.Sprintf(f, args...)) }
func (t *exampleT) Fatal(args ...any)            { panic(fmt.Sprint(args...)) }
func (t *exampleT) TempDir() string {
	dir, err := os.MkdirTemp("", "sagatest")
	if err != nil {
		panic(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

func (t *exampleT) cleanup() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}
