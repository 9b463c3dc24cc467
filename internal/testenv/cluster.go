package testenv

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
)

// Cluster is a JetStream cluster of in-process servers on loopback, each
// with its own store folder and fixed client and route ports, so that a
// node shut down can come back as itself (same name, store and address).
// Routes go through a proxy, so that a node can also die as in a crash
// (Crash), not only shut down (Kill).
type Cluster struct {
	t     testing.TB
	mu    sync.Mutex
	opts  []*natsserver.Options
	nodes []*natsserver.Server // nil while a node is down
	proxy *routeProxy
}

// NATSCluster starts n JetStream servers clustered over loopback routes,
// waits until the cluster has a meta leader, and shuts every node down
// when the test ends.
func NATSCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	ports := freePorts(t, 2*n) // one draw: no port twice
	clientPorts, routePorts := ports[:n], ports[n:]
	c := &Cluster{t: t, nodes: make([]*natsserver.Server, n)}
	targets := make([]string, n)
	for i, p := range routePorts {
		targets[i] = fmt.Sprintf("127.0.0.1:%d", p)
	}
	// Every node dials, and advertises, the proxy's ports, never its
	// peers' own: no route bypasses the proxy.
	proxy, proxyPorts := newRouteProxy(t, targets, c.nodeOf)
	c.proxy = proxy
	routes := make([]string, n)
	for i, p := range proxyPorts {
		routes[i] = fmt.Sprintf("nats-route://127.0.0.1:%d", p)
	}
	for i := range n {
		c.opts = append(c.opts, &natsserver.Options{
			ServerName: fmt.Sprintf("n%d", i+1), Host: "127.0.0.1", Port: clientPorts[i],
			JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true,
			Cluster: natsserver.ClusterOpts{Name: "idemsaga-test", Host: "127.0.0.1", Port: routePorts[i],
				Advertise: fmt.Sprintf("127.0.0.1:%d", proxyPorts[i])},
			Routes: natsserver.RoutesFromStr(strings.Join(routes, ",")),
		})
	}
	t.Cleanup(func() {
		for i := range n {
			c.Kill(i)
		}
	})
	for i := range n {
		c.start(i)
	}
	c.WaitReady(30 * time.Second)
	return c
}

// freePorts returns n loopback ports free at the time of the call, drawn
// below Linux's ephemeral range (32768 up): a node binds its port later,
// and again on a restart, and a port the kernel hands out for ":0" could
// be taken by another test's listener in between.
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	var ls []net.Listener
	for tries := 0; len(ports) < n; tries++ {
		if tries > 1000 {
			t.Fatalf("testenv: no free loopback port between %d and %d", portsFrom, portsFrom+portsSpan)
		}
		p := portsFrom + rand.IntN(portsSpan)
		l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue // in use
		}
		ls = append(ls, l)
		ports = append(ports, p)
	}
	for _, l := range ls {
		_ = l.Close()
	}
	return ports
}

// The ports freePorts draws from.
const portsFrom, portsSpan = 20000, 12000

func (c *Cluster) start(i int) {
	c.t.Helper()
	o := *c.opts[i]
	o.Routes = append(o.Routes[:0:0], o.Routes...)
	srv, err := natsserver.NewServer(&o)
	if err != nil {
		c.t.Fatalf("testenv: nats cluster node %s: %v", o.ServerName, err)
	}
	srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		c.t.Fatalf("testenv: nats cluster node %s did not become ready", o.ServerName)
	}
	c.mu.Lock()
	c.nodes[i] = srv
	c.mu.Unlock()
}

// URLs returns every node's client URL, comma-separated, as nats.Connect
// takes them.
func (c *Cluster) URLs() string {
	urls := make([]string, len(c.opts))
	for i, o := range c.opts {
		urls[i] = fmt.Sprintf("nats://127.0.0.1:%d", o.Port)
	}
	return strings.Join(urls, ",")
}

// Name returns node i's server name.
func (c *Cluster) Name(i int) string { return c.opts[i].ServerName }

// Server returns node i, or nil while it is down.
func (c *Cluster) Server(i int) *natsserver.Server {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nodes[i]
}

// Kill shuts node i down (its clients move to the other nodes); a node
// already down is left alone.
func (c *Cluster) Kill(i int) {
	c.mu.Lock()
	srv := c.nodes[i]
	c.nodes[i] = nil
	c.mu.Unlock()
	if srv != nil {
		srv.Shutdown()
		srv.WaitForShutdown()
	}
}

