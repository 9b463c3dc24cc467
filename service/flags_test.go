package service

import (
	"context"
	"errors"
	"fmt"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

func closedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	require.NoError(t, ln.Close())
	return port
}

// TestOpenDBNamesEveryHost: with a multi-host DATABASE_URL the error
// names every server tried, not only the first.
func TestOpenDBNamesEveryHost(t *testing.T) {
	t.Parallel()
	p1, p2 := closedPort(t), closedPort(t)
	url := fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/app?sslmode=disable&target_session_attrs=read-write", p1, p2)
	_, err := (&Flags{DatabaseURL: url}).OpenDB(context.Background(), 1)
	require.ErrorContains(t, err, fmt.Sprintf("cannot reach PostgreSQL at 127.0.0.1:%d, 127.0.0.1:%d", p1, p2))
}

// TestDBErrorSaysNoServerAcceptsWrites: every host reachable but none a
// primary (target_session_attrs=read-write during a failover).
func TestDBErrorSaysNoServerAcceptsWrites(t *testing.T) {
	t.Parallel()
	cfg, err := pgx.ParseConfig("postgres://postgres@10.0.0.1:5432,10.0.0.2:5433/app?sslmode=disable&target_session_attrs=read-write")
	require.NoError(t, err)
	err = dbError(cfg, errors.New("failed to connect: 10.0.0.1:5432: ValidateConnect failed: read only connection"))
	require.ErrorContains(t, err, "no server of 10.0.0.1:5432, 10.0.0.2:5433 accepts writes")
	require.ErrorContains(t, err, "promote a replica")
}
