package cluster

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"os"
	"path/filepath"
	"time"

	"kiln/internal/config"
)

// NodeServerName is the name every node's certificate is made for and every
// front checks, whatever address it dials: the CA says which hosts are
// nodes, not DNS.
const NodeServerName = "kiln-node"

// The files of a certificate directory (kiln node certs): the CA's
// certificate, a node's key pair and a front's. The CA's key is not kept:
// more certificates mean a new directory, the old one given up.
const (
	CAFile        = "ca.pem"
	NodeCertFile  = "node.pem"
	NodeKeyFile   = "node-key.pem"
	FrontCertFile = "front.pem"
	FrontKeyFile  = "front-key.pem"
)

// WriteCerts makes a CA and, signed by it, a node's certificate (for server
// use, named NodeServerName) and a front's (for client use), valid for
// valid from now, and writes them to dir, which must hold none of them
// yet. Keys are written readable by their owner only. Give each node the
// node files and ca.pem, each front the front files and ca.pem.
func WriteCerts(dir string, valid time.Duration) error {
	if valid <= 0 {
		return fmt.Errorf("a validity of %s", valid)
	}
	for _, name := range []string{CAFile, NodeCertFile, NodeKeyFile, FrontCertFile, FrontKeyFile} {
		if _, err := os.Lstat(filepath.Join(dir, name)); err == nil {
			return fmt.Errorf("%s already holds %s: give kiln node certs an empty directory (nothing is overwritten)", dir, name)
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	now := time.Now().Add(-time.Minute)
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	ca := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "kiln cluster CA"},
		NotBefore:             now,
		NotAfter:              now.Add(valid),
		IsCA:                  true,
		BasicConstraintsValid: true,
		MaxPathLenZero:        true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	if ca, err = x509.ParseCertificate(caDER); err != nil {
		return err
	}
	leaf := func(name string, usage x509.ExtKeyUsage, dns []string, certFile, keyFile string) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: serial(),
			Subject:      pkix.Name{CommonName: name},
			DNSNames:     dns,
			NotBefore:    now,
			NotAfter:     now.Add(valid),
			KeyUsage:     x509.KeyUsageDigitalSignature,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		kder, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return err
		}
		if err := writePEM(filepath.Join(dir, keyFile), "PRIVATE KEY", kder, 0o600); err != nil {
			return err
		}
		return writePEM(filepath.Join(dir, certFile), "CERTIFICATE", der, 0o644)
	}
	if err := leaf(NodeServerName, x509.ExtKeyUsageServerAuth, []string{NodeServerName}, NodeCertFile, NodeKeyFile); err != nil {
		return err
	}
	if err := leaf("kiln-front", x509.ExtKeyUsageClientAuth, nil, FrontCertFile, FrontKeyFile); err != nil {
		return err
	}
	return writePEM(filepath.Join(dir, CAFile), "CERTIFICATE", caDER, 0o644)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail
	}
	return n
}

func writePEM(path, typ string, der []byte, mode os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if err := pem.Encode(f, &pem.Block{Type: typ, Bytes: der}); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// NodeTLS is the TLS configuration of a node serving from dir: its own key
// pair, and only clients with a certificate the CA made for client use.
func NodeTLS(dir string) (*tls.Config, error) {
	cert, pool, err := load(dir, NodeCertFile, NodeKeyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientCAs:    pool,
		ClientAuth:   tls.RequireAndVerifyClientCert, // for client use (x509.ExtKeyUsageClientAuth)
		MinVersion:   tls.VersionTLS13,
	}, nil
}

// FrontTLS is the TLS configuration of a front with the files in dir: its
// own key pair, and only nodes with a certificate the CA made for server
// use under NodeServerName.
func FrontTLS(dir string) (*tls.Config, error) {
	cert, pool, err := load(dir, FrontCertFile, FrontKeyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		RootCAs:      pool,
		ServerName:   NodeServerName,
		MinVersion:   tls.VersionTLS13,
		// A front dials a node for every status and every box: resuming
		// the node's TLS session (with a fresh key exchange) spares both
		// ends the certificates' signatures after the first.
		ClientSessionCache: tls.NewLRUClientSessionCache(0),
	}, nil
}

// load reads a key pair and the CA from dir, each through the one check of
// a file kiln trusts (the key as a secret).
func load(dir, certFile, keyFile string) (tls.Certificate, *x509.CertPool, error) {
	read := func(what, name string, secret bool) ([]byte, error) {
		f, err := config.OpenTrusted(what, filepath.Join(dir, name), secret)
		if err != nil {
			return nil, err
		}
		defer f.Close()
		return io.ReadAll(io.LimitReader(f, 1<<20))
	}
	certPEM, err := read("cluster certificate", certFile, false)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	keyPEM, err := read("cluster key", keyFile, true)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	caPEM, err := read("cluster CA", CAFile, false)
	if err != nil {
		return tls.Certificate{}, nil, err
	}
	cert, err := tls.X509KeyPair(certPEM, keyPEM)
	if err != nil {
		return tls.Certificate{}, nil, fmt.Errorf("%s and %s in %s: %w", certFile, keyFile, dir, err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		return tls.Certificate{}, nil, errors.New(filepath.Join(dir, CAFile) + " holds no certificate")
	}
	return cert, pool, nil
}
