package wire_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/wire"
	"github.com/idemsaga/idemsaga/saga"
)

var sagaID = uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d")

func validCommand() wire.Command {
	return wire.Command{
		SagaID:     sagaID,
		Definition: "transfer",
		Step:       "credit",
		Phase:      saga.PhaseCompensate,
		Key:        saga.StepKey(sagaID, "credit", saga.PhaseCompensate),
		Attempt:    3,
		// The version a worker must run to take the command.
		DefinitionVersion: 2,
		Input:             json.RawMessage(`{"amount":12345678901234567890,"from":"a"}`),
		Results:           map[string]json.RawMessage{"debit": json.RawMessage(`{"id":"d-1"}`)},
	}
}

func validReply() wire.Reply {
	return wire.Reply{
		SagaID:           sagaID,
		Definition:       "transfer",
		Step:             "debit",
		Phase:            saga.PhaseForward,
		Key:              saga.StepKey(sagaID, "debit", saga.PhaseForward),
		Attempt:          2,
		Outcome:          wire.OutcomeRetry,
		Result:           json.RawMessage(`{"id":"d-1"}`),
		Error:            "timeout",
		RetryAfterMillis: 1500,
		Duplicate:        true,
	}
}

// mutate marshals v, applies edit to its JSON object and returns the bytes.
func mutate(t *testing.T, v any, edit func(m map[string]any)) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	edit(m)
	b, err = json.Marshal(m)
	require.NoError(t, err)
	return b
}

func TestCommandRoundTrip(t *testing.T) {
	t.Parallel()
	for _, c := range []wire.Command{
		validCommand(),
		{
			SagaID:     sagaID,
			Definition: "transfer",
			Step:       "debit",
			Phase:      saga.PhaseForward,
			Key:        saga.StepKey(sagaID, "debit", saga.PhaseForward),
			Attempt:    1,
			Input:      json.RawMessage(`null`),
		},
	} {
		b, err := json.Marshal(c)
		require.NoError(t, err)
		got, err := wire.DecodeCommand(b)
		require.NoError(t, err)
		require.Equal(t, c, got)
	}

	// A forward command carries no forward key.
	fwd := validCommand()
	fwd.Phase, fwd.Key = saga.PhaseForward, saga.StepKey(sagaID, "credit", saga.PhaseForward)
	b, err := json.Marshal(fwd)
	require.NoError(t, err)
	require.NotContains(t, string(b), "forward_key")
	require.NotContains(t, string(b), "results\":null")
}

func TestReplyRoundTrip(t *testing.T) {
	t.Parallel()
	for _, outcome := range []wire.Outcome{wire.OutcomeSucceeded, wire.OutcomeFailed, wire.OutcomeRetry, wire.OutcomeUnknown} {
		r := validReply()
		r.Outcome = outcome
		b, err := json.Marshal(r)
		require.NoError(t, err)
		got, err := wire.DecodeReply(b)
		require.NoError(t, err)
		require.Equal(t, r, got)
	}

	minimal := wire.Reply{
		SagaID:     sagaID,
		Definition: "transfer",
		Step:       "credit",
		Phase:      saga.PhaseCompensate,
		Key:        saga.StepKey(sagaID, "credit", saga.PhaseCompensate),
		Attempt:    1,
		Outcome:    wire.OutcomeSucceeded,
	}
	b, err := json.Marshal(minimal)
	require.NoError(t, err)
	for _, field := range []string{"result", "error", "retry_after_ms", "duplicate"} {
		require.NotContains(t, string(b), `"`+field+`"`)
	}
	got, err := wire.DecodeReply(b)
	require.NoError(t, err)
	require.Equal(t, minimal, got)
}

