package testenv

import (
	"bufio"
	"io"
	"net"
	"regexp"
	"sync"
	"testing"
)

// routeProxy stands in front of every node's route port, so that a test
// can cut a node off from the others at once, as a crash does: every
// route goes through it (the nodes are given and advertise its ports),
// and each connection is known by the nodes at both ends.
type routeProxy struct {
	t       testing.TB
	targets []string                  // each node's own route address
	nodeOf  func(serverID string) int // -1 when no running node has it
	mu      sync.Mutex
	cut     map[int]bool
	conns   map[*proxied]struct{}
	wg      sync.WaitGroup
}

// proxied is one route connection: the server ID of the node that
// dialled it (empty until its CONNECT is read) and the node it reaches.
type proxied struct {
	from    string
	to      int
	in, out net.Conn
}

// routeName finds the server ID a route's CONNECT carries.
var routeName = regexp.MustCompile(`"name":"([^"]+)"`)

// newRouteProxy listens on one loopback port per target and forwards
// what arrives there to it; it returns the ports. The listeners close
// when the test ends.
func newRouteProxy(t testing.TB, targets []string, nodeOf func(string) int) (*routeProxy, []int) {
	t.Helper()
	p := &routeProxy{t: t, targets: targets, nodeOf: nodeOf, cut: map[int]bool{}, conns: map[*proxied]struct{}{}}
	ports := make([]int, len(targets))
	var ls []net.Listener
	for i := range targets {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatalf("testenv: route proxy: %v", err)
		}
		ls = append(ls, l)
		ports[i] = l.Addr().(*net.TCPAddr).Port
		p.wg.Go(func() { p.serve(l, i) })
	}
	t.Cleanup(func() {
		for _, l := range ls {
			_ = l.Close()
		}
		p.mu.Lock()
		for c := range p.conns {
			c.close()
		}
		p.mu.Unlock()
		p.wg.Wait()
	})
	return p, ports
}

func (p *routeProxy) serve(l net.Listener, to int) {
	for {
		in, err := l.Accept()
		if err != nil {
			return
		}
		p.wg.Go(func() { p.forward(in, to) })
	}
}

// forward joins in to node to's route port. The dialling node is known
// from the first line it sends (its CONNECT, with its server ID); a
// connection from or to a node cut off is closed.
func (p *routeProxy) forward(in net.Conn, to int) {
	out, err := net.Dial("tcp", p.targets[to])
	if err != nil {
		_ = in.Close()
		return
	}
	c := &proxied{to: to, in: in, out: out}
	if !p.add(c) {
		return
	}
	defer p.remove(c)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = io.Copy(in, out)
		c.close()
	}()
	r := bufio.NewReader(in)
	line, err := r.ReadSlice('\n')
	if err != nil {
		c.close()
		<-done
		return
	}
	if m := routeName.FindSubmatch(line); m != nil {
		p.mu.Lock()
		c.from = string(m[1])
		p.mu.Unlock()
	}
	if !p.admit(c) {
		<-done
		return
	}
	if _, err := out.Write(line); err == nil {
		_, _ = io.Copy(out, r)
	}
	c.close()
	<-done
}

func (c *proxied) close() {
	_ = c.in.Close()
	_ = c.out.Close()
}

func (p *routeProxy) add(c *proxied) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut[c.to] {
		c.close()
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

// admit reports whether c, its dialler now known, may carry traffic.
func (p *routeProxy) admit(c *proxied) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cut[c.to] || p.cutFrom(c) {
		c.close()
		return false
	}
	return true
}

func (p *routeProxy) remove(c *proxied) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.conns, c)
}

// isolate closes every route to or from node i and refuses new ones
// until rejoin.
func (p *routeProxy) isolate(i int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut[i] = true
	for c := range p.conns {
		if c.to == i || p.cutFrom(c) {
			c.close()
		}
	}
}

// cutFrom reports whether c was dialled by a node cut off; p.mu is held.
func (p *routeProxy) cutFrom(c *proxied) bool {
	if c.from == "" {
		return false
	}
	return p.cut[p.nodeOf(c.from)]
}

// rejoin lets node i's routes through again.
func (p *routeProxy) rejoin(i int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.cut, i)
}
