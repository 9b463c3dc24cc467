package saga

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"sort"
	"strings"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
	jsonv1 "github.com/go-json-experiment/json/v1"
)

// ErrInvalidInput wraps every refusal of a saga input: JSON that is not
// valid, that names a member twice or in two spellings, that does not fit
// the definition's input type, or that its validator refuses. Nothing is
// written for such an input.
var ErrInvalidInput = errors.New("idemsaga: invalid saga input")

// InputError is a refused saga input: what is wrong, for the definition
// that refused it. It wraps ErrInvalidInput.
type InputError struct {
	Definition string
	Problem    string
}

func (e *InputError) Error() string {
	return fmt.Sprintf("idemsaga: invalid input for saga %q: %s", e.Definition, e.Problem)
}

func (e *InputError) Unwrap() error { return ErrInvalidInput }

// inputType is the declared input of a definition: its Go type and its
// validator.
type inputType struct {
	typ reflect.Type
	// fields are the JSON names of a struct type's members, nil for
	// another type.
	fields []string
	// members says which members the input must have, at every depth;
	// nil when none is required.
	members  *shape
	decode   func(raw []byte) (any, error)
	validate func(v any) error
}

// WithInput returns a copy of d whose saga input is of type In (usually a
// struct), checked by validate (nil for none). Every start of a saga of
// the copy decodes its input strictly into In: a member that In does not
// have, a member named twice, or one whose name differs from a field's
// only in case is refused; so is an object that lacks a member its struct
// requires, at any depth. Every field is required unless its json tag
// says omitempty or omitzero, or it is a pointer: a member left out is
// then read as the field's zero value (nil for a pointer), which the
// handler can tell apart. Then validate runs. The stored input, which
// handlers decode, is the checked JSON in canonical form (an In value
// given to Start is encoded first). The type's member names go into the
// definition's Description, so a process without its code refuses other
// members too.
//
//	def := saga.WithInput(saga.MustNew("order", steps...), OrderInput.Validate)
func WithInput[In any](d *Definition, validate func(In) error) *Definition {
	c := *d
	c.input = &inputType{
		typ:     reflect.TypeFor[In](),
		fields:  jsonFields(reflect.TypeFor[In]()),
		members: shapeOf(reflect.TypeFor[In](), 0),
		decode: func(raw []byte) (any, error) {
			var v In
			err := jsonv2.Unmarshal(raw, &v, strictTyped)
			return v, err
		},
	}
	if validate != nil {
		c.input.validate = func(v any) error { return validate(v.(In)) }
	}
	return &c
}

// strictTyped is encoding/json's semantics without its leniencies: names
// match exactly, each at most once, and every member must be a field.
var strictTyped = jsonv2.JoinOptions(
	jsonv1.DefaultOptionsV1(),
	jsonv2.MatchCaseInsensitiveNames(false),
	jsonv1.MatchCaseSensitiveDelimiter(true),
	jsontext.AllowDuplicateNames(false),
	jsontext.AllowInvalidUTF8(false),
	jsonv2.RejectUnknownMembers(true),
	jsonv1.ReportErrorsWithLegacySemantics(false),
)

// forHandlers is encoding/json's semantics with names matched exactly,
// for what handlers decode: the stored input, already checked.
var forHandlers = jsonv2.JoinOptions(
	jsonv1.DefaultOptionsV1(),
	jsonv2.MatchCaseInsensitiveNames(false),
	jsonv1.MatchCaseSensitiveDelimiter(true),
	jsontext.AllowDuplicateNames(false),
)

// strictAny reads JSON of no declared type: each name at most once.
var strictAny = jsonv2.JoinOptions(
	jsonv1.DefaultOptionsV1(),
	jsontext.AllowDuplicateNames(false),
	jsontext.AllowInvalidUTF8(false),
	jsonv1.ReportErrorsWithLegacySemantics(false),
)

// InputType returns the name of the definition's input type, "" when it
// accepts any JSON value.
func (d *Definition) InputType() string {
	if d.input == nil {
		return d.inputName
	}
	return d.input.typ.String()
}

