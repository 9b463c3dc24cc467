package saga_test

import (
	"context"
	"encoding/json"
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

type payment struct {
	From   int64  `json:"from"`
	To     int64  `json:"to"`
	Amount int64  `json:"amount"`
	Note   string `json:"note,omitempty"`
}

func (p payment) validate() error {
	if p.Amount <= 0 {
		return errors.New("amount must be positive")
	}
	return nil
}

func inputDefinition(t *testing.T) (untyped, typed *saga.Definition) {
	t.Helper()
	untyped = saga.MustNew("pay", saga.Step{Name: "pay", Reaches: "paid", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }})
	return untyped, saga.WithInput(untyped, payment.validate)
}

func TestInputRefusesSmuggledMembers(t *testing.T) {
	t.Parallel()
	untyped, typed := inputDefinition(t)
	for _, tc := range []struct {
		name, body, want string
		defs             []*saga.Definition
	}{
		{"duplicate member", `{"from":1,"to":2,"amount":5,"amount":7000}`, "appears twice", []*saga.Definition{untyped, typed}},
		{"nested duplicate", `{"a":{"b":1,"b":2}}`, "appears twice", []*saga.Definition{untyped}},
		{"case twin", `{"from":1,"to":2,"amount":5,"AMOUNT":7000}`, "differ only in case", []*saga.Definition{untyped}},
		{"case twin of a field", `{"from":1,"to":2,"amount":5,"AMOUNT":7000}`, "not a field", []*saga.Definition{typed}},
		{"field in another case", `{"from":1,"to":2,"Amount":7000}`, "not a field", []*saga.Definition{typed}},
		{"unknown member", `{"from":1,"to":2,"amount":5,"admin":true}`, "not a field", []*saga.Definition{typed}},
		{"validator", `{"from":1,"to":2,"amount":0}`, "amount must be positive", []*saga.Definition{typed}},
		{"wrong type", `{"from":1,"to":2,"amount":"5"}`, "cannot be", []*saga.Definition{typed}},
		{"not JSON", `{"from":1,`, "not valid JSON", []*saga.Definition{untyped, typed}},
		{"trailing data", `{"from":1} {}`, "not valid JSON", []*saga.Definition{untyped, typed}},
	} {
		for _, d := range tc.defs {
			_, err := d.Input([]byte(tc.body))
			require.ErrorIs(t, err, saga.ErrInvalidInput, "%s (%s)", tc.name, d.InputType())
			require.ErrorContains(t, err, tc.want, "%s (%s)", tc.name, d.InputType())
			var ie *saga.InputError
			require.ErrorAs(t, err, &ie)
			require.Equal(t, "pay", ie.Definition)
		}
	}
}

func TestInputIsCanonical(t *testing.T) {
	t.Parallel()
	untyped, typed := inputDefinition(t)
	a, err := typed.Input([]byte(`{ "to":2, "amount":5, "from":1 }`))
	require.NoError(t, err)
	b, err := typed.Input(payment{From: 1, To: 2, Amount: 5})
	require.NoError(t, err)
	require.JSONEq(t, `{"amount":5,"from":1,"to":2}`, string(a))
	require.Equal(t, string(a), string(b), "the same intent as bytes and as a value must hash the same")
	require.Equal(t, `{"amount":5,"from":1,"to":2}`, string(a))

	c, err := untyped.Input(map[string]any{"z": 1, "a": []any{2, 3}})
	require.NoError(t, err)
	require.Equal(t, `{"a":[2,3],"z":1}`, string(c))
	_, err = typed.Input(payment{From: 1, To: 2})
	require.ErrorContains(t, err, "amount must be positive", "a Go value is validated too")
}

func TestCheckKey(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"T-1", "order 42", "a", "~!@#"} {
		require.NoError(t, saga.CheckKey(ok), ok)
	}
	long := make([]byte, saga.MaxKeyLength+1)
	for i := range long {
		long[i] = 'k'
	}
	for _, bad := range []string{"", " T-1", "T-1 ", "T-\t1", "clé", "a\nb", string(long)} {
		require.ErrorIs(t, saga.CheckKey(bad), saga.ErrInvalidKey, "%q", bad)
	}
	require.NoError(t, saga.CheckKey(string(long[:saga.MaxKeyLength])))
}

func TestDescriptionRoundTrip(t *testing.T) {
	t.Parallel()
	_, typed := inputDefinition(t)
	desc := typed.Describe()
	require.Equal(t, "saga_test.payment", desc.Input)
	raw, err := json.Marshal(desc)
	require.NoError(t, err)
	var back saga.Description
	require.NoError(t, json.Unmarshal(raw, &back))
	rebuilt, err := saga.FromDescription(back)
	require.NoError(t, err)
	require.False(t, rebuilt.Runnable())
	require.True(t, typed.Runnable())
	require.Equal(t, desc.Fingerprint(), rebuilt.Describe().Fingerprint())
	_, err = rebuilt.Step(0).Forward(context.Background(), &saga.StepContext{Definition: "pay"})
	require.ErrorContains(t, err, "not in this process")
}

