package saga_test

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/idemsaga/idemsaga/saga"
)

func TestStepKey(t *testing.T) {
	t.Parallel()
	sagaA := uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d")
	sagaB := uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9e")

	k := saga.StepKey(sagaA, "reserve", saga.PhaseForward)
	require.Equal(t, uuid.Version(5), k.Version())
	require.Equal(t, uuid.RFC4122, k.Variant())
	require.Equal(t, uuid.NewSHA1(saga.KeyNamespace, []byte(sagaA.String()+"\x00reserve\x00forward")), k)

	// Deterministic.
	require.Equal(t, k, saga.StepKey(sagaA, "reserve", saga.PhaseForward))

	// Differs by saga, step and phase.
	keys := map[uuid.UUID]string{}
	for _, id := range []uuid.UUID{sagaA, sagaB} {
		for _, s := range []string{"reserve", "charge", "reserv", "reservee"} {
			for _, p := range []saga.Phase{saga.PhaseForward, saga.PhaseCompensate} {
				key := saga.StepKey(id, s, p)
				name := id.String() + "/" + s + "/" + string(p)
				other, dup := keys[key]
				require.False(t, dup, "%s and %s share key %s", name, other, key)
				keys[key] = name
			}
		}
	}
	require.Len(t, keys, 16)
}

// TestKeyNamespaceIsPinned guards against changing the namespace, which
// would give every in-flight step a new key.
func TestKeyNamespaceIsPinned(t *testing.T) {
	t.Parallel()
	require.Equal(t, "6b1f3c1e-2f0a-5d8e-9c4b-7a5e1d2c3b4a", saga.KeyNamespace.String())
	id := uuid.MustParse("00000000-0000-0000-0000-000000000001")
	require.Equal(t,
		uuid.NewSHA1(uuid.MustParse("6b1f3c1e-2f0a-5d8e-9c4b-7a5e1d2c3b4a"), []byte(id.String()+"\x00a\x00compensate")),
		saga.StepKey(id, "a", saga.PhaseCompensate))
}

func FuzzStepKey(f *testing.F) {
	f.Add([]byte("0190c2a47f3e7b1a"), "reserve", true, "charge", false)
	f.Add([]byte("0190c2a47f3e7b1a"), "reserve", true, "reserve", false)
	f.Add([]byte{}, "", true, "", false)
	f.Add([]byte{1}, "a\x00forward", false, "a", true)
	f.Add([]byte{2}, "a\x00", true, "a", true)
	f.Add([]byte{3}, "é", false, "\xff", false)

	f.Fuzz(func(t *testing.T, seed []byte, step1 string, fwd1 bool, step2 string, fwd2 bool) {
		var id uuid.UUID
		copy(id[:], seed)
		phase := func(fwd bool) saga.Phase {
			if fwd {
				return saga.PhaseForward
			}
			return saga.PhaseCompensate
		}
		p1, p2 := phase(fwd1), phase(fwd2)

		k1 := saga.StepKey(id, step1, p1)
		require.Equal(t, uuid.NewSHA1(saga.KeyNamespace, []byte(id.String()+"\x00"+step1+"\x00"+string(p1))), k1,
			"the key must stay UUIDv5 of the saga ID's text, step and phase: keys in flight depend on it")
		require.Equal(t, k1, saga.StepKey(id, step1, p1), "not deterministic")
		require.Equal(t, uuid.Version(5), k1.Version())

		k2 := saga.StepKey(id, step2, p2)
		if step1 != step2 || p1 != p2 {
			require.NotEqual(t, k1, k2, "(%q, %s) and (%q, %s) collide", step1, p1, step2, p2)
		} else {
			require.Equal(t, k1, k2)
		}
	})
}

func TestMessageID(t *testing.T) {
	t.Parallel()
	key := saga.StepKey(uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d"), "charge", saga.PhaseForward)

	require.Equal(t, key.String()+"-1", saga.MessageID(key, 1))
	require.Equal(t, saga.MessageID(key, 1), saga.MessageID(key, 1), "stable across calls")

	seen := map[string]bool{}
	for attempt := 1; attempt <= 20; attempt++ {
		id := saga.MessageID(key, attempt)
		require.False(t, seen[id], "attempt %d reuses message id %s", attempt, id)
		seen[id] = true
	}

	other := saga.StepKey(uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d"), "charge", saga.PhaseCompensate)
	require.NotEqual(t, saga.MessageID(key, 1), saga.MessageID(other, 1))
}

// TestStepKeyAllocatesNothing: the engine derives several keys per step.
func TestStepKeyAllocatesNothing(t *testing.T) {
	id := uuid.MustParse("0190c2a4-7f3e-7b1a-9c2d-4e5f6a7b8c9d")
	allocs := testing.AllocsPerRun(100, func() { _ = saga.StepKey(id, "reserve", saga.PhaseForward) })
	require.Zero(t, allocs)
}
