package service

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/jwt/v2"
	natsserver "github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nkeys"
	"github.com/stretchr/testify/require"
)

// startSecuredNATS starts an in-process server configured by secure and
// returns its client URL with scheme (nats:// or tls://).
func startSecuredNATS(t *testing.T, scheme string, secure func(*natsserver.Options)) string {
	t.Helper()
	o := &natsserver.Options{Host: "127.0.0.1", Port: -1, NoLog: true, NoSigs: true}
	secure(o)
	srv, err := natsserver.NewServer(o)
	require.NoError(t, err)
	srv.Start()
	require.True(t, srv.ReadyForConnections(10*time.Second))
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	return scheme + "://" + srv.Addr().String()
}

// connectWith connects as the runtime does with the given flags, and
// proves the connection works with a request the server answers.
func connectWith(f Flags) error {
	f.errOut = discard{}
	nc, err := f.ConnectNATS("test")
	if err != nil {
		return err
	}
	defer nc.Close()
	return nc.Flush()
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }

func writeFile(t *testing.T, name string, b []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	require.NoError(t, os.WriteFile(p, b, 0o600))
	return p
}

func TestNATSNKeySeedFile(t *testing.T) {
	t.Parallel()
	user, err := nkeys.CreateUser()
	require.NoError(t, err)
	pub, err := user.PublicKey()
	require.NoError(t, err)
	seed, err := user.Seed()
	require.NoError(t, err)
	url := startSecuredNATS(t, "nats", func(o *natsserver.Options) { o.Nkeys = []*natsserver.NkeyUser{{Nkey: pub}} })
	seedFile := writeFile(t, "user.nk", append(seed, '\n'))

	require.NoError(t, connectWith(Flags{NATSURL: url, NATSNKey: seedFile}))

	err = connectWith(Flags{NATSURL: url})
	require.ErrorContains(t, err, "refused this client")
	other, err := nkeys.CreateUser()
	require.NoError(t, err)
	otherSeed, err := other.Seed()
	require.NoError(t, err)
	err = connectWith(Flags{NATSURL: url, NATSNKey: writeFile(t, "other.nk", otherSeed)})
	require.ErrorContains(t, err, "refused this client")
	require.ErrorContains(t, err, "--nats-nkey")

	err = connectWith(Flags{NATSURL: url, NATSNKey: filepath.Join(t.TempDir(), "missing.nk")})
	require.ErrorContains(t, err, "--nats-nkey")
	require.ErrorContains(t, err, "cannot read it")
	err = connectWith(Flags{NATSURL: url, NATSNKey: writeFile(t, "garbage.nk", []byte("not a seed\n"))})
	require.ErrorContains(t, err, "not a readable NKey seed file")
	require.NotContains(t, err.Error(), string(seed))
}

func TestNATSCredentialsFile(t *testing.T) {
	t.Parallel()
	// An operator, one account with JetStream, one user of it: the
	// decentralized setup nsc makes, here in memory.
	operator, err := nkeys.CreateOperator()
	require.NoError(t, err)
	operatorPub, err := operator.PublicKey()
	require.NoError(t, err)
	operatorJWT, err := jwt.NewOperatorClaims(operatorPub).Encode(operator)
	require.NoError(t, err)
	operatorClaims, err := jwt.DecodeOperatorClaims(operatorJWT)
	require.NoError(t, err)
	account, err := nkeys.CreateAccount()
	require.NoError(t, err)
	accountPub, err := account.PublicKey()
	require.NoError(t, err)
	ac := jwt.NewAccountClaims(accountPub)
	ac.Limits.JetStreamLimits = jwt.JetStreamLimits{MemoryStorage: -1, DiskStorage: -1, Streams: -1, Consumer: -1}
	accountJWT, err := ac.Encode(operator)
	require.NoError(t, err)
	creds := func(signer nkeys.KeyPair) []byte {
		user, err := nkeys.CreateUser()
		require.NoError(t, err)
		userPub, err := user.PublicKey()
		require.NoError(t, err)
		userJWT, err := jwt.NewUserClaims(userPub).Encode(signer)
		require.NoError(t, err)
		seed, err := user.Seed()
		require.NoError(t, err)
		b, err := jwt.FormatUserConfig(userJWT, seed)
		require.NoError(t, err)
		return b
	}
	system, err := nkeys.CreateAccount()
	require.NoError(t, err)
	systemPub, err := system.PublicKey()
	require.NoError(t, err)
	systemJWT, err := jwt.NewAccountClaims(systemPub).Encode(operator)
	require.NoError(t, err)
	resolver := &natsserver.MemAccResolver{}
	require.NoError(t, resolver.Store(accountPub, accountJWT))
	require.NoError(t, resolver.Store(systemPub, systemJWT))
	dir := t.TempDir()
	url := startSecuredNATS(t, "nats", func(o *natsserver.Options) {
		o.TrustedOperators = []*jwt.OperatorClaims{operatorClaims}
		o.AccountResolver, o.SystemAccount = resolver, systemPub
		o.JetStream, o.StoreDir = true, dir
	})

	good := writeFile(t, "user.creds", creds(account))
	require.NoError(t, connectWith(Flags{NATSURL: url, NATSCreds: good}))
	// JetStream answers that account's user.
	f := Flags{NATSURL: url, NATSCreds: good, errOut: discard{}}
	nc, err := f.ConnectNATS("test")
	require.NoError(t, err)
	defer nc.Close()
	js, err := nc.JetStream()
	require.NoError(t, err)
	_, err = js.AccountInfo()
	require.NoError(t, err)

	stranger, err := nkeys.CreateAccount() // signs a user the server does not know
	require.NoError(t, err)
	err = connectWith(Flags{NATSURL: url, NATSCreds: writeFile(t, "stranger.creds", creds(stranger))})
	require.ErrorContains(t, err, "refused this client")
	require.ErrorContains(t, err, "--nats-creds")

	err = connectWith(Flags{NATSURL: url, NATSCreds: filepath.Join(t.TempDir(), "missing.creds")})
	require.ErrorContains(t, err, "--nats-creds")
	require.ErrorContains(t, err, "cannot read it")
	err = connectWith(Flags{NATSURL: url, NATSCreds: writeFile(t, "seed-only.creds", []byte("just text\n"))})
	require.ErrorContains(t, err, "not a NATS credentials file")
}

