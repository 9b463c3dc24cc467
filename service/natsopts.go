package service

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// natsSecurity returns the connection options of the NATS security flags
// (--nats-creds, --nats-nkey, --nats-tls-cert/--nats-tls-key,
// --nats-tls-ca), after checking that each file given is readable and
// holds what the flag needs, so that a wrong path is reported as that and
// not as an unreachable server. Errors never hold a seed or a key.
func (f *Flags) natsSecurity() ([]nats.Option, error) {
	var opts []nats.Option
	if f.NATSCreds != "" {
		b, err := readFlagFile("--nats-creds", f.NATSCreds)
		if err != nil {
			return nil, err
		}
		if _, err := nkeys.ParseDecoratedJWT(b); err != nil || !strings.Contains(string(b), "BEGIN NATS USER JWT") {
			return nil, fmt.Errorf("--nats-creds %s: not a NATS credentials file (it holds no user JWT): give the .creds file nsc or your NATS operator issued", f.NATSCreds)
		}
		if _, err := nkeys.ParseDecoratedUserNKey(b); err != nil {
			return nil, fmt.Errorf("--nats-creds %s: not a NATS credentials file (it holds no user NKey seed): give the .creds file nsc or your NATS operator issued", f.NATSCreds)
		}
		opts = append(opts, nats.UserCredentials(f.NATSCreds))
	}
	if f.NATSNKey != "" {
		if _, err := readFlagFile("--nats-nkey", f.NATSNKey); err != nil {
			return nil, err
		}
		o, err := nats.NkeyOptionFromSeed(f.NATSNKey)
		if err != nil {
			return nil, fmt.Errorf("--nats-nkey %s: not a readable NKey seed file (%s): give a file holding a user seed (SU…), as `nk -gen user` writes", f.NATSNKey, redactSecrets(err.Error()))
		}
		opts = append(opts, o)
	}
	if (f.NATSCert == "") != (f.NATSKey == "") {
		return nil, errors.New("--nats-tls-cert and --nats-tls-key go together: give both, or neither")
	}
	if f.NATSCert != "" {
		for flag, path := range map[string]string{"--nats-tls-cert": f.NATSCert, "--nats-tls-key": f.NATSKey} {
			if _, err := readFlagFile(flag, path); err != nil {
				return nil, err
			}
		}
		if _, err := tls.LoadX509KeyPair(f.NATSCert, f.NATSKey); err != nil {
			return nil, fmt.Errorf("--nats-tls-cert %s and --nats-tls-key %s are not a PEM certificate and its private key (%v): give the certificate and the key it was issued with", f.NATSCert, f.NATSKey, err)
		}
		opts = append(opts, nats.ClientCert(f.NATSCert, f.NATSKey))
	}
	if f.NATSCA != "" {
		b, err := readFlagFile("--nats-tls-ca", f.NATSCA)
		if err != nil {
			return nil, err
		}
		if !x509.NewCertPool().AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("--nats-tls-ca %s holds no PEM certificate: give the CA certificate that signed the NATS server's", f.NATSCA)
		}
		opts = append(opts, nats.RootCAs(f.NATSCA))
	}
	return opts, nil
}

// readFlagFile reads the file a flag names, or says which flag names a
// file that cannot be read.
func readFlagFile(flag, path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%s %s: cannot read it (%v): give the path of a readable file", flag, path, errors.Unwrap(err))
	}
	return b, nil
}

// natsConnectError says what to do about a failed connection: refused
// credentials, a TLS handshake that failed, or no server reachable.
func natsConnectError(shown, msg string, authErr bool) error {
	lower := strings.ToLower(msg)
	switch {
	case authErr || strings.Contains(lower, "authorization") || strings.Contains(lower, "authentication"):
		return fmt.Errorf("NATS at %s refused this client (%s): check the user, token, --nats-creds or --nats-nkey", shown, msg)
	case strings.Contains(lower, "x509") || strings.Contains(lower, "tls") || strings.Contains(lower, "certificate"):
		return fmt.Errorf("TLS with NATS at %s failed (%s): check --nats-tls-ca (the CA that signed the server's certificate), a tls:// URL whose host the certificate names, and --nats-tls-cert/--nats-tls-key when the server requires client certificates", shown, msg)
	}
	return fmt.Errorf("cannot reach NATS at %s (%s): start nats-server with JetStream (nats-server -js) or set NATS_URL; on a single machine, run --embedded-nats DIR needs no server", shown, msg)
}
