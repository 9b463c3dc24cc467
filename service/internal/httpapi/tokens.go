package httpapi

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"os"
	"regexp"
	"slices"
	"strings"

	"github.com/google/uuid"

	"github.com/idemsaga/idemsaga/saga"
)

// MinTokenLength is the shortest API token ParseTokens accepts.
const MinTokenLength = 16

// Scope is what a token may do. Each scope includes the ones before it.
type Scope int

const (
	// ScopeRead reads sagas, definitions, schedules, figures and the
	// OpenAPI document, without the sagas' data: inputs, results and
	// message bodies are redacted.
	ScopeRead Scope = iota + 1
	// ScopeStart also starts sagas, issues submit tokens and answers
	// callback steps: a web tier's or another system's token.
	ScopeStart
	// ScopeOperator also repairs sagas and pauses definitions and
	// schedules: an on-call operator's token.
	ScopeOperator
)

var scopeNames = map[string]Scope{"read": ScopeRead, "start": ScopeStart, "operator": ScopeOperator}

func (s Scope) String() string {
	for n, v := range scopeNames {
		if v == s {
			return n
		}
	}
	return fmt.Sprintf("Scope(%d)", int(s))
}

// Token is who a bearer token is: the name repairs are recorded under,
// its scope, and the definitions it covers.
type Token struct {
	// Name names the token's holder (a person, a service); repairs made
	// with it are recorded as by "http:<Name>".
	Name string
	// Scope is what the token may do.
	Scope Scope
	// Definitions are the definitions whose sagas it may read and change;
	// nil for every definition.
	Definitions []string
}

// covers reports whether t may read and change sagas of definition.
func (t *Token) covers(definition string) bool {
	return t == nil || t.Definitions == nil || slices.Contains(t.Definitions, definition)
}

// Tokens is a set of API bearer tokens. It keeps only their SHA-256
// digests, so that comparing one of fixed length in constant time says
// nothing of a token's length or content.
type Tokens struct {
	digests [][sha256.Size]byte
	who     []Token
}

