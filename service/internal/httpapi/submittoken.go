package httpapi

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/idemsaga/idemsaga/engine"
	"github.com/idemsaga/idemsaga/saga"
)

// SubmitToken is the body of a successful POST /v1/tokens: a one-time
// Idempotency-Key for one submit of the definition (not an API bearer
// token). The first POST /v1/sagas/{definition} that carries it consumes
// it; a later one with the same body replays that answer.
type SubmitToken struct {
	// Token is the key to send as the submit's Idempotency-Key.
	Token string `json:"token"`
	// Definition is the saga definition the token starts a saga of.
	Definition string `json:"definition"`
	// ExpiresAt is when the token stops being accepted if unused.
	ExpiresAt time.Time `json:"expires_at"`
	// TTLSeconds is the time to live the token was issued with.
	TTLSeconds int64 `json:"ttl_seconds"`
}

// issueToken handles POST /v1/tokens, body {"definition": "…",
// "ttl_seconds": n} (ttl_seconds optional). Issuing needs no
// Idempotency-Key: a token sent again after a lost answer is another
// token, and the unused one expires.
func (a *api) issueToken(w http.ResponseWriter, r *http.Request) {
	if p := requireJSON(w, r.Header); p != nil {
		writeProblem(w, p)
		return
	}
	body, p := a.readBody(w, r)
	if p != nil {
		writeProblem(w, p)
		return
	}
	req, p := a.decodeTokenRequest(body)
	if p != nil {
		writeProblem(w, p)
		return
	}
	if !covers(w, r, req.definition) {
		return
	}
	ctx, cancel := a.writeContext(r)
	defer cancel()
	def, err := a.cfg.Client.Definition(ctx, req.definition)
	if errors.Is(err, saga.ErrUnknownDefinition) {
		writeProblem(w, newProblem(http.StatusNotFound, ProblemUnknownDefinition, "Unknown saga definition",
			fmt.Sprintf("no saga definition is named %q, so no token was issued; GET /v1/sagas lists the sagas there are", req.definition)))
		return
	}
	if err != nil {
		a.internal(w, r, "resolve the saga definition", "retry the request", err, "definition", req.definition)
		return
	}
	tok, err := a.cfg.Client.IssueToken(ctx, def, req.ttl)
	if err != nil {
		a.internal(w, r, "issue a submit token", "retry the request", err, "definition", def.Name())
		return
	}
	a.encode(w, r, http.StatusCreated, SubmitToken{Token: tok.Token, Definition: tok.Definition,
		ExpiresAt: tok.ExpiresAt.UTC(), TTLSeconds: int64(req.ttl / time.Second)})
}

type tokenRequest struct {
	definition string
	ttl        time.Duration
}

// decodeTokenRequest reads a POST /v1/tokens body: one JSON object with
// the string member "definition" and at most the integer member
// "ttl_seconds", each named exactly and once.
func (a *api) decodeTokenRequest(body []byte) (tokenRequest, *Problem) {
	minS, maxS := int64(engine.MinSubmitTokenTTL/time.Second), int64(a.cfg.MaxSubmitTokenTTL/time.Second)
	bad := func(detail string) (tokenRequest, *Problem) {
		return tokenRequest{}, newProblem(http.StatusBadRequest, ProblemMalformedRequest, "Invalid request body",
			fmt.Sprintf(`%s; send {"definition":"<saga definition>"}, with "ttl_seconds": %d to %d for another time to live than %d seconds`,
				detail, minS, maxS, int64(a.cfg.SubmitTokenTTL/time.Second)))
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return bad("the body is not a JSON object")
	}
	req := tokenRequest{ttl: a.cfg.SubmitTokenTTL}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return bad("the body is not valid JSON")
		}
		name, _ := tok.(string)
		if name != "definition" && name != "ttl_seconds" {
			return bad(fmt.Sprintf("member %q is unknown (names are matched exactly)", tok))
		}
		if seen[name] {
			return bad(fmt.Sprintf("member %q appears twice", name))
		}
		seen[name] = true
		if tok, err = dec.Token(); err != nil {
			return bad("the body is not valid JSON")
		}
		switch name {
		case "definition":
			s, ok := tok.(string)
			if !ok || s == "" {
				return bad(`member "definition" must be a saga definition's name`)
			}
			req.definition = s
		case "ttl_seconds":
			n, ok := tok.(json.Number)
			secs, err := n.Int64()
			if !ok || err != nil {
				return bad(`member "ttl_seconds" must be a whole number of seconds`)
			}
			if secs < minS || secs > maxS {
				return bad(fmt.Sprintf(`"ttl_seconds" is %d, outside %d to %d`, secs, minS, maxS))
			}
			req.ttl = time.Duration(secs) * time.Second
		}
	}
	if tok, err := dec.Token(); err != nil || tok != json.Delim('}') {
		return bad("the body is not valid JSON")
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return bad("the body holds more than one JSON value")
	}
	if req.definition == "" {
		return bad(`member "definition" is missing`)
	}
	return req, nil
}

// submitTokenInvalid answers a submit whose Idempotency-Key is a submit
// token that cannot start a saga of definition.
func submitTokenInvalid(definition string, err error) *Problem {
	return newProblem(http.StatusBadRequest, ProblemSubmitTokenInvalid, "Submit token not valid",
		trimPrefix(err.Error())+fmt.Sprintf(` (POST /v1/tokens with {"definition":%q} issues one)`, definition))
}
