package httpapi

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
)

// MinTokenLength is the shortest API token ParseTokens accepts.
const MinTokenLength = 16

// Tokens is a set of API bearer tokens. It keeps only their SHA-256
// digests, so that comparing one of fixed length in constant time says
// nothing of a token's length or content.
type Tokens struct {
	digests [][sha256.Size]byte
}

// ParseTokens reads one token per line. Lines that are blank or whose
// first non-blank character is '#' are ignored; the whitespace around a
// token is not part of it. A token is at least MinTokenLength characters
// of printable ASCII without spaces. Errors name the line, never its text,
// and text without any token is an error.
func ParseTokens(text string) (*Tokens, error) {
	t := &Tokens{}
	seen := map[[sha256.Size]byte]bool{}
	for i, line := range strings.Split(text, "\n") {
		tok := strings.TrimSpace(line)
		if tok == "" || tok[0] == '#' {
			continue
		}
		if len(tok) < MinTokenLength {
			return nil, fmt.Errorf("httpapi: API tokens: line %d: the token is %d characters, under the minimum of %d; make one with `openssl rand -hex 32`", i+1, len(tok), MinTokenLength)
		}
		for j := 0; j < len(tok); j++ {
			if tok[j] <= 0x20 || tok[j] > 0x7e {
				return nil, fmt.Errorf("httpapi: API tokens: line %d: character %d of the token is not printable ASCII or is a space; use letters, digits and punctuation only", i+1, j+1)
			}
		}
		d := sha256.Sum256([]byte(tok))
		if !seen[d] {
			seen[d] = true
			t.digests = append(t.digests, d)
		}
	}
	if len(t.digests) == 0 {
		return nil, errors.New("httpapi: API tokens: no token found (blank and '#' lines only); write one token per line")
	}
	return t, nil
}

// LoadTokens reads the file at path with ParseTokens. Its errors name the
// path, never the file's contents.
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

// valid reports whether tok is one of the tokens, comparing against every
// one of them in constant time.
func (t *Tokens) valid(tok string) bool {
	d := sha256.Sum256([]byte(tok))
	match := 0
	for i := range t.digests {
		match |= subtle.ConstantTimeCompare(d[:], t.digests[i][:])
	}
	return match == 1
}

// Require serves next only for requests with exactly one header
// `Authorization: Bearer <token>` naming one of the tokens. Any other
// request gets 401 with `WWW-Authenticate: Bearer` and a problem body,
// and nothing of it (path, body) is handled. An empty Tokens refuses
// every request.
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
		if t.Len() == 0 || !t.valid(tok) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idemsaga", error="invalid_token"`)
			WriteProblem(w, http.StatusUnauthorized, ProblemUnauthorized, "Unauthorized",
				"the bearer token is not one of the server's API tokens; check the token you were given")
			return
		}
		next.ServeHTTP(w, r)
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