var tokenName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$`)

// ParseTokens reads one token per line, in one of two forms:
//
//	<token>
//	<name> <scope> <definitions> <token>
//
// A bare token has scope operator over every definition, and is named
// "token-" and the first 8 hex digits of its SHA-256 (so two holders of
// bare tokens are still told apart). In the long form, name is letters,
// digits and ". _ @ -"; scope is read, start or operator; definitions is
// "*" for every definition or names separated by commas. Fields are
// separated by spaces or tabs. Lines that are blank or whose first
// non-blank character is '#' are ignored. A token is at least
// MinTokenLength characters of printable ASCII without spaces; a token
// on two lines is an error, unless both lines are that bare token. Errors
// name the line, never its token, and text without any token is an
// error.
func ParseTokens(text string) (*Tokens, error) {
	t := &Tokens{}
	seen := map[[sha256.Size]byte]bool{}
	names := map[string]int{}
	for i, line := range strings.Split(text, "\n") {
		fields := strings.Fields(line)
		if len(fields) == 0 || fields[0][0] == '#' {
			continue
		}
		where := fmt.Sprintf("httpapi: API tokens: line %d", i+1)
		var who Token
		var tok string
		switch len(fields) {
		case 1:
			tok = fields[0]
			d := sha256.Sum256([]byte(tok))
			who = Token{Name: "token-" + hex.EncodeToString(d[:4]), Scope: ScopeOperator}
		case 4:
			tok = fields[3]
			if !tokenName.MatchString(fields[0]) {
				return nil, fmt.Errorf("%s: the name %q is not 1 to 64 letters, digits, '.', '_', '@' or '-' (starting with a letter or digit)", where, fields[0])
			}
			scope, ok := scopeNames[fields[1]]
			if !ok {
				return nil, fmt.Errorf("%s: the scope %q is not read, start or operator", where, fields[1])
			}
			who = Token{Name: fields[0], Scope: scope}
			if fields[2] != "*" {
				for _, d := range strings.Split(fields[2], ",") {
					if d == "" {
						return nil, fmt.Errorf("%s: the definitions %q have an empty name; give names separated by single commas, or * for every definition", where, fields[2])
					}
					if !slices.Contains(who.Definitions, d) {
						who.Definitions = append(who.Definitions, d)
					}
				}
			}
		default:
			return nil, fmt.Errorf("httpapi: API tokens: line %d has %d fields; write a token alone, or: <name> <scope> <definitions> <token> (for example: alice operator * <token>)", i+1, len(fields))
		}
		if len(tok) < MinTokenLength {
			return nil, fmt.Errorf("%s: the token is %d characters, under the minimum of %d; make one with `openssl rand -hex 32`", where, len(tok), MinTokenLength)
		}
		for j := 0; j < len(tok); j++ {
			if tok[j] <= 0x20 || tok[j] > 0x7e {
				return nil, fmt.Errorf("%s: character %d of the token is not printable ASCII; use letters, digits and punctuation only", where, j+1)
			}
		}
		d := sha256.Sum256([]byte(tok))
		if seen[d] && len(fields) == 1 && slices.ContainsFunc(t.who, func(w Token) bool { return w.Name == who.Name }) {
			continue // a bare token written twice
		}
		if first, ok := names[who.Name]; ok {
			return nil, fmt.Errorf("%s: the name %q is the name of line %d's token too; give each token its own name, so that repairs say who made them", where, who.Name, first)
		}
		if seen[d] {
			return nil, fmt.Errorf("%s: the token is on an earlier line too; give each holder a token of their own", where)
		}
		seen[d], names[who.Name] = true, i+1
		t.digests = append(t.digests, d)
		t.who = append(t.who, who)
	}
	if len(t.digests) == 0 {
		return nil, errors.New("httpapi: API tokens: no token found (blank and '#' lines only); write one token per line")
	}
	return t, nil
}

// LoadTokens reads the file at path with ParseTokens. Its errors name the
// path, never the file's tokens.
func LoadTokens(path string) (*Tokens, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cannot read the API tokens file %s (%v): create it with one bearer token per line, each at least 16 characters (for example `openssl rand -hex 24 > %s`), or point --api-tokens-file at it", path, errors.Unwrap(err), path)
	}
	t, err := ParseTokens(string(b))
	if err != nil {
		return nil, fmt.Errorf("%s (file %s)", err, path)
	}
	return t, nil
}

// Len returns the number of distinct tokens; 0 for a nil Tokens.
func (t *Tokens) Len() int {
	if t == nil {
		return 0
	}
	return len(t.digests)
}

// find returns who tok is, comparing against every token in constant
// time; nil when it is none of them.
func (t *Tokens) find(tok string) *Token {
	d := sha256.Sum256([]byte(tok))
	found := -1
	for i := range t.digests {
		if subtle.ConstantTimeCompare(d[:], t.digests[i][:]) == 1 {
			found = i
		}
	}
	if found < 0 {
		return nil
	}
	return &t.who[found]
}

type callerKey struct{}

// caller is who made r: the token Require found, nil when the API has no
// tokens.
func caller(r *http.Request) *Token {
	who, _ := r.Context().Value(callerKey{}).(*Token)
	return who
}

// Require serves next only for requests with exactly one header
// `Authorization: Bearer <token>` naming one of the tokens, whatever its
// scope; the API's routes then check the scope. Any other request gets
// 401 with `WWW-Authenticate: Bearer` and a problem body, and nothing of
// it (path, body) is handled. An empty Tokens refuses every request.
func (t *Tokens) Require(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		values := r.Header.Values("Authorization")
		tok, ok := "", false
		if len(values) == 1 {
			tok, ok = bearer(values[0])
		}
		if !ok {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idemsaga"`)
			WriteProblem(w, http.StatusUnauthorized, ProblemUnauthorized, "Unauthorized",
				"send one header Authorization: Bearer <token> with one of the server's API tokens")
			return
		}
		var who *Token
		if t.Len() > 0 {
			who = t.find(tok)
		}
		if who == nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idemsaga", error="invalid_token"`)
			WriteProblem(w, http.StatusUnauthorized, ProblemUnauthorized, "Unauthorized",
				"the bearer token is not one of the server's API tokens; check the token you were given")
			return
		}
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), callerKey{}, who)))
	})
}