// Input checks a saga input and returns it as canonical JSON (object keys
// sorted, no insignificant whitespace), the form the engine stores and
// hashes. v is raw JSON ([]byte or json.RawMessage) or any Go value,
// which is encoded first.
//
// Raw JSON is read strictly: a name twice in one object, or two names in
// one object that differ only in case, is refused, since a gateway that
// reads the first and a decoder that keeps the last would see different
// inputs. With an input type (WithInput) the input must also decode into
// it exactly and pass its validator. Every refusal wraps ErrInvalidInput.
func (d *Definition) Input(v any) (json.RawMessage, error) {
	bad := func(format string, args ...any) error {
		return &InputError{Definition: d.name, Problem: fmt.Sprintf(format, args...)}
	}
	var raw []byte
	switch x := v.(type) {
	case json.RawMessage:
		raw = x
	case []byte:
		raw = x
	default:
		if d.input != nil && v != nil && reflect.TypeOf(v) == d.input.typ {
			return d.checked(v)
		}
		b, err := json.Marshal(v)
		if err != nil {
			return nil, bad("cannot encode it as JSON: %v", err)
		}
		raw = b
	}
	if d.input != nil {
		typed, err := d.input.decode(raw)
		if err != nil {
			return nil, bad("%s", describeDecodeError(err, d.input.typ))
		}
		if d.input.members != nil {
			var tree any
			if err := jsonv2.Unmarshal(raw, &tree, strictAny); err != nil {
				return nil, bad("%s", describeDecodeError(err, nil))
			}
			if missing := d.input.members.missing(tree, "", nil); len(missing) > 0 {
				what := "member " + missing[0] + " is"
				if len(missing) > 1 {
					what = "members " + strings.Join(missing, ", ") + " are"
				}
				return nil, bad("%s missing; send it, or mark the field optional: every field of %s is required unless its json tag says omitempty or omitzero, or it is a pointer", what, d.input.typ)
			}
		}
		if _, err := d.checked(typed); err != nil {
			return nil, err
		}
		// What was sent, in canonical form, not the value encoded again:
		// the same request hashes the same through a process that has
		// only the definition's description.
		return canonical(d.name, raw)
	}
	var tree any
	if err := jsonv2.Unmarshal(raw, &tree, strictAny); err != nil {
		return nil, bad("%s", describeDecodeError(err, nil))
	}
	if path, a, b, ok := caseTwins(tree, "$"); ok {
		return nil, bad("object %s has members %q and %q, which differ only in case; send one", path, a, b)
	}
	if d.inputFields != nil {
		obj, ok := tree.(map[string]any)
		if !ok {
			return nil, bad("it must be a JSON object with the members %s", strings.Join(d.inputFields, ", "))
		}
		for k := range obj {
			if !slices.Contains(d.inputFields, k) {
				return nil, bad("member /%s is not one of %s (names are matched exactly, case included)", k, strings.Join(d.inputFields, ", "))
			}
		}
	}
	return canonical(d.name, raw)
}

// canonical is CanonicalInput of already checked JSON: numbers kept as
// written.
func canonical(definition string, raw []byte) (json.RawMessage, error) {
	out, err := CanonicalInput(json.RawMessage(raw))
	if err != nil {
		return nil, &InputError{Definition: definition, Problem: err.Error()}
	}
	return out, nil
}