// Crash ends node i as a crash or a power loss does: its routes to the
// other nodes are cut before it stops, so it hands no leadership over
// and says nothing more to them (a shutdown, Kill, steps its leaders
// down first); the other nodes elect new leaders when they stop hearing
// from it. Its clients move to the other nodes. A node already down is
// left alone.
func (c *Cluster) Crash(i int) {
	if c.Server(i) == nil {
		return
	}
	c.proxy.isolate(i)
	c.Kill(i)
}

// nodeOf returns the running node whose server ID is id, or -1.
func (c *Cluster) nodeOf(id string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, srv := range c.nodes {
		if srv != nil && srv.ID() == id {
			return i
		}
	}
	return -1
}

// Restart brings nodes back on their store folders and ports, all of
// them before it waits until the cluster counts them again (WaitReady):
// two nodes of three brought back one at a time first wait for a meta
// group of two, whose election a run once saw take over 30 s.
func (c *Cluster) Restart(nodes ...int) {
	c.t.Helper()
	for _, i := range nodes {
		if c.Server(i) != nil {
			c.t.Fatalf("testenv: nats cluster node %s is running", c.Name(i))
		}
		c.proxy.rejoin(i)
		c.start(i)
	}
	c.WaitReady(30 * time.Second)
}

// StreamLeader returns the node leading stream (of the default account),
// or -1 while none does.
func (c *Cluster) StreamLeader(stream string) int {
	for i := range c.opts {
		if srv := c.Server(i); srv != nil && srv.JetStreamIsStreamLeader(natsserver.DEFAULT_GLOBAL_ACCOUNT, stream) {
			return i
		}
	}
	return -1
}

// ConsumerLeader returns the node leading the durable consumer of stream,
// or -1 while none does.
func (c *Cluster) ConsumerLeader(stream, consumer string) int {
	for i := range c.opts {
		if srv := c.Server(i); srv != nil && srv.JetStreamIsConsumerLeader(natsserver.DEFAULT_GLOBAL_ACCOUNT, stream, consumer) {
			return i
		}
	}
	return -1
}

// WaitReady waits until a running node leads the JetStream meta group,
// knows every running node as a peer, and every running node is current,
// failing the test after timeout.
func (c *Cluster) WaitReady(timeout time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for !c.ready() {
		if time.Now().After(deadline) {
			c.t.Fatalf("testenv: the nats cluster is not ready (a JetStream leader and every node current) after %s", timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (c *Cluster) ready() bool {
	var running []*natsserver.Server
	for i := range c.opts {
		if srv := c.Server(i); srv != nil {
			running = append(running, srv)
		}
	}
	led := false
	for _, srv := range running {
		if !srv.JetStreamIsCurrent() {
			return false
		}
		if srv.JetStreamIsLeader() {
			led = len(srv.JetStreamClusterPeers()) >= len(running)
		}
	}
	return led
}

// WaitStreamLeader waits until a running node leads stream and returns
// it, failing the test after timeout.
func (c *Cluster) WaitStreamLeader(stream string, timeout time.Duration) int {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		if i := c.StreamLeader(stream); i >= 0 {
			return i
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("testenv: stream %s has no leader after %s", stream, timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Connect opens a client connection to every node, closed when the test
// ends; it reconnects forever, to whichever node is up.
func (c *Cluster) Connect(t testing.TB) *nats.Conn {
	t.Helper()
	return Connect(t, c.URLs())
}

// GatherConsumer makes node i lead the durable consumer of stream (a
// leader step-down with node i preferred), so that one node holds what a
// test kills; it fails the test when node i does not lead it within
// timeout.
func (c *Cluster) GatherConsumer(nc *nats.Conn, stream, consumer string, i int, timeout time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(timeout)
	req, err := json.Marshal(natsserver.JSApiLeaderStepdownRequest{Placement: &natsserver.Placement{Preferred: c.Name(i)}})
	if err != nil {
		c.t.Fatal(err)
	}
	for c.ConsumerLeader(stream, consumer) != i {
		if time.Now().After(deadline) {
			c.t.Fatalf("testenv: node %s does not lead consumer %s of %s after %s", c.Name(i), consumer, stream, timeout)
		}
		if l := c.ConsumerLeader(stream, consumer); l >= 0 {
			_, _ = nc.Request(fmt.Sprintf(natsserver.JSApiConsumerLeaderStepDownT, stream, consumer), req, 2*time.Second)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