// bearer returns the token of an Authorization value of the Bearer scheme
// (compared case-insensitively, RFC 9110 section 11.1).
func bearer(v string) (string, bool) {
	scheme, tok, ok := strings.Cut(v, " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return "", false
	}
	tok = strings.TrimLeft(tok, " ")
	return tok, tok != ""
}

// author is what a repair made by r is recorded as by: "http:<name>" for
// a named token, "http" without tokens.
func author(r *http.Request) string {
	if who := caller(r); who != nil {
		return "http:" + who.Name
	}
	return "http"
}

// permits answers 403 and reports false when r's token's scope is below
// need.
func permits(w http.ResponseWriter, r *http.Request, need Scope) bool {
	who := caller(r)
	if who == nil || who.Scope >= need {
		return true
	}
	writeProblem(w, newProblem(http.StatusForbidden, ProblemForbidden, "Forbidden",
		fmt.Sprintf("the token %q has scope %s, and %s %s needs %s; nothing was done: use a token with scope %s (the tokens file gives each its scope)",
			who.Name, who.Scope, r.Method, r.URL.Path, need, need)))
	return false
}

// covers answers 403 and reports false when r's token does not cover
// definition.
func covers(w http.ResponseWriter, r *http.Request, definition string) bool {
	who := caller(r)
	if who.covers(definition) {
		return true
	}
	writeProblem(w, newProblem(http.StatusForbidden, ProblemForbidden, "Forbidden",
		fmt.Sprintf("the token %q covers the definitions %s only, and this request is about %q; nothing was done: use a token that covers it",
			who.Name, strings.Join(who.Definitions, ", "), definition)))
	return false
}

// coversFilter is covers for a filter by definition: a token that covers
// some definitions only must name one of them.
func coversFilter(w http.ResponseWriter, r *http.Request, definition string) bool {
	if who := caller(r); definition == "" && who != nil && who.Definitions != nil {
		writeProblem(w, newProblem(http.StatusForbidden, ProblemForbidden, "Forbidden",
			fmt.Sprintf("the token %q covers the definitions %s only; nothing was done: filter by one of them (definition=…)",
				who.Name, strings.Join(who.Definitions, ", "))))
		return false
	}
	return covers(w, r, definition)
}

// coversSaga is covers for the saga id; a saga that does not exist is
// left to the route to answer.
func (a *api) coversSaga(w http.ResponseWriter, r *http.Request, id uuid.UUID) bool {
	if who := caller(r); who == nil || who.Definitions == nil {
		return true
	}
	ctx, cancel := a.readContext(r)
	defer cancel()
	sg, err := a.cfg.Client.Get(ctx, id)
	switch {
	case errors.Is(err, saga.ErrNotFound):
		return true
	case err != nil:
		a.internal(w, r, "read the saga", "retry later", err, "id", id)
		return false
	}
	return covers(w, r, sg.Definition)
}

// seesPayloads reports whether r's token may read sagas' data (inputs,
// results, message bodies): scope start or operator, or no tokens at all.
// A read token sees what happened, not what it carried.
func seesPayloads(r *http.Request) bool {
	who := caller(r)
	return who == nil || who.Scope >= ScopeStart
}

// Caller is who the request's bearer token is (GET /v1/whoami).
type Caller struct {
	// Authenticated is false when the API has no tokens (a loopback
	// server): every request may do everything, recorded as by "http".
	Authenticated bool `json:"authenticated"`
	// Name is the token's name; repairs made with it are recorded as by
	// "http:" and the name.
	Name string `json:"name"`
	// Scope is read, start or operator.
	Scope string `json:"scope"`
	// Definitions are the definitions the token covers; null for all.
	Definitions []string `json:"definitions"`
	// SeesPayloads is false for a read token: sagas' data is redacted.
	SeesPayloads bool `json:"sees_payloads"`
}

// whoami handles GET /v1/whoami.
func (a *api) whoami(w http.ResponseWriter, r *http.Request) {
	who := caller(r)
	out := Caller{Scope: ScopeOperator.String(), SeesPayloads: true}
	if who != nil {
		out = Caller{Authenticated: true, Name: who.Name, Scope: who.Scope.String(), Definitions: who.Definitions, SeesPayloads: seesPayloads(r)}
	}
	a.encode(w, r, http.StatusOK, out)
}
