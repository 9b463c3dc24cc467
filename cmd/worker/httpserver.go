package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

type route struct {
	pattern string
	handler http.Handler
}

// opsServer serves /metrics, /healthz and /readyz, and whatever else is
// mounted on its mux.
type opsServer struct {
	srv  *http.Server
	ln   net.Listener
	mux  *http.ServeMux
	done chan error
}

// newOpsServer listens on addr (port 0 picks a free one) and serves the
// registry's metrics plus the Go and process collectors.
// Routes in extra (pattern → handler) are served too.
func newOpsServer(addr string, reg *prometheus.Registry, ready func(context.Context) error, log *slog.Logger, extra ...route) (*opsServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --http-addr %s: %w (pick a free port, or 0 for any)", addr, err)
	}
	if err := reg.Register(collectors.NewGoCollector()); err != nil {
		_ = ln.Close()
		return nil, err
	}
	if err := reg.Register(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})); err != nil {
		_ = ln.Close()
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		defer cancel()
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		if err := ready(ctx); err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "not ready: %v\n", err)
			return
		}
		_, _ = w.Write([]byte("ready\n"))
	})
	for _, r := range extra {
		mux.Handle(r.pattern, r.handler)
	}
	s := &opsServer{ln: ln, mux: mux, done: make(chan error, 1),
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, ReadTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}}
	go func() {
		err := s.srv.Serve(ln)
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
		s.done <- err
	}()
	log.Info("serving /metrics, /healthz and /readyz", "addr", "http://"+ln.Addr().String())
	return s, nil
}

// Addr returns the address the server listens on.
func (s *opsServer) Addr() string { return s.ln.Addr().String() }

// Shutdown stops accepting and waits for requests in flight.
func (s *opsServer) Shutdown(ctx context.Context) error {
	err := s.srv.Shutdown(ctx)
	if serveErr := <-s.done; err == nil {
		err = serveErr
	}
	return err
}
