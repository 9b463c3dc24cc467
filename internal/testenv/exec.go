package testenv

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"testing"
	"time"
)

// Result is what a command a test ran printed, and its exit status.
type Result struct {
	Stdout, Stderr string
	Code           int
}

// Exec runs bin with args and the environment plus env, for at most
// timeout, and returns what it printed; a failure to run it at all fails
// the test.
func Exec(t testing.TB, timeout time.Duration, bin string, env []string, args ...string) Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Env = append(os.Environ(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("testenv: run %s: %v", bin, err)
	}
	return Result{Stdout: out.String(), Stderr: errb.String(), Code: code}
}
