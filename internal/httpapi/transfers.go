package httpapi

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/saga"
)

// Header names of the idempotency protocol.
const (
	// KeyHeader carries the client's idempotency key
	// (draft-ietf-httpapi-idempotency-key-header), which is also the
	// saga's key.
	KeyHeader = "Idempotency-Key"
	// ReplayedHeader is set to "true" on an answer repeated from storage.
	ReplayedHeader = "Idempotent-Replayed"
)

// transferRequest is the body of POST /transfers. Pointers tell a missing
// field from a zero one.
type transferRequest struct {
	From   *int64 `json:"from"`
	To     *int64 `json:"to"`
	Amount *int64 `json:"amount"`
}

const requestShape = `{"from":<account>,"to":<account>,"amount":<positive integer>}`

// postTransfer starts a transfer saga. Every check that can refuse the
// request runs before anything is written; then the database adjudicates
// the key; then the saga start and the stored answer commit together.
func (h *handler) postTransfer(w http.ResponseWriter, r *http.Request) {
	key, p := parseKey(r.Header)
	if p != nil {
		writeProblem(w, p)
		return
	}
	if p := checkContentType(r.Header); p != nil {
		w.Header().Set("Accept", "application/json")
		writeProblem(w, p)
		return
	}
	in, p := h.decode(w, r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	if err := in.Validate(); err != nil {
		writeProblem(w, newProblem(http.StatusBadRequest, ProblemInvalidTransfer, "Invalid transfer",
			strings.TrimPrefix(err.Error(), "transfer: ")+"; nothing was started"))
		return
	}
	canonical, err := saga.CanonicalInput(in)
	if err != nil {
		h.internal(w, r, "encode the transfer", "retry with the same Idempotency-Key", err, "key", key)
		return
	}
	fingerprint := sha256.Sum256(canonical)

	// From here on the request's outcome is recorded under its key, so it
	// must not depend on the client staying connected: a retry then finds
	// the answer instead of an abandoned claim.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), h.cfg.ClaimTimeout/2)
	defer cancel()
	c, err := h.keys.claim(ctx, key, fingerprint[:])
	if err != nil {
		h.internal(w, r, "record the Idempotency-Key", "retry with the same Idempotency-Key", err, "key", key)
		return
	}
	switch c.verdict {
	case verdictReplay:
		writeAnswer(w, c.answer, true)
	case verdictMismatch:
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q was already used with a different request body; resend the original body to get its answer, or use a new key for a new transfer", key)))
	case verdictInFlight:
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(http.StatusConflict, ProblemInFlight, "Request in flight",
			fmt.Sprintf("a request with Idempotency-Key %q is still being handled; retry the same request shortly to get its answer", key)))
	default:
		if c.tookOver {
			h.cfg.Logger.WarnContext(ctx, "http api: took over an abandoned or expired Idempotency-Key claim", "key", key)
		}
		h.start(ctx, w, r, key, in, c.token)
	}
}

