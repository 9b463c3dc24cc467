package pgschema_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/internal/pgschema"
)

// TestSQL: the engine's objects are named in the deployment's schema,
// in regclass literals too; nothing else changes, and the default schema
// leaves statements as written.
func TestSQL(t *testing.T) {
	t.Parallel()
	s, err := pgschema.New("tenant_a")
	require.NoError(t, err)
	for in, want := range map[string]string{
		`select idemsaga.now(), x from idemsaga.sagas s join idemsaga.steps st on true`: `select tenant_a.now(), x from tenant_a.sagas s join tenant_a.steps st on true`,
		`select 'idemsaga.outbox'::regclass`:                                            `select 'tenant_a.outbox'::regclass`,
		`select my_idemsaga.t, xidemsaga.u, idemsaga_x.v`:                               `select my_idemsaga.t, xidemsaga.u, idemsaga_x.v`,
		`select 'idemsaga: invariant broken'`:                                           `select 'idemsaga: invariant broken'`,
	} {
		require.Equal(t, want, s.SQL(in))
		require.Equal(t, want, s.SQL(in), "again, from the cache")
		require.Equal(t, want, s.SQL(s.SQL(in)), "rewriting twice changes nothing more")
	}
	def, err := pgschema.New("")
	require.NoError(t, err)
	require.Equal(t, pgschema.SchemaDefault, def.Name())
	q := `select 1 from idemsaga.sagas`
	require.Equal(t, q, def.SQL(q))
	var none *pgschema.Schema
	require.Equal(t, q, none.SQL(q))
}

// TestCheck: a schema name is a lower-case identifier that needs no
// quoting and is not one of PostgreSQL's own.
func TestCheck(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{"", "idemsaga", "tenant_a", "_x", "a1"} {
		require.NoError(t, pgschema.Check(ok), ok)
	}
	for _, bad := range []string{"Tenant", "a-b", "1a", "public", "pg_temp", "information_schema", "a.b", "a b", `a"b`, string(make([]byte, 64))} {
		require.Error(t, pgschema.Check(bad), bad)
		_, err := pgschema.New(bad)
		require.Error(t, err, bad)
	}
}