func TestDecodeCommandRejects(t *testing.T) {
	t.Parallel()
	other := uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9e")
	tests := []struct {
		name string
		edit func(m map[string]any)
		want string
	}{
		{"missing saga_id", func(m map[string]any) { delete(m, "saga_id") }, "missing or invalid field"},
		{"nil saga_id", func(m map[string]any) { m["saga_id"] = uuid.Nil.String() }, "missing or invalid field"},
		{"missing definition", func(m map[string]any) { delete(m, "definition") }, "missing or invalid field"},
		{"missing step", func(m map[string]any) { delete(m, "step") }, "missing or invalid field"},
		{"missing phase", func(m map[string]any) { delete(m, "phase") }, "missing or invalid field"},
		{"invalid phase", func(m map[string]any) { m["phase"] = "backward" }, "missing or invalid field"},
		{"phase in capitals", func(m map[string]any) { m["phase"] = "COMPENSATE" }, "missing or invalid field"},
		{"missing key", func(m map[string]any) { delete(m, "key") }, "missing or invalid field"},
		{"missing attempt", func(m map[string]any) { delete(m, "attempt") }, "missing or invalid field"},
		{"attempt 0", func(m map[string]any) { m["attempt"] = 0 }, "missing or invalid field"},
		{"negative attempt", func(m map[string]any) { m["attempt"] = -1 }, "missing or invalid field"},
		{"fractional attempt", func(m map[string]any) { m["attempt"] = 1.5 }, "decode command"},
		{"malformed saga_id", func(m map[string]any) { m["saga_id"] = "not-a-uuid" }, "decode command"},
		{"key of the other phase", func(m map[string]any) {
			m["key"] = saga.StepKey(sagaID, "credit", saga.PhaseForward).String()
		}, "does not match"},
		{"key of another step", func(m map[string]any) {
			m["key"] = saga.StepKey(sagaID, "debit", saga.PhaseCompensate).String()
		}, "does not match"},
		{"key of another saga", func(m map[string]any) {
			m["key"] = saga.StepKey(other, "credit", saga.PhaseCompensate).String()
		}, "does not match"},
		{"phase changed under the key", func(m map[string]any) { m["phase"] = "forward" }, "does not match"},
		{"step changed under the key", func(m map[string]any) { m["step"] = "debit" }, "does not match"},
		{"random key", func(m map[string]any) { m["key"] = uuid.NewString() }, "does not match"},
		{"negative definition version", func(m map[string]any) { m["definition_version"] = -1 }, "missing or invalid field"},
		{"fractional definition version", func(m map[string]any) { m["definition_version"] = 1.5 }, "decode command"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := wire.DecodeCommand(mutate(t, validCommand(), tt.edit))
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.want)
		})
	}

	for _, b := range []string{``, `null`, `[]`, `{`, `"command"`, `{}`} {
		_, err := wire.DecodeCommand([]byte(b))
		require.Error(t, err, "%q", b)
	}

	long := validCommand()
	long.Attempt = 0
	long.Input = json.RawMessage(`"` + strings.Repeat("x", 1000) + `"`)
	b, err := json.Marshal(long)
	require.NoError(t, err)
	_, err = wire.DecodeCommand(b)
	require.Error(t, err)
	require.Less(t, len(err.Error()), 400, "the offending message is truncated in the error")
}

func TestDecodeReplyRejects(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		edit func(m map[string]any)
		want string
	}{
		{"missing saga_id", func(m map[string]any) { delete(m, "saga_id") }, "missing or invalid field"},
		{"missing definition", func(m map[string]any) { delete(m, "definition") }, "missing or invalid field"},
		{"missing step", func(m map[string]any) { delete(m, "step") }, "missing or invalid field"},
		{"invalid phase", func(m map[string]any) { m["phase"] = "sideways" }, "missing or invalid field"},
		{"missing key", func(m map[string]any) { delete(m, "key") }, "missing or invalid field"},
		{"attempt 0", func(m map[string]any) { m["attempt"] = 0 }, "missing or invalid field"},
		{"missing outcome", func(m map[string]any) { delete(m, "outcome") }, "unknown outcome"},
		{"unknown outcome", func(m map[string]any) { m["outcome"] = "maybe" }, "unknown outcome"},
		{"outcome in capitals", func(m map[string]any) { m["outcome"] = "SUCCEEDED" }, "unknown outcome"},
		{"key of the other phase", func(m map[string]any) {
			m["key"] = saga.StepKey(sagaID, "debit", saga.PhaseCompensate).String()
		}, "does not match"},
		{"step changed under the key", func(m map[string]any) { m["step"] = "credit" }, "does not match"},
		{"malformed retry_after_ms", func(m map[string]any) { m["retry_after_ms"] = "soon" }, "decode reply"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := wire.DecodeReply(mutate(t, validReply(), tt.edit))
			require.Error(t, err)
			require.Contains(t, err.Error(), tt.want)
		})
	}

	for _, b := range []string{``, `null`, `{}`, `{"outcome":"succeeded"}`} {
		_, err := wire.DecodeReply([]byte(b))
		require.Error(t, err, "%q", b)
	}
}

