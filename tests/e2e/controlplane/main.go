// kube-controlplane runs a real Kubernetes control plane for the end-to-end
// tests in one process: an embedded etcd (on 127.0.0.1) and kube-apiserver,
// plus the namespace, garbage-collector and service-account controllers
// (controllers.go). It runs no scheduler or kubelet: the one-node cluster of
// tests/e2e/node adds those as their own processes.
//
// Usage:
//
//	kube-controlplane -data-dir DIR [-kubeconfig FILE] [-address IP] [-secure-port N] [-- extra kube-apiserver flags]
//
// The apiserver listens on 127.0.0.1 unless -address names another local
// address: pods cannot reach loopback, so a one-node cluster passes its pod
// bridge's address, which the apiserver then advertises for the "kubernetes"
// Service. Once ready it writes an admin kubeconfig and prints one line,
// "READY <kubeconfig path>", to stdout. SIGTERM or SIGINT stops the
// controllers and the apiserver gracefully, then etcd.
package main

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

const serviceRange = "10.96.0.0/12"

var (
	loopback            = net.ParseIP("127.0.0.1")
	kubernetesServiceIP = net.ParseIP("10.96.0.1")
)

func main() {
	dataDir := flag.String("data-dir", "", "directory for etcd data, keys and certificates (required)")
	kubeconfigPath := flag.String("kubeconfig", "", "where to write the admin kubeconfig (default DATA-DIR/admin.kubeconfig)")
	address := flag.String("address", "127.0.0.1", "local address the kube-apiserver listens on and advertises")
	securePort := flag.Int("secure-port", 0, "kube-apiserver HTTPS port (default: a free port)")
	readyTimeout := flag.Duration("ready-timeout", 2*time.Minute, "give up if the apiserver is not ready by then")
	flag.Parse()
	if *dataDir == "" {
		fmt.Fprintln(os.Stderr, "kube-controlplane: -data-dir is required")
		os.Exit(2)
	}
	if *kubeconfigPath == "" {
		*kubeconfigPath = filepath.Join(*dataDir, "admin.kubeconfig")
	}
	ip := net.ParseIP(*address)
	if ip == nil {
		fmt.Fprintf(os.Stderr, "kube-controlplane: -address %q is not an IP address\n", *address)
		os.Exit(2)
	}
	if err := run(*dataDir, *kubeconfigPath, ip, *securePort, *readyTimeout, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "kube-controlplane:", err)
		os.Exit(1)
	}
}