// testPKI is a CA with a server certificate for 127.0.0.1 and a client
// certificate, written as PEM files.
type testPKI struct {
	caFile, serverCert, serverKey, clientCert, clientKey string
	otherCA                                              string
}

func newTestPKI(t *testing.T) testPKI {
	t.Helper()
	dir := t.TempDir()
	write := func(name, kind string, der []byte) string {
		p := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600))
		return p
	}
	newKey := func() *ecdsa.PrivateKey {
		k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		require.NoError(t, err)
		return k
	}
	serial := int64(1)
	newCA := func(name string) (*x509.Certificate, *ecdsa.PrivateKey, []byte) {
		key := newKey()
		serial++
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		require.NoError(t, err)
		cert, err := x509.ParseCertificate(der)
		require.NoError(t, err)
		return cert, key, der
	}
	ca, caKey, caDER := newCA("idemsaga test CA")
	issue := func(name string, usage x509.ExtKeyUsage, ips []net.IP) (string, string) {
		key := newKey()
		serial++
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: name},
			NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
			KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage}, IPAddresses: ips}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		require.NoError(t, err)
		keyDER, err := x509.MarshalECPrivateKey(key)
		require.NoError(t, err)
		return write(name+".pem", "CERTIFICATE", der), write(name+"-key.pem", "EC PRIVATE KEY", keyDER)
	}
	p := testPKI{caFile: write("ca.pem", "CERTIFICATE", caDER)}
	p.serverCert, p.serverKey = issue("server", x509.ExtKeyUsageServerAuth, []net.IP{net.ParseIP("127.0.0.1")})
	p.clientCert, p.clientKey = issue("client", x509.ExtKeyUsageClientAuth, nil)
	_, _, otherDER := newCA("another CA")
	p.otherCA = write("other-ca.pem", "CERTIFICATE", otherDER)
	return p
}

func TestNATSClientCertificateAndCA(t *testing.T) {
	t.Parallel()
	pki := newTestPKI(t)
	serverCert, err := tls.LoadX509KeyPair(pki.serverCert, pki.serverKey)
	require.NoError(t, err)
	caPEM, err := os.ReadFile(pki.caFile)
	require.NoError(t, err)
	clients := x509.NewCertPool()
	require.True(t, clients.AppendCertsFromPEM(caPEM))
	url := startSecuredNATS(t, "tls", func(o *natsserver.Options) {
		o.TLS, o.TLSVerify, o.TLSTimeout = true, true, 5
		o.TLSConfig = &tls.Config{Certificates: []tls.Certificate{serverCert}, ClientCAs: clients,
			ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS12}
	})

	require.NoError(t, connectWith(Flags{NATSURL: url, NATSCA: pki.caFile, NATSCert: pki.clientCert, NATSKey: pki.clientKey}))

	err = connectWith(Flags{NATSURL: url, NATSCA: pki.caFile})
	require.Error(t, err, "the server requires a client certificate")
	require.ErrorContains(t, err, "--nats-tls-cert")
	err = connectWith(Flags{NATSURL: url, NATSCA: pki.otherCA, NATSCert: pki.clientCert, NATSKey: pki.clientKey})
	require.ErrorContains(t, err, "TLS with NATS")
	require.ErrorContains(t, err, "--nats-tls-ca")

	err = connectWith(Flags{NATSURL: url, NATSCA: pki.caFile, NATSCert: pki.clientCert})
	require.ErrorContains(t, err, "go together")
	err = connectWith(Flags{NATSURL: url, NATSCA: filepath.Join(t.TempDir(), "missing.pem"), NATSCert: pki.clientCert, NATSKey: pki.clientKey})
	require.ErrorContains(t, err, "--nats-tls-ca")
	require.ErrorContains(t, err, "cannot read it")
	err = connectWith(Flags{NATSURL: url, NATSCA: pki.clientKey, NATSCert: pki.clientCert, NATSKey: pki.clientKey})
	require.ErrorContains(t, err, "holds no PEM certificate")
	err = connectWith(Flags{NATSURL: url, NATSCA: pki.caFile, NATSCert: pki.clientCert, NATSKey: pki.serverKey})
	require.ErrorContains(t, err, "not a PEM certificate and its private key")
	err = connectWith(Flags{NATSURL: url, NATSCA: pki.caFile, NATSCert: filepath.Join(t.TempDir(), "missing.pem"), NATSKey: pki.clientKey})
	require.ErrorContains(t, err, "--nats-tls-cert")
	require.ErrorContains(t, err, "cannot read it")
}