func TestSubjects(t *testing.T) {
	t.Parallel()
	s := wire.Subjects{Prefix: "idemsaga"}
	require.Equal(t, "idemsaga.cmd.transfer.debit", s.Command("transfer", "debit"))
	require.Equal(t, "idemsaga.reply.transfer", s.Reply("transfer"))
	require.Equal(t, "idemsaga.cmd.>", s.AllCommands())
	require.Equal(t, "idemsaga.reply.>", s.AllReplies())
	require.Equal(t, "idemsaga.>", s.All())
}

func FuzzDecodeCommand(f *testing.F) {
	for _, c := range []wire.Command{validCommand(), {SagaID: sagaID, Definition: "d", Step: "s", Phase: saga.PhaseForward, Key: saga.StepKey(sagaID, "s", saga.PhaseForward), Attempt: 1}} {
		b, err := json.Marshal(c)
		require.NoError(f, err)
		f.Add(b)
	}
	f.Add([]byte(`{"saga_id":"0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d","definition":"d","step":"s","phase":"forward","key":"00000000-0000-0000-0000-000000000001","attempt":1}`))
	f.Add([]byte(`{"attempt":0}`))
	f.Add([]byte(`null`))
	f.Add([]byte(`{"phase":"compensate","results":{"a":null}}`))
	f.Add([]byte{})

	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := wire.DecodeCommand(b)
		if err != nil {
			return
		}
		require.NotEqual(t, uuid.Nil, c.SagaID)
		require.NotEmpty(t, c.Definition)
		require.NotEmpty(t, c.Step)
		require.True(t, c.Phase.Valid())
		require.GreaterOrEqual(t, c.Attempt, 1)
		require.Equal(t, saga.StepKey(c.SagaID, c.Step, c.Phase), c.Key)

		// What was accepted survives a round trip.
		again, err := json.Marshal(c)
		require.NoError(t, err)
		c2, err := wire.DecodeCommand(again)
		require.NoError(t, err)
		require.Equal(t, c.Key, c2.Key)
		require.Equal(t, c.Step, c2.Step)
		require.Equal(t, c.Attempt, c2.Attempt)
	})
}

// TestDefinitionVersion: a command that carries no version is of version
// 1; a reply carries its command's version.
func TestDefinitionVersion(t *testing.T) {
	t.Parallel()
	c := validCommand()
	require.Equal(t, 2, c.DefVersion())
	c.DefinitionVersion = 0
	b, err := json.Marshal(c)
	require.NoError(t, err)
	require.NotContains(t, string(b), "definition_version")
	got, err := wire.DecodeCommand(b)
	require.NoError(t, err)
	require.Equal(t, 1, got.DefVersion())

	r := validReply()
	r.DefinitionVersion = 3
	b, err = json.Marshal(r)
	require.NoError(t, err)
	back, err := wire.DecodeReply(b)
	require.NoError(t, err)
	require.Equal(t, 3, back.DefinitionVersion)
	_, err = wire.DecodeReply(mutate(t, r, func(m map[string]any) { m["definition_version"] = -2 }))
	require.ErrorContains(t, err, "missing or invalid field")
}
