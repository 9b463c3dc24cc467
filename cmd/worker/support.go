package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/idemsaga/idemsaga/service"
)

// newLogger logs to stderr at level, as text or JSON.
func newLogger(level string, format ...string) *slog.Logger {
	var l slog.Level
	_ = l.UnmarshalText([]byte(level))
	opts := &slog.HandlerOptions{Level: l}
	if len(format) > 0 && format[0] == "json" {
		return slog.New(slog.NewJSONHandler(os.Stderr, opts))
	}
	return slog.New(slog.NewTextHandler(os.Stderr, opts))
}

// openDB opens a pool on url as the runtime does, for the harnesses'
// own databases.
func openDB(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	return (&service.Flags{DatabaseURL: url}).OpenDB(ctx, maxConns)
}

// connectNATS connects to url as the runtime does.
func connectNATS(url, name string) (*nats.Conn, error) {
	return (&service.Flags{NATSURL: url}).ConnectNATS(name)
}