// start starts the saga and records the answer under the claim token holds,
// in one transaction: neither commits without the other. On any failure the
// claim is given back, so a retry is handled at once.
func (h *handler) start(ctx context.Context, w http.ResponseWriter, r *http.Request, key string, in transfer.Input, token uuid.UUID) {
	fail := func(tx interface{ Rollback(context.Context) error }, what, detail string, err error) {
		if tx != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
		if rerr := h.keys.release(ctx, key, token); rerr != nil {
			h.cfg.Logger.WarnContext(ctx, "http api: could not release an Idempotency-Key claim; it is taken over once stale",
				"key", key, "error", rerr)
		}
		if err != nil {
			h.internal(w, r, what, detail, err, "key", key)
		}
	}
	tx, err := h.cfg.Pool.Begin(ctx)
	if err != nil {
		fail(nil, "start the transfer", "retry with the same Idempotency-Key", err)
		return
	}
	res, err := h.cfg.Client.StartTx(ctx, tx, h.cfg.Definition, key, in)
	if errors.Is(err, saga.ErrIdempotencyKeyReused) {
		fail(tx, "", "", nil)
		writeProblem(w, newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			fmt.Sprintf("Idempotency-Key %q already names transfer %s, started with a different input (through another channel, such as the CLI); resend that input, or use a new key for a new transfer", key, res.ID)))
		return
	}
	if err != nil {
		fail(tx, "start the transfer", "retry with the same Idempotency-Key", err)
		return
	}

	status := http.StatusCreated
	if res.Duplicate {
		status = http.StatusOK
	}
	body, err := json.Marshal(StartAnswer{ID: res.ID, Key: key, State: res.State, Duplicate: res.Duplicate})
	if err != nil {
		fail(tx, "encode the answer", "retry with the same Idempotency-Key", err)
		return
	}
	a := answer{status: status, body: append(body, '\n'), contentType: "application/json", location: "/transfers/" + res.ID.String()}
	ok, err := h.keys.complete(ctx, tx, key, token, a)
	if err != nil {
		fail(tx, "record the answer", "retry with the same Idempotency-Key", err)
		return
	}
	if !ok {
		// Our claim went stale and a retry took it over: it answers. Roll
		// back so that only its saga start and answer can commit.
		_ = tx.Rollback(context.WithoutCancel(ctx))
		h.cfg.Logger.WarnContext(ctx, "http api: Idempotency-Key claim was taken over while handling it; raise Config.ClaimTimeout if this recurs", "key", key)
		w.Header().Set("Retry-After", "1")
		writeProblem(w, newProblem(http.StatusConflict, ProblemInFlight, "Request in flight",
			fmt.Sprintf("a retry with Idempotency-Key %q took over this request; retry the same request shortly to get its answer", key)))
		return
	}
	if err := tx.Commit(ctx); err != nil {
		// The commit may have happened. Releasing only deletes a claim
		// still unanswered, so a retry either replays or starts afresh.
		fail(nil, "commit the transfer", "its outcome is unknown; retry with the same Idempotency-Key to learn it", err)
		return
	}
	writeAnswer(w, a, false)
}

// writeAnswer writes a (stored) answer. A replay repeats the status and the
// body byte for byte.
func writeAnswer(w http.ResponseWriter, a answer, replayed bool) {
	h := w.Header()
	if a.contentType != "" {
		h.Set("Content-Type", a.contentType)
	}
	if a.location != "" {
		h.Set("Location", a.location)
	}
	if replayed {
		h.Set(ReplayedHeader, "true")
	}
	h.Set("Cache-Control", "no-store")
	h.Set("Content-Length", strconv.Itoa(len(a.body)))
	w.WriteHeader(a.status)
	_, _ = w.Write(a.body)
}