func run(dataDir, kubeconfigPath string, address net.IP, securePort int, readyTimeout time.Duration, extraAPIServerArgs []string) error {
	// Built first because it installs the SIGTERM/SIGINT handler whose context
	// stops the apiserver; a signal that arrives while etcd starts is then
	// still honored.
	apiserverCommand := app.NewAPIServerCommand()

	if err := os.MkdirAll(dataDir, 0o700); err != nil {
		return err
	}
	pki, err := writePKI(dataDir, address)
	if err != nil {
		return fmt.Errorf("generating keys and certificates: %w", err)
	}

	etcd, err := startEtcd(filepath.Join(dataDir, "etcd"))
	if err != nil {
		return fmt.Errorf("starting etcd: %w", err)
	}
	defer etcd.Close()

	if securePort == 0 {
		if securePort, err = freePort(address); err != nil {
			return err
		}
	}
	apiserverCommand.SetArgs(append([]string{
		"--etcd-servers=" + etcd.Config().ListenClientUrls[0].String(),
		"--bind-address=" + address.String(),
		"--advertise-address=" + address.String(),
		"--secure-port=" + strconv.Itoa(securePort),
		"--tls-cert-file=" + pki.servingCert,
		"--tls-private-key-file=" + pki.servingKey,
		"--client-ca-file=" + pki.caCert,
		"--authorization-mode=Node,RBAC",
		// The signing key lets TokenRequest (kubectl create token) mint
		// service-account tokens; the same file serves as the verifying key.
		"--service-account-signing-key-file=" + pki.serviceAccountKey,
		"--service-account-key-file=" + pki.serviceAccountKey,
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		// The range Service IPs are allocated from; only a node's kube-proxy routes it.
		"--service-cluster-ip-range=" + serviceRange,
		// On loopback the endpoints of the "kubernetes" Service would be
		// 127.0.0.1, which Endpoints reject, so reconciling them only logs an
		// error every 10 s; with no node, nothing would use them anyway.
		"--endpoint-reconciler-type=" + map[bool]string{true: "none", false: "lease"}[address.IsLoopback()],
	}, extraAPIServerArgs...))

	// Cancelled by the same signals that stop the apiserver (which has its own
	// handler), so the controllers stop with it instead of retrying against it.
	controllersCtx, stopControllers := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stopControllers()

	apiserverDone := make(chan error, 1)
	go func() { apiserverDone <- apiserverCommand.Execute() }()

	adminConfig := adminKubeconfig(address, securePort, pki)
	adminRESTConfig, err := clientcmd.NewDefaultClientConfig(*adminConfig, nil).ClientConfig()
	if err != nil {
		return err
	}
	client, err := kubernetes.NewForConfig(adminRESTConfig)
	if err != nil {
		return err
	}
	deadline, cancelDeadline := context.WithTimeout(context.Background(), readyTimeout)
	defer cancelDeadline()
	// The apiserver creates the "default" namespace shortly after /readyz
	// first answers; tests use it at once.
	err = waitFor(deadline, apiserverDone, "kube-apiserver", func(ctx context.Context) error {
		if _, err := client.RESTClient().Get().AbsPath("/readyz").DoRaw(ctx); err != nil {
			return err
		}
		_, err := client.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
		return err
	})
	if err != nil {
		return err
	}
	if err := startControllers(controllersCtx, adminRESTConfig); err != nil {
		return fmt.Errorf("starting controllers: %w", err)
	}
	// A pod in "default" needs it (ServiceAccount admission).
	err = waitFor(deadline, apiserverDone, "default service account", func(ctx context.Context) error {
		_, err := client.CoreV1().ServiceAccounts("default").Get(ctx, "default", metav1.GetOptions{})
		return err
	})
	if err != nil {
		return err
	}

	// Written only now, so a kubeconfig on disk means the apiserver answers;
	// the rename keeps readers from seeing a half-written file.
	if err := clientcmd.WriteToFile(*adminConfig, kubeconfigPath+".tmp"); err != nil {
		return err
	}
	if err := os.Rename(kubeconfigPath+".tmp", kubeconfigPath); err != nil {
		return err
	}
	fmt.Println("READY", kubeconfigPath)

	err = <-apiserverDone
	klog.Flush()
	return err
}

// startEtcd starts a single-member etcd on free loopback ports. Every start is
// a fresh cluster: the tests want a clean slate, and an old member would
// remember peer ports that are no longer ours.
func startEtcd(dir string) (*embed.Etcd, error) {
	if err := os.RemoveAll(dir); err != nil {
		return nil, err
	}
	clientPort, err := freePort(loopback)
	if err != nil {
		return nil, err
	}
	peerPort, err := freePort(loopback)
	if err != nil {
		return nil, err
	}
	clientURL := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(clientPort))}
	peerURL := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(peerPort))}

	cfg := embed.NewConfig()
	cfg.Dir = dir
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	// Throwaway test data: skipping fsync makes every write much cheaper.
	cfg.UnsafeNoFsync = true

	etcd, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-etcd.Server.ReadyNotify():
		return etcd, nil
	case err := <-etcd.Err():
		etcd.Close()
		return nil, err
	case <-time.After(time.Minute):
		etcd.Close()
		return nil, errors.New("etcd was not ready within a minute")
	}
}