// TestInputThroughADescription: a definition rebuilt from its
// description (a process without the code) refuses what the typed one
// refuses by name, keeps numbers as written, and stores the same bytes
// for the same request, so a retry through either entry is one saga.
func TestInputThroughADescription(t *testing.T) {
	t.Parallel()
	_, typed := inputDefinition(t)
	rebuilt, err := saga.FromDescription(typed.Describe())
	require.NoError(t, err)
	require.Equal(t, []string{"amount", "from", "note", "to"}, typed.Describe().InputFields)
	for _, body := range []string{`{"from":1,"to":2,"AMOUNT":5}`, `{"from":1,"to":2,"amount":5,"admin":true}`, `[1,2]`} {
		_, err := rebuilt.Input([]byte(body))
		require.ErrorIs(t, err, saga.ErrInvalidInput, body)
	}
	for _, body := range []string{`{"from":1,"to":2,"amount":9007199254740993}`, `{ "to":2, "amount":5, "from":1 }`} {
		a, err := typed.Input([]byte(body))
		require.NoError(t, err, body)
		b, err := rebuilt.Input([]byte(body))
		require.NoError(t, err, body)
		require.Equal(t, string(a), string(b), "one request, one stored form")
	}
	big, err := rebuilt.Input([]byte(`{"from":1,"to":2,"amount":9007199254740993}`))
	require.NoError(t, err)
	require.Contains(t, string(big), "9007199254740993", "numbers kept as written")
}

type address struct {
	Street string `json:"street"`
	Zip    string `json:"zip,omitzero"`
}

type line struct {
	SKU string `json:"sku"`
	Qty int    `json:"qty"`
}

type shipment struct {
	ID      string   `json:"id"`
	Express bool     `json:"express,omitempty"`
	Gift    *string  `json:"gift"`
	To      address  `json:"to"`
	Back    *address `json:"back"`
	Lines   []line   `json:"lines"`
	address          // embedded: its members are the shipment's
}

// TestInputRequiresItsMembers: a member the type requires must be
// present, at any depth (a nested object, a pointer to one when sent, the
// objects of an array, an embedded struct's members); omitempty,
// omitzero and pointers mark the optional ones. The refusal names every
// missing member.
func TestInputRequiresItsMembers(t *testing.T) {
	t.Parallel()
	_, typed := inputDefinition(t)
	_, err := typed.Input([]byte(`{"from":3,"amount":1}`))
	require.ErrorIs(t, err, saga.ErrInvalidInput)
	require.ErrorContains(t, err, "member /to is missing")
	_, err = typed.Input([]byte(`{"amount":1}`))
	require.ErrorContains(t, err, "members /from, /to are missing")
	_, err = typed.Input([]byte(`{"from":3,"to":4,"amount":1}`))
	require.NoError(t, err, "note is omitempty: optional")

	def := saga.WithInput(saga.MustNew("ship", saga.Step{Name: "s", Reaches: "shipped", Kind: saga.DatabaseStep,
		Forward: func(context.Context, *saga.StepContext) (json.RawMessage, error) { return nil, nil }}), func(shipment) error { return nil })
	full := `{"id":"s1","to":{"street":"Main"},"lines":[{"sku":"a","qty":1}],"street":"Side"}`
	_, err = def.Input([]byte(full))
	require.NoError(t, err, "express, gift, back and zip are optional")
	for body, want := range map[string]string{
		`{"id":"s1","to":{},"lines":[],"street":"Side"}`:                                            "member /to/street is missing",
		`{"id":"s1","to":{"street":"M"},"back":{"zip":"1"},"lines":[],"street":"Side"}`:             "member /back/street is missing",
		`{"id":"s1","to":{"street":"M"},"lines":[{"sku":"a","qty":1},{"sku":"b"}],"street":"Side"}`: "member /lines/1/qty is missing",
		`{"id":"s1","to":{"street":"M"},"lines":[]}`:                                                "member /street is missing",
		`{}`: "members /id, /lines, /street, /to are missing",
	} {
		_, err := def.Input([]byte(body))
		require.ErrorIs(t, err, saga.ErrInvalidInput, body)
		require.ErrorContains(t, err, want, body)
		require.ErrorContains(t, err, "omitempty or omitzero, or it is a pointer", body)
	}
	// A Go value of the type has every member.
	_, err = def.Input(shipment{ID: "s2"})
	require.NoError(t, err)
}