// parseKey reads the Idempotency-Key header. The draft defines its value as
// a structured-field String ("…", RFC 8941); a bare value is accepted too
// and means the same key.
func parseKey(hdr http.Header) (string, *Problem) {
	invalid := func(detail string) (string, *Problem) {
		return "", newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Invalid Idempotency-Key", detail)
	}
	values := hdr.Values(KeyHeader)
	switch {
	case len(values) == 0:
		return "", newProblem(http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key is missing",
			"POST /transfers requires an Idempotency-Key header naming this business intent, such as a transfer request number; send the same key when you retry, and a new one for a new transfer")
	case len(values) > 1:
		return invalid("send exactly one Idempotency-Key header")
	}
	v := strings.TrimSpace(values[0])
	if strings.HasPrefix(v, `"`) {
		s, ok := unquoteString(v)
		if !ok {
			return invalid(`the Idempotency-Key is not a valid quoted string; send "<key>" with only printable ASCII, escaping " and \ with \`)
		}
		v = s
	}
	switch {
	case v == "":
		return invalid("the Idempotency-Key is empty; send a key naming this business intent, such as a transfer request number")
	case len(v) > engine.MaxKeyLength:
		return invalid(fmt.Sprintf("the Idempotency-Key is %d bytes; keep it within %d", len(v), engine.MaxKeyLength))
	}
	for i := 0; i < len(v); i++ {
		if v[i] < 0x20 || v[i] > 0x7e {
			return invalid("the Idempotency-Key must be printable ASCII")
		}
	}
	return v, nil
}

// unquoteString parses a structured-field String: DQUOTE, printable ASCII
// with \" and \\ escaped, DQUOTE.
func unquoteString(v string) (string, bool) {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return "", false
	}
	var b strings.Builder
	inner := v[1 : len(v)-1]
	for i := 0; i < len(inner); i++ {
		c := inner[i]
		switch {
		case c == '\\':
			i++
			if i == len(inner) || (inner[i] != '"' && inner[i] != '\\') {
				return "", false
			}
			b.WriteByte(inner[i])
		case c == '"', c < 0x20, c > 0x7e:
			return "", false
		default:
			b.WriteByte(c)
		}
	}
	return b.String(), true
}

// checkContentType accepts application/json, in UTF-8 if a charset is
// given.
func checkContentType(hdr http.Header) *Problem {
	unsupported := func(detail string) *Problem {
		return newProblem(http.StatusUnsupportedMediaType, ProblemUnsupportedMediaType, "Unsupported media type", detail)
	}
	ct := hdr.Get("Content-Type")
	if ct == "" {
		return unsupported("send the body as JSON with Content-Type: application/json")
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil || mt != "application/json" {
		return unsupported(fmt.Sprintf("Content-Type %q is not supported; send the body as JSON with Content-Type: application/json", ct))
	}
	if cs, ok := params["charset"]; ok && !strings.EqualFold(cs, "utf-8") {
		return unsupported(fmt.Sprintf("charset %q is not supported; send JSON in UTF-8", cs))
	}
	return nil
}

// decode reads and checks the body: at most MaxBodyBytes, one JSON object,
// no unknown fields, every field present.
func (h *handler) decode(w http.ResponseWriter, r *http.Request) (transfer.Input, *Problem) {
	malformed := func(detail string) (transfer.Input, *Problem) {
		return transfer.Input{}, newProblem(http.StatusBadRequest, ProblemMalformedBody, "Malformed request body",
			detail+"; send "+requestShape)
	}
	raw, err := io.ReadAll(http.MaxBytesReader(w, r.Body, h.cfg.MaxBodyBytes))
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		return transfer.Input{}, newProblem(http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
			fmt.Sprintf("the body exceeds %d bytes; send %s", tooLarge.Limit, requestShape))
	}
	if err != nil {
		return malformed("the body could not be read: " + err.Error())
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var req transferRequest
	if err := dec.Decode(&req); err != nil {
		return malformed(describeJSONError(err))
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return malformed("the body holds more than one JSON value")
	}
	var missing []string
	if req.From == nil {
		missing = append(missing, "from")
	}
	if req.To == nil {
		missing = append(missing, "to")
	}
	if req.Amount == nil {
		missing = append(missing, "amount")
	}
	if len(missing) > 0 {
		return malformed("missing field(s): " + strings.Join(missing, ", "))
	}
	return transfer.Input{From: *req.From, To: *req.To, Amount: *req.Amount}, nil
}

// describeJSONError says what is wrong with a body in words that do not
// name Go types.
func describeJSONError(err error) string {
	var syntax *json.SyntaxError
	var typ *json.UnmarshalTypeError
	switch {
	case errors.Is(err, io.EOF):
		return "the body is empty"
	case errors.Is(err, io.ErrUnexpectedEOF):
		return "the body is truncated JSON"
	case errors.As(err, &syntax):
		return fmt.Sprintf("the body is not valid JSON (at byte %d: %s)", syntax.Offset, strings.TrimPrefix(syntax.Error(), "json: "))
	case errors.As(err, &typ) && typ.Field != "":
		return fmt.Sprintf("field %q must be an integer, not %s", typ.Field, typ.Value)
	case errors.As(err, &typ):
		return fmt.Sprintf("the body must be a JSON object, not %s", typ.Value)
	case strings.Contains(err.Error(), "unknown field"):
		return strings.TrimPrefix(err.Error(), "json: ") + " (the fields are from, to and amount)"
	}
	return strings.TrimPrefix(err.Error(), "json: ")
}
