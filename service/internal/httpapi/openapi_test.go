package httpapi_test

import (
	"encoding/json"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/service/internal/httpapi"
)

// TestOpenAPIDocumentsEveryRoute: GET /v1/openapi.json is an OpenAPI 3.1
// document whose operations are exactly the routes the server has (a
// route missing from it, or documented and not served, fails), each with
// its path parameters and a success and a problem answer, and every
// schema it refers to is in it.
func TestOpenAPIDocumentsEveryRoute(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	r := e.do(t, http.MethodGet, "/v1/openapi.json", nil, "")
	require.Equal(t, http.StatusOK, r.status, "body: %s", r.body)
	var doc struct {
		OpenAPI    string                               `json:"openapi"`
		Paths      map[string]map[string]map[string]any `json:"paths"`
		Components struct {
			Schemas map[string]any `json:"schemas"`
		} `json:"components"`
	}
	require.NoError(t, json.Unmarshal(r.body, &doc))
	require.Equal(t, "3.1.0", doc.OpenAPI)

	var documented, served []string
	param := regexp.MustCompile(`\{([a-z]+)\}`)
	for path, ops := range doc.Paths {
		for method, op := range ops {
			documented = append(documented, strings.ToUpper(method)+" "+path)
			for _, m := range param.FindAllStringSubmatch(path, -1) {
				require.Contains(t, string(mustJSON(t, op["parameters"])), `"name":"`+m[1]+`"`, "%s %s declares {%s}", method, path, m[1])
			}
			responses, _ := op["responses"].(map[string]any)
			require.Contains(t, responses, "default", "%s %s answers problems", method, path)
			require.Len(t, responses, 2, "%s %s: a success and the problems", method, path)
			// The route is served: a request to it is not the router's
			// 404 or 405.
			concrete := param.ReplaceAllString(path, "00000000-0000-0000-0000-000000000000")
			got := e.do(t, strings.ToUpper(method), concrete, startHeaders("doc-"+method+path), `{}`)
			if got.status == http.StatusNotFound || got.status == http.StatusMethodNotAllowed {
				require.NotContains(t, []string{httpapi.ProblemMethodNotAllowed}, got.problem(t).Type, "%s %s is documented and not served", method, path)
				require.NotContains(t, got.problem(t).Detail, "no route has the path", "%s %s is documented and not served", method, path)
			}
		}
	}
	served = append(served, httpapi.Patterns()...)
	slices.Sort(documented)
	slices.Sort(served)
	require.Equal(t, served, documented, "every route documented, and nothing else")

	for _, ref := range regexp.MustCompile(`"#/components/schemas/([^"]+)"`).FindAllStringSubmatch(string(r.body), -1) {
		require.Contains(t, doc.Components.Schemas, ref[1], "the schema %s is referred to and defined", ref[1])
	}
	require.Contains(t, doc.Components.Schemas, "Saga")
	require.Contains(t, doc.Components.Schemas, "Problem")
	require.NotContains(t, doc.Components.Schemas, "UUID", "a saga ID is a string, not 16 numbers")
	require.Contains(t, string(r.body), `"format": "uuid"`)
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	return b
}
