// Package wire defines the messages that travel between the orchestrator
// and the step workers, and the subjects they travel on.
package wire

import (
	"encoding/json"
	"fmt"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/saga"
)

// Command asks a step worker to run one attempt of one phase of a step.
type Command struct {
	SagaID     uuid.UUID                  `json:"saga_id"`
	Definition string                     `json:"definition"`
	Step       string                     `json:"step"`
	Phase      saga.Phase                 `json:"phase"`
	Key        uuid.UUID                  `json:"key"`
	Attempt    int                        `json:"attempt"`
	Input      json.RawMessage            `json:"input"`
	Results    map[string]json.RawMessage `json:"results,omitempty"`
	// State and Version are the saga's when the command was written; Input
	// and Results are the saga's at that version. A success applied in the
	// step's own transaction moves the saga on from them without reading
	// it first, fenced by the version (a saga that moved meanwhile makes it
	// read and judge instead). Commands written before they existed carry
	// neither, and are judged after a read.
	State   saga.State `json:"state,omitempty"`
	Version int64      `json:"version,omitempty"`
	// Skipped are the saga's skipped steps at that version
	// (saga.Instance.Skipped), which a compensation planned in the step
	// passes over.
	Skipped []string `json:"skipped,omitempty"`

	// DefinitionVersion is the version of the definition the saga runs
	// (0, for a command that carries none, is version 1): a worker that
	// does not run it parks the command rather than run another version's
	// step.
	DefinitionVersion int `json:"definition_version,omitempty"`

	// Verify asks for the step's Verify alone, not its forward handler:
	// the attempt after the last one, whose outcome is unknown (its
	// worker stopped during the call), asks the other system what the
	// key did before the step is given up.
	Verify bool `json:"verify,omitempty"`

	// Trace is the W3C trace context the command arrived with (its
	// message's headers), nil when it carries none. It travels in the
	// headers, never in the payload.
	Trace map[string]string `json:"-"`
}

// DefVersion returns the command's definition version, 1 when it carries
// none.
func (c Command) DefVersion() int { return max(c.DefinitionVersion, 1) }

// Outcome is what a step worker reports.
type Outcome string

// Outcomes of an attempt.
const (
	// OutcomeSucceeded: the effect committed (or was already committed
	// under this key).
	OutcomeSucceeded Outcome = "succeeded"
	// OutcomeFailed: a permanent failure; do not retry.
	OutcomeFailed Outcome = "failed"
	// OutcomeRetry: a retryable failure, known to have taken no effect.
	OutcomeRetry Outcome = "retry"
	// OutcomeUnknown: an external attempt that ended without a known
	// outcome (a timeout, a transport error): it may have taken effect.
	// It is retried as a retry is, and makes the step possibly done.
	OutcomeUnknown Outcome = "unknown"
	// OutcomeWaiting: a callback step's request was accepted; the step
	// waits for the other system's callback.
	OutcomeWaiting Outcome = "waiting"
)

// Reply reports the outcome of one attempt back to the orchestrator.
type Reply struct {
	SagaID     uuid.UUID       `json:"saga_id"`
	Definition string          `json:"definition"`
	Step       string          `json:"step"`
	Phase      saga.Phase      `json:"phase"`
	Key        uuid.UUID       `json:"key"`
	Attempt    int             `json:"attempt"`
	Outcome    Outcome         `json:"outcome"`
	Result     json.RawMessage `json:"result,omitempty"`
	Error      string          `json:"error,omitempty"`
	// RetryAfterMillis is set when the handler asked for a delay.
	RetryAfterMillis int64 `json:"retry_after_ms,omitempty"`
	// Duplicate is true when the outcome came from the inbox, not from
	// running the handler.
	Duplicate bool `json:"duplicate,omitempty"`

	// DefinitionVersion is the command's (Command.DefinitionVersion).
	DefinitionVersion int `json:"definition_version,omitempty"`

	// Trace is the W3C trace context the reply arrived with (its
	// message's headers), nil when it carries none. It travels in the
	// headers, never in the payload.
	Trace map[string]string `json:"-"`
}

// DecodeCommand parses and checks a command.
func DecodeCommand(b []byte) (Command, error) {
	var c Command
	if err := json.Unmarshal(b, &c); err != nil {
		return c, fmt.Errorf("decode command: %w", err)
	}
	if c.SagaID == uuid.Nil || c.Definition == "" || c.Step == "" || !c.Phase.Valid() || c.Key == uuid.Nil || c.Attempt < 1 || c.DefinitionVersion < 0 {
		return c, fmt.Errorf("decode command: missing or invalid field in %s", truncate(b))
	}
	if c.Key != saga.StepKey(c.SagaID, c.Step, c.Phase) {
		return c, fmt.Errorf("decode command: key %s does not match saga %s step %q phase %s", c.Key, c.SagaID, c.Step, c.Phase)
	}
	return c, nil
}

// DecodeReply parses and checks a reply.
func DecodeReply(b []byte) (Reply, error) {
	var r Reply
	if err := json.Unmarshal(b, &r); err != nil {
		return r, fmt.Errorf("decode reply: %w", err)
	}
	if r.SagaID == uuid.Nil || r.Definition == "" || r.Step == "" || !r.Phase.Valid() || r.Key == uuid.Nil || r.Attempt < 1 || r.DefinitionVersion < 0 {
		return r, fmt.Errorf("decode reply: missing or invalid field in %s", truncate(b))
	}
	switch r.Outcome {
	case OutcomeSucceeded, OutcomeFailed, OutcomeRetry, OutcomeUnknown, OutcomeWaiting:
	default:
		return r, fmt.Errorf("decode reply: unknown outcome %q", r.Outcome)
	}
	if r.Key != saga.StepKey(r.SagaID, r.Step, r.Phase) {
		return r, fmt.Errorf("decode reply: key %s does not match saga %s step %q phase %s", r.Key, r.SagaID, r.Step, r.Phase)
	}
	return r, nil
}

func truncate(b []byte) string {
	if len(b) > 200 {
		return string(b[:200]) + "…"
	}
	return string(b)
}

// Subjects names the subjects of one engine deployment.
type Subjects struct{ Prefix string }

// Command is the subject of a step's commands.
func (s Subjects) Command(definition, step string) string {
	return s.Prefix + ".cmd." + definition + "." + step
}

// Reply is the subject of a definition's replies.
func (s Subjects) Reply(definition string) string {
	return s.Prefix + ".reply." + definition
}

// Commands filters the command subjects of a definition's steps.
func (s Subjects) Commands(definition string) string { return s.Prefix + ".cmd." + definition + ".>" }

// AllCommands filters every command subject.
func (s Subjects) AllCommands() string { return s.Prefix + ".cmd.>" }

// AllReplies filters every reply subject.
func (s Subjects) AllReplies() string { return s.Prefix + ".reply.>" }

// All filters every subject of the deployment.
func (s Subjects) All() string { return s.Prefix + ".>" }
