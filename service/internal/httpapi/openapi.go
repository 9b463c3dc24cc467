package httpapi

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"reflect"
	"regexp"
	"strings"

	"github.com/google/uuid"
	"github.com/invopop/jsonschema"
)

// opDoc is what the OpenAPI document says of a route.
type opDoc struct {
	summary string
	// request is the JSON Schema of the body, nil for none.
	request map[string]any
	// response is a value of the success body's type (its schema is
	// reflected), nil for a body the document does not describe.
	response any
	status   int
	// key says the request needs an Idempotency-Key.
	key bool
	// query names the query parameters.
	query []string
}

// obj is a JSON object schema of the members given as name, schema pairs.
func obj(pairs ...any) map[string]any {
	props := map[string]any{}
	for i := 0; i+1 < len(pairs); i += 2 {
		props[pairs[i].(string)] = pairs[i+1]
	}
	return map[string]any{"type": "object", "properties": props, "additionalProperties": false}
}

func str(description string) map[string]any {
	s := map[string]any{"type": "string"}
	if description != "" {
		s["description"] = description
	}
	return s
}

var pathParam = regexp.MustCompile(`\{([a-z]+)\}`)

// openAPI builds the OpenAPI 3.1 document of the routes: each route's
// operation, its parameters, its body and its answers, the bodies'
// schemas reflected from their Go types.
func openAPI(routes []route) ([]byte, error) {
	r := &jsonschema.Reflector{AllowAdditionalProperties: true, Mapper: func(t reflect.Type) *jsonschema.Schema {
		if t == reflect.TypeFor[uuid.UUID]() {
			return &jsonschema.Schema{Type: "string", Format: "uuid"}
		}
		return nil
	}}
	schemas := map[string]any{}
	ref := func(v any) (map[string]any, error) {
		s := r.Reflect(v)
		b, err := json.Marshal(s)
		if err != nil {
			return nil, err
		}
		b = bytes.ReplaceAll(b, []byte(`#/$defs/`), []byte(`#/components/schemas/`))
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			return nil, err
		}
		if defs, ok := m["$defs"].(map[string]any); ok {
			for name, d := range defs {
				schemas[name] = d
			}
		}
		delete(m, "$defs")
		delete(m, "$schema")
		delete(m, "$id")
		return m, nil
	}
	problem, err := ref(Problem{})
	if err != nil {
		return nil, err
	}
	paths := map[string]map[string]any{}
	for _, rt := range routes {
		method, path, _ := strings.Cut(rt.pattern, " ")
		op := map[string]any{
			"operationId": operationID(method, path),
			"summary":     rt.doc.summary,
		}
		var params []any
		for _, m := range pathParam.FindAllStringSubmatch(path, -1) {
			schema := map[string]any{"type": "string"}
			if m[1] == "id" {
				schema["format"] = "uuid"
			}
			params = append(params, map[string]any{"name": m[1], "in": "path", "required": true, "schema": schema})
		}
		for _, q := range rt.doc.query {
			params = append(params, map[string]any{"name": q, "in": "query", "required": false, "schema": map[string]any{"type": "string"}})
		}
		if rt.doc.key {
			params = append(params, map[string]any{"name": "Idempotency-Key", "in": "header", "required": true,
				"description": "The request's key: the same key again is the same request, answered from its record.", "schema": map[string]any{"type": "string"}})
		}
		if params != nil {
			op["parameters"] = params
		}
		if rt.doc.request != nil {
			op["requestBody"] = map[string]any{"required": method == http.MethodPost && strings.HasPrefix(path, "/v1/sagas/{definition}"),
				"content": map[string]any{"application/json": map[string]any{"schema": rt.doc.request}}}
		}
		ok := map[string]any{"description": http.StatusText(rt.doc.status)}
		if rt.doc.response != nil {
			schema, err := ref(rt.doc.response)
			if err != nil {
				return nil, err
			}
			ok["content"] = map[string]any{"application/json": map[string]any{"schema": schema}}
		} else {
			ok["content"] = map[string]any{"application/json": map[string]any{"schema": map[string]any{"type": "object"}}}
		}
		op["responses"] = map[string]any{
			fmt.Sprint(rt.doc.status): ok,
			"default": map[string]any{"description": "A refusal or a failure, as a problem (RFC 9457).",
				"content": map[string]any{ProblemContentType: map[string]any{"schema": problem}}},
		}
		if paths[path] == nil {
			paths[path] = map[string]any{}
		}
		paths[path][strings.ToLower(method)] = op
	}
	doc := map[string]any{
		"openapi": "3.1.0",
		"info": map[string]any{"title": "idemsaga HTTP API", "version": "1",
			"description": "Start, read and repair sagas. Every write takes an Idempotency-Key; every refusal is a problem body (application/problem+json)."},
		"paths":      paths,
		"components": map[string]any{"schemas": schemas, "securitySchemes": map[string]any{"bearer": map[string]any{"type": "http", "scheme": "bearer"}}},
		"security":   []any{map[string]any{"bearer": []any{}}},
	}
	return json.MarshalIndent(doc, "", "  ")
}

// operationID names an operation after its method and path:
// POST /v1/sagas/{id}/cancel is postSagasIdCancel.
func operationID(method, path string) string {
	var b strings.Builder
	b.WriteString(strings.ToLower(method))
	for _, part := range strings.FieldsFunc(strings.TrimPrefix(path, "/v1"), func(r rune) bool { return r == '/' || r == '{' || r == '}' || r == '-' || r == '.' }) {
		b.WriteString(strings.ToUpper(part[:1]) + part[1:])
	}
	return b.String()
}

// openAPIDocument handles GET /v1/openapi.json.
func (a *api) openAPIDocument(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, a.document)
}