// waitFor polls check until it succeeds, the deadline passes or the apiserver
// exits.
func waitFor(deadline context.Context, apiserverDone <-chan error, what string, check func(context.Context) error) error {
	for {
		attempt, cancelAttempt := context.WithTimeout(deadline, 5*time.Second)
		err := check(attempt)
		cancelAttempt()
		if err == nil {
			return nil
		}
		select {
		case err := <-apiserverDone:
			return fmt.Errorf("kube-apiserver exited before %s was ready: %v", what, err)
		case <-deadline.Done():
			return fmt.Errorf("%s not ready in time; last error: %v", what, err)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

func adminKubeconfig(address net.IP, securePort int, pki *pkiFiles) *clientcmdapi.Config {
	const name = "kvbank-e2e"
	config := clientcmdapi.NewConfig()
	config.Clusters[name] = &clientcmdapi.Cluster{
		Server:                   "https://" + net.JoinHostPort(address.String(), strconv.Itoa(securePort)),
		CertificateAuthorityData: pki.caCertPEM,
	}
	config.AuthInfos[name] = &clientcmdapi.AuthInfo{
		ClientCertificateData: pki.adminCertPEM,
		ClientKeyData:         pki.adminKeyPEM,
	}
	config.Contexts[name] = &clientcmdapi.Context{Cluster: name, AuthInfo: name}
	config.CurrentContext = name
	return config
}

// pkiFiles names the files written into the data dir, and keeps in memory
// what the kubeconfig embeds.
type pkiFiles struct {
	caCert, servingCert, servingKey, serviceAccountKey string
	caCertPEM, adminCertPEM, adminKeyPEM               []byte
}

// writePKI makes one CA that signs both the apiserver's serving certificate
// and the admin client certificate, so the kubeconfig trusts a single CA and
// --client-ca-file authenticates the admin. Keys are regenerated every start.
func writePKI(dataDir string, address net.IP) (*pkiFiles, error) {
	dir := filepath.Join(dataDir, "pki")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	caKey, err := newKey()
	if err != nil {
		return nil, err
	}
	caTemplate := &x509.Certificate{
		Subject:               pkix.Name{CommonName: "kvbank-e2e-ca"},
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	ca, caCertPEM, err := signCert(caTemplate, caTemplate, caKey.Public(), caKey)
	if err != nil {
		return nil, err
	}

	servingKey, err := newKey()
	if err != nil {
		return nil, err
	}
	_, servingCertPEM, err := signCert(&x509.Certificate{
		Subject: pkix.Name{CommonName: "kube-apiserver"},
		DNSNames: []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
			"kubernetes.default.svc.cluster.local"},
		// Pods reach it through the "kubernetes" Service, the first IP of the range.
		IPAddresses: []net.IP{loopback, address, kubernetesServiceIP},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature,
	}, ca, servingKey.Public(), caKey)
	if err != nil {
		return nil, err
	}

	// system:masters is bound to cluster-admin by RBAC's bootstrap policy.
	adminKey, err := newKey()
	if err != nil {
		return nil, err
	}
	_, adminCertPEM, err := signCert(&x509.Certificate{
		Subject:     pkix.Name{CommonName: "admin", Organization: []string{"system:masters"}},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		KeyUsage:    x509.KeyUsageDigitalSignature,
	}, ca, adminKey.Public(), caKey)
	if err != nil {
		return nil, err
	}

	serviceAccountKey, err := newKey()
	if err != nil {
		return nil, err
	}

	files := &pkiFiles{
		caCert:            filepath.Join(dir, "ca.crt"),
		servingCert:       filepath.Join(dir, "apiserver.crt"),
		servingKey:        filepath.Join(dir, "apiserver.key"),
		serviceAccountKey: filepath.Join(dir, "service-account.key"),
		caCertPEM:         caCertPEM,
		adminCertPEM:      adminCertPEM,
		adminKeyPEM:       keyPEM(adminKey),
	}
	for path, content := range map[string][]byte{
		files.caCert:                    caCertPEM,
		files.servingCert:               servingCertPEM,
		files.servingKey:                keyPEM(servingKey),
		files.serviceAccountKey:         keyPEM(serviceAccountKey),
		filepath.Join(dir, "admin.crt"): adminCertPEM,
		filepath.Join(dir, "admin.key"): files.adminKeyPEM,
	} {
		if err := os.WriteFile(path, content, 0o600); err != nil {
			return nil, err
		}
	}
	return files, nil
}

// P-256 keys: quick to generate at every start, and accepted by the
// apiserver both for TLS and for signing service-account tokens (ES256).
func newKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

func keyPEM(key *ecdsa.PrivateKey) []byte {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		panic(err) // only fails for curves x509 does not know; P-256 it knows
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
}

// signCert fills in serial number and validity, and returns the certificate
// parsed (to sign others with: it carries the generated key id) and as PEM.
func signCert(template, parent *x509.Certificate, publicKey crypto.PublicKey, signer crypto.Signer) (*x509.Certificate, []byte, error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, err
	}
	template.SerialNumber = serial
	// Backdated an hour so small clock differences never make it "not yet valid".
	template.NotBefore = time.Now().Add(-time.Hour)
	template.NotAfter = time.Now().Add(10 * 365 * 24 * time.Hour)
	der, err := x509.CreateCertificate(rand.Reader, template, parent, publicKey, signer)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	return cert, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), err
}

// freePort asks the kernel for an unused port on address. Another process could
// take it before we bind it again; on a test machine that race is rare enough.
func freePort(address net.IP) (int, error) {
	listener, err := net.Listen("tcp", net.JoinHostPort(address.String(), "0"))
	if err != nil {
		return 0, err
	}
	defer listener.Close()
	return listener.Addr().(*net.TCPAddr).Port, nil
}