// jsonFields returns the JSON member names encoding/json gives a struct
// type's fields (embedded structs inlined), nil for another type.
func jsonFields(t reflect.Type) []string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return nil
	}
	names := []string{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if tag == "-" {
			continue
		}
		if f.Anonymous && tag == "" {
			ft := f.Type
			for ft.Kind() == reflect.Pointer {
				ft = ft.Elem()
			}
			if ft.Kind() == reflect.Struct {
				names = append(names, jsonFields(ft)...)
				continue
			}
		}
		if !f.IsExported() {
			continue
		}
		if tag == "" {
			tag = f.Name
		}
		names = append(names, tag)
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// checked validates a value of the input type and encodes it.
func (d *Definition) checked(v any) (json.RawMessage, error) {
	if d.input.validate != nil {
		if err := d.input.validate(v); err != nil {
			return nil, &InputError{Definition: d.name, Problem: err.Error()}
		}
	}
	b, err := json.Marshal(v)
	if err != nil {
		return nil, &InputError{Definition: d.name, Problem: fmt.Sprintf("cannot encode it as JSON: %v", err)}
	}
	// Re-read through a tree so that map keys and numbers come out in
	// the one canonical form.
	var tree any
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	if err := dec.Decode(&tree); err != nil {
		return nil, &InputError{Definition: d.name, Problem: fmt.Sprintf("cannot encode it as JSON: %v", err)}
	}
	return json.Marshal(tree)
}

// caseTwins finds, anywhere in tree, an object with two member names that
// are equal under Unicode case folding.
func caseTwins(tree any, path string) (where, a, b string, found bool) {
	switch x := tree.(type) {
	case map[string]any:
		names := make([]string, 0, len(x))
		for k := range x {
			names = append(names, k)
		}
		sort.Strings(names)
		seen := make(map[string]string, len(names))
		for _, k := range names {
			f := strings.ToLower(k)
			if other, ok := seen[f]; ok {
				return path, other, k, true
			}
			seen[f] = k
		}
		for _, k := range names {
			if w, a, b, ok := caseTwins(x[k], path+"."+k); ok {
				return w, a, b, ok
			}
		}
	case []any:
		for i, e := range x {
			if w, a, b, ok := caseTwins(e, fmt.Sprintf("%s[%d]", path, i)); ok {
				return w, a, b, ok
			}
		}
	}
	return "", "", "", false
}

// describeDecodeError turns a decoding error into one sentence that names
// the member at fault.
func describeDecodeError(err error, typ reflect.Type) string {
	var se *jsonv2.SemanticError
	var syn *jsontext.SyntacticError
	switch {
	case errors.As(err, &syn):
		if errors.Is(syn.Err, jsontext.ErrDuplicateName) {
			return fmt.Sprintf("member %s appears twice; send each member once", syn.JSONPointer)
		}
		return fmt.Sprintf("not valid JSON: %v", syn.Err)
	case errors.As(err, &se):
		where := string(se.JSONPointer)
		if where == "" {
			where = "/"
		}
		if errors.Is(se.Err, jsonv2.ErrUnknownName) {
			if typ != nil {
				return fmt.Sprintf("member %s is not a field of %s (names are matched exactly, case included)", where, typ)
			}
			return fmt.Sprintf("member %s is unknown", where)
		}
		if se.GoType != nil && se.JSONKind != 0 {
			return fmt.Sprintf("member %s: a JSON %s cannot be a %s", where, se.JSONKind, se.GoType)
		}
		if se.Err != nil {
			return fmt.Sprintf("member %s: %v", where, se.Err)
		}
	}
	return err.Error()
}

// shape is what a struct input type requires of a JSON object: its
// required members, and the shapes of members that hold structs.
type shape struct {
	required []string
	// sub holds the shape of a member that is a struct (or a pointer to
	// one), elem that of a member that is a slice or array of them.
	sub, elem map[string]*shape
}

// shapeDepthMax bounds the types shapeOf looks into: a recursive type
// is checked that deep.
const shapeDepthMax = 8

// shapeOf returns what struct type t requires, nil when it requires
// nothing at any depth (or is no struct).
func shapeOf(t reflect.Type, depth int) *shape {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct || depth > shapeDepthMax {
		return nil
	}
	s := &shape{}
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("json")
		name, opts, _ := strings.Cut(tag, ",")
		if name == "-" && opts == "" {
			continue
		}
		ft := f.Type
		if f.Anonymous && name == "" {
			// An embedded struct's members are the outer object's.
			if inner := shapeOf(ft, depth+1); inner != nil {
				s.required = append(s.required, inner.required...)
				s.sub, s.elem = merge(s.sub, inner.sub), merge(s.elem, inner.elem)
			}
			continue
		}
		if !f.IsExported() {
			continue
		}
		if name == "" {
			name = f.Name
		}
		optional := ft.Kind() == reflect.Pointer
		for _, o := range strings.Split(opts, ",") {
			optional = optional || o == "omitempty" || o == "omitzero"
		}
		if !optional {
			s.required = append(s.required, name)
		}
		if sub := shapeOf(ft, depth+1); sub != nil {
			s.sub = merge(s.sub, map[string]*shape{name: sub})
		}
		if ft.Kind() == reflect.Slice || ft.Kind() == reflect.Array {
			if el := shapeOf(ft.Elem(), depth+1); el != nil {
				s.elem = merge(s.elem, map[string]*shape{name: el})
			}
		}
	}
	if len(s.required) == 0 && len(s.sub) == 0 && len(s.elem) == 0 {
		return nil
	}
	slices.Sort(s.required)
	return s
}

func merge(a, b map[string]*shape) map[string]*shape {
	if len(b) == 0 {
		return a
	}
	if a == nil {
		a = map[string]*shape{}
	}
	for k, v := range b {
		a[k] = v
	}
	return a
}

// missing appends to out the JSON pointers of the members tree, the
// value at path, lacks. A value that is not an object is left to the
// typed decoding, which already refused what cannot be the struct.
func (s *shape) missing(tree any, path string, out []string) []string {
	obj, ok := tree.(map[string]any)
	if !ok {
		return out
	}
	for _, name := range s.required {
		if _, ok := obj[name]; !ok {
			out = append(out, path+"/"+name)
		}
	}
	for name, sub := range s.sub {
		if v, ok := obj[name]; ok {
			out = sub.missing(v, path+"/"+name, out)
		}
	}
	for name, el := range s.elem {
		if arr, ok := obj[name].([]any); ok {
			for i, v := range arr {
				out = el.missing(v, fmt.Sprintf("%s/%s/%d", path, name, i), out)
			}
		}
	}
	slices.Sort(out)
	return out
}
