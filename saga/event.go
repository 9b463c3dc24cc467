package saga

import (
	"fmt"
	"regexp"
	"strings"
)

// Events makes the messages of a NATS subject start sagas of a definition
// (WithEvents).
//
// The rules:
//   - Each message on Subject, read from the JetStream stream that holds
//     it by a durable consumer of the definition's own, starts one saga:
//     its key is the message's KeyHeader, its input the message's body,
//     checked by the definition's input rules (WithInput) as Start's.
//   - A message delivered again, or published again under the same key
//     with the same body, starts nothing new: it names the saga already
//     started (Start's idempotency by key).
//   - A message that cannot start a saga (no key header, a key that is
//     not valid, a body the input rules refuse, or the key of a saga
//     started with another body) is recorded with its reason in the
//     event dead letters (engine.Client.EventDeadLetters) and
//     acknowledged: it is not delivered again.
//   - A message the engine could not handle for another reason (the
//     database down) is delivered again later, and starts its saga then.
//   - The consumer is created by the first engine that runs the
//     definition, at the start of the stream: every message the stream
//     holds starts a saga, those published before that engine ran too.
type Events struct {
	// Subject is the subject whose messages start sagas; it may end in
	// a wildcard ("orders.created.>"). It must not be under the engine's
	// own subject prefix. Required.
	Subject string
	// KeyHeader names the header whose value is the saga's key.
	// Defaults to EventKeyHeaderDefault, the header of JetStream's own
	// deduplication (jetstream.WithMsgID).
	KeyHeader string
	// Stream is the JetStream stream that holds Subject's messages: the
	// publisher's, which the engine never creates or changes. Defaults to
	// the stream that captures Subject, looked up when an engine starts;
	// an engine started with no such stream fails and says so.
	Stream string
}

// EventKeyHeaderDefault is Events.KeyHeader's default: the Nats-Msg-Id
// header.
const EventKeyHeaderDefault = "Nats-Msg-Id"

var (
	headerName   = regexp.MustCompile(`^[!#$%&'*+.^_|~0-9A-Za-z-]{1,128}$`)
	subjectToken = regexp.MustCompile(`^[^\s.*>]+$`)
)

// WithEvents returns a copy of d whose sagas are started by the messages
// of e.Subject, in every engine that runs it (see Events for the rules).
// A definition has at most one Events; a later WithEvents replaces it.
// Events is part of the definition's Description. It panics with a
// *DefinitionError, as WithVersion does, on Events that are not valid.
//
//	var order = saga.WithEvents(saga.WithInput(saga.MustNew("order", steps...), OrderInput.Validate),
//		saga.Events{Subject: "shop.orders.created"})
func WithEvents(d *Definition, e Events) *Definition {
	if e.KeyHeader == "" {
		e.KeyHeader = EventKeyHeaderDefault
	}
	if field, problem := e.check(); problem != "" {
		panic(&DefinitionError{Definition: d.name, Field: field, Problem: problem})
	}
	c := *d
	c.events = &e
	return &c
}

// check returns the field that is not valid and why, or "" and "".
func (e Events) check() (field, problem string) {
	if e.Subject == "" {
		return "Events.Subject", "is empty; name the subject whose messages start sagas, such as \"shop.orders.created\""
	}
	tokens := strings.Split(e.Subject, ".")
	for i, tok := range tokens {
		switch {
		case tok == "*":
		case tok == ">" && i == len(tokens)-1:
		case !subjectToken.MatchString(tok):
			return "Events.Subject", fmt.Sprintf("%q is not a NATS subject: token %d %q must be a name without spaces, '*', or a final '>'", e.Subject, i+1, tok)
		}
	}
	if !headerName.MatchString(e.KeyHeader) {
		return "Events.KeyHeader", fmt.Sprintf("%q is not a header name; give one such as %q", e.KeyHeader, EventKeyHeaderDefault)
	}
	if e.Stream != "" && !namePattern.MatchString(e.Stream) {
		return "Events.Stream", fmt.Sprintf("%q is not a stream name: 1 to 64 letters, digits, '_' or '-'", e.Stream)
	}
	return "", ""
}

// Events returns what starts the definition's sagas from messages
// (WithEvents), with its defaults applied, and whether it has any.
func (d *Definition) Events() (Events, bool) {
	if d.events == nil {
		return Events{}, false
	}
	return *d.events, true
}

// EventsDescription is an Events in a Description.
type EventsDescription struct {
	Subject   string `json:"subject"`
	KeyHeader string `json:"key_header"`
	Stream    string `json:"stream,omitempty"`
}

// describeEvents returns the description of d's Events, nil for none.
func (d *Definition) describeEvents() *EventsDescription {
	if d.events == nil {
		return nil
	}
	return &EventsDescription{Subject: d.events.Subject, KeyHeader: d.events.KeyHeader, Stream: d.events.Stream}
}

// events rebuilds the described Events.
func (ed *EventsDescription) events(definition string) (*Events, error) {
	if ed == nil {
		return nil, nil
	}
	e := Events{Subject: ed.Subject, KeyHeader: ed.KeyHeader, Stream: ed.Stream}
	if field, problem := e.check(); problem != "" {
		return nil, fmt.Errorf("%w: description of %q: %s: %s", ErrInvalidDefinition, definition, field, problem)
	}
	return &e, nil
}
