package tcpproxy_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/idemsaga/idemsaga/internal/tcpproxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echoServer echoes every byte it receives until the peer half-closes,
// then closes its side.
type echoServer struct {
	ln net.Listener
	wg sync.WaitGroup

	mu    sync.Mutex
	conns map[net.Conn]struct{}
}

func startEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	s := &echoServer{ln: ln, conns: map[net.Conn]struct{}{}}
	s.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.conns[c] = struct{}{}
			s.mu.Unlock()
			s.wg.Go(func() {
				_, _ = io.Copy(c, c)
				_ = c.Close()
				s.mu.Lock()
				delete(s.conns, c)
				s.mu.Unlock()
			})
		}
	})
	t.Cleanup(func() {
		_ = ln.Close()
		s.mu.Lock()
		for c := range s.conns {
			_ = c.Close()
		}
		s.mu.Unlock()
		s.wg.Wait()
	})
	return s
}

func (s *echoServer) addr() string { return s.ln.Addr().String() }

// open returns the number of connections the server still holds.
func (s *echoServer) open() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

func newProxy(t *testing.T, target string) *tcpproxy.Proxy {
	t.Helper()
	p, err := tcpproxy.New(target)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// roundTrip sends payload and requires it back, writing and reading at
// once so that large payloads cannot fill both directions' buffers.
func roundTrip(c net.Conn, payload []byte) error {
	if err := c.SetDeadline(time.Now().Add(10 * time.Second)); err != nil {
		return err
	}
	defer c.SetDeadline(time.Time{}) //nolint:errcheck // best effort
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(payload)
		werr <- err
	}()
	got := make([]byte, len(payload))
	_, rerr := io.ReadFull(c, got)
	if err := <-werr; err != nil {
		return err
	}
	if rerr != nil {
		return rerr
	}
	if !bytes.Equal(got, payload) {
		return errors.New("echo differs from what was sent")
	}
	return nil
}

func TestEchoThroughProxy(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	p := newProxy(t, echo.addr())
	require.NotEqual(t, echo.addr(), p.Addr())

	c := dial(t, p.Addr())
	require.NoError(t, roundTrip(c, []byte("hello, proxy")))
	require.NoError(t, roundTrip(c, []byte("and again")))

	// A half-close reaches the server, whose own close reaches us.
	require.NoError(t, c.(*net.TCPConn).CloseWrite())
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err := c.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF)
	require.Eventually(t, func() bool { return echo.open() == 0 }, 5*time.Second, 5*time.Millisecond)
}

func TestCutClosesOpenConnectionsAndKeepsAccepting(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	p := newProxy(t, echo.addr())
	require.Zero(t, p.Cut(), "nothing open yet")

	conns := make([]net.Conn, 3)
	for i := range conns {
		conns[i] = dial(t, p.Addr())
		// A completed round trip proves the pair is registered.
		require.NoError(t, roundTrip(conns[i], []byte{byte(i), 'x'}))
	}
	require.Equal(t, 3, echo.open())

	require.Equal(t, 3, p.Cut())
	for i, c := range conns {
		require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
		_, err := c.Read(make([]byte, 1))
		require.Error(t, err, "connection %d still open after Cut", i)
		var ne net.Error
		require.False(t, errors.As(err, &ne) && ne.Timeout(), "connection %d was not closed by Cut: read timed out", i)
	}
	// The server side was cut too.
	require.Eventually(t, func() bool { return echo.open() == 0 }, 5*time.Second, 5*time.Millisecond)
	require.Zero(t, p.Cut(), "cut connections are not counted twice")

	fresh := dial(t, p.Addr())
	require.NoError(t, roundTrip(fresh, []byte("after the cut")))
	require.Equal(t, 1, p.Cut())
	_, err := fresh.Read(make([]byte, 1))
	require.Error(t, err)
}

func TestCloseIsIdempotentAndClosesEverything(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	p, err := tcpproxy.New(echo.addr())
	require.NoError(t, err)
	c := dial(t, p.Addr())
	require.NoError(t, roundTrip(c, []byte("ping")))

	require.NoError(t, p.Close())
	require.NoError(t, p.Close(), "second Close")
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "open connection survived Close")
	require.Eventually(t, func() bool { return echo.open() == 0 }, 5*time.Second, 5*time.Millisecond)

	_, err = net.DialTimeout("tcp", p.Addr(), time.Second)
	require.Error(t, err, "a closed proxy accepts nothing")
	require.Zero(t, p.Cut(), "Cut after Close is harmless")
}

func TestConcurrentConnectionsEcho(t *testing.T) {
	t.Parallel()
	echo := startEcho(t)
	p := newProxy(t, echo.addr())

	const n = 20
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			c, err := net.DialTimeout("tcp", p.Addr(), 5*time.Second)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			// Distinct payloads larger than a socket buffer, so that a
			// proxy mixing up or truncating streams is caught.
			payload := make([]byte, 256<<10+i)
			_, _ = rand.Read(payload)
			for range 3 {
				if err := roundTrip(c, payload); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
}

func TestUnreachableTargetClosesTheClient(t *testing.T) {
	t.Parallel()
	// A port that was free a moment ago: nothing listens there.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	target := ln.Addr().String()
	require.NoError(t, ln.Close())

	p := newProxy(t, target)
	c := dial(t, p.Addr())
	require.NoError(t, c.SetReadDeadline(time.Now().Add(10*time.Second)))
	_, err = c.Read(make([]byte, 1))
	require.Error(t, err)
	var ne net.Error
	require.False(t, errors.As(err, &ne) && ne.Timeout(), "client of an unreachable target was left hanging")
	require.Zero(t, p.Cut())
}

func TestNewRejectsBadTarget(t *testing.T) {
	t.Parallel()
	_, err := tcpproxy.New("no-port")
	require.ErrorContains(t, err, "host:port")
}
