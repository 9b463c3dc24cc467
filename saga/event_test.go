package saga_test

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func TestWithEventsRefusesInvalidEvents(t *testing.T) {
	t.Parallel()
	base := saga.MustNew("order", step("a", "a_done"))
	for _, tc := range []struct {
		name  string
		e     saga.Events
		field string
	}{
		{"no subject", saga.Events{}, "Events.Subject"},
		{"space", saga.Events{Subject: "orders created"}, "Events.Subject"},
		{"empty token", saga.Events{Subject: "orders..created"}, "Events.Subject"},
		{"wildcard not last", saga.Events{Subject: "orders.>.created"}, "Events.Subject"},
		{"header", saga.Events{Subject: "orders.created", KeyHeader: "Order Id"}, "Events.KeyHeader"},
		{"stream", saga.Events{Subject: "orders.created", Stream: "a.b"}, "Events.Stream"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			defer func() {
				err, ok := recover().(error)
				require.True(t, ok)
				var de *saga.DefinitionError
				require.True(t, errors.As(err, &de))
				require.Equal(t, tc.field, de.Field)
				require.ErrorIs(t, err, saga.ErrInvalidDefinition)
			}()
			saga.WithEvents(base, tc.e)
		})
	}
}

func TestEventsDefaultsAndDescription(t *testing.T) {
	t.Parallel()
	base := saga.MustNew("order", step("a", "a_done"))
	d := saga.WithEvents(base, saga.Events{Subject: "shop.orders.*"})
	e, ok := d.Events()
	require.True(t, ok)
	require.Equal(t, saga.EventKeyHeaderDefault, e.KeyHeader)
	_, ok = base.Events()
	require.False(t, ok, "WithEvents returns a copy")
	desc := d.Describe()
	require.Equal(t, &saga.EventsDescription{Subject: "shop.orders.*", KeyHeader: "Nats-Msg-Id"}, desc.Events)
	back, err := saga.FromDescription(desc)
	require.NoError(t, err)
	require.Equal(t, desc.Fingerprint(), back.Describe().Fingerprint())
	saga.WithEvents(base, saga.Events{Subject: "shop.>", KeyHeader: "Order-Id", Stream: "SHOP"})
}
