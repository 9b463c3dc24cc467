// Package tcpproxy is a small loopback TCP proxy for chaos tests: put it
// between a client and a server (PostgreSQL, say), then Cut every open
// connection at a moment of the test's choosing, as a failed network or a
// restarted server would, while new connections keep working.
//
//	p, err := tcpproxy.New("127.0.0.1:5432")
//	// connect the pool to p.Addr() instead of the server
//	n := p.Cut() // every open connection fails; reconnects succeed
//
// It listens on 127.0.0.1 only and is meant for tests, not production.
package tcpproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// DialTimeoutDefault bounds how long the proxy waits to reach the target
// for one accepted connection.
const DialTimeoutDefault = 5 * time.Second

// Proxy forwards every connection accepted on Addr to its target.
type Proxy struct {
	target string
	ln     net.Listener
	// ctx ends when the proxy closes, cancelling dials in progress.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	pairs  map[*pair]struct{}
	closed bool

	closeOnce sync.Once
	closeErr  error
}

// pair is one proxied connection: the accepted client side and the
// dialled server side.
type pair struct {
	client, server net.Conn
	once           sync.Once
}

func (p *pair) close() {
	p.once.Do(func() {
		_ = p.client.Close()
		_ = p.server.Close()
	})
}

// New listens on a free loopback port and forwards every connection it
// accepts to target (host:port), until Close.
func New(target string) (*Proxy, error) {
	if _, _, err := net.SplitHostPort(target); err != nil {
		return nil, fmt.Errorf("tcpproxy: target %q is not host:port: %w", target, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("tcpproxy: listen on loopback: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Proxy{target: target, ln: ln, ctx: ctx, cancel: cancel, pairs: map[*pair]struct{}{}}
	p.wg.Go(p.acceptLoop)
	return p, nil
}

// Addr returns the host:port clients connect to instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Cut closes both sides of every connection open now and returns how many
// it closed. Clients see their connection end (EOF or a reset); the proxy
// keeps accepting, so a reconnect succeeds.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	cut := make([]*pair, 0, len(p.pairs))
	for c := range p.pairs {
		cut = append(cut, c)
	}
	clear(p.pairs)
	p.mu.Unlock()
	for _, c := range cut {
		c.close()
	}
	return len(cut)
}

// Close stops accepting, closes every open connection and waits for the
// proxy's goroutines to end. Calling it twice is fine.
func (p *Proxy) Close() error {
	p.closeOnce.Do(func() {
		p.mu.Lock()
		p.closed = true
		p.mu.Unlock()
		p.cancel()
		p.closeErr = p.ln.Close()
		p.Cut()
		p.wg.Wait()
	})
	return p.closeErr
}

func (p *Proxy) acceptLoop() {
	delay := 5 * time.Millisecond
	for {
		conn, err := p.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			// A transient failure (out of file descriptors, say): back off.
			select {
			case <-p.ctx.Done():
				return
			case <-time.After(delay):
			}
			delay = min(2*delay, time.Second)
			continue
		}
		delay = 5 * time.Millisecond
		p.wg.Go(func() { p.serve(conn) })
	}
}

func (p *Proxy) serve(client net.Conn) {
	dctx, cancel := context.WithTimeout(p.ctx, DialTimeoutDefault)
	var d net.Dialer
	server, err := d.DialContext(dctx, "tcp", p.target)
	cancel()
	if err != nil {
		_ = client.Close()
		return
	}
	c := &pair{client: client, server: server}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		c.close()
		return
	}
	p.pairs[c] = struct{}{}
	p.mu.Unlock()

	var both sync.WaitGroup
	both.Go(func() { p.pipe(c, server, client) })
	both.Go(func() { p.pipe(c, client, server) })
	both.Wait()
	p.mu.Lock()
	delete(p.pairs, c)
	p.mu.Unlock()
	c.close()
}

// pipe copies src to dst. A clean end of src is passed on as a half-close
// of dst, so a peer can still read what the other side sends; an error on
// either side closes the whole pair.
func (p *Proxy) pipe(c *pair, dst, src net.Conn) {
	_, err := io.Copy(dst, src)
	if err == nil {
		if hc, ok := dst.(interface{ CloseWrite() error }); ok && hc.CloseWrite() == nil {
			return
		}
	}
	c.close()
}
