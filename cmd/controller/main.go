// Command controller is the CSI controller plugin: the Identity and
// Controller services of the driver, run by a Deployment next to the
// external-provisioner, -attacher and -resizer sidecars. It never touches
// data: every call becomes a change of an NBDVolume that the volume's
// storage agent carries out. Run it with --help for the flags.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/client"

	"github.com/mpnbd/mpnbd/api/v1alpha1"
	"github.com/mpnbd/mpnbd/pkg/driver"
	"github.com/mpnbd/mpnbd/pkg/kubeconfig"
	"github.com/mpnbd/mpnbd/pkg/logging/kubelog"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

type options struct {
	endpoint    string
	namespace   string
	kubeconfig  string
	waitTimeout time.Duration
	staleAfter  time.Duration
	defaultSize int64
	logLevel    slog.Level
	logFormat   string
}

func newFlagSet(o *options) *flag.FlagSet {
	fs := flag.NewFlagSet("controller", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&o.endpoint, "endpoint", "unix:///csi/csi.sock", "CSI endpoint: unix:///path or tcp://host:port")
	fs.StringVar(&o.namespace, "namespace", os.Getenv("POD_NAMESPACE"), "namespace of the per-node publication Secrets (default $POD_NAMESPACE)")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "kubeconfig (default: $KUBECONFIG, in-cluster, ~/.kube/config)")
	fs.DurationVar(&o.waitTimeout, "wait-timeout", 60*time.Second, "how long a call waits for a storage agent")
	fs.DurationVar(&o.staleAfter, "stale-after", 2*time.Minute, "a storage node not heard of for this long gets no new volumes")
	fs.Int64Var(&o.defaultSize, "default-size", 1<<30, "size in bytes of a volume whose request names none")
	fs.Func("log-level", "debug, info, warn or error (default info)", func(s string) error {
		return o.logLevel.UnmarshalText([]byte(s))
	})
	fs.StringVar(&o.logFormat, "log-format", "text", "text or json")
	return fs
}

func parseArgs(args []string) (*options, error) {
	o := &options{}
	fs := newFlagSet(o)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	switch {
	case fs.NArg() > 0:
		return nil, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	case o.namespace == "":
		return nil, errors.New("--namespace is required (or set $POD_NAMESPACE)")
	case o.logFormat != "text" && o.logFormat != "json":
		return nil, fmt.Errorf("--log-format %q (want text or json)", o.logFormat)
	case o.waitTimeout <= 0 || o.staleAfter <= 0 || o.defaultSize <= 0:
		return nil, errors.New("--wait-timeout, --stale-after and --default-size must be positive")
	}
	if _, _, err := driver.ParseEndpoint(o.endpoint); err != nil {
		return nil, fmt.Errorf("--endpoint: %v", err)
	}
	return o, nil
}

func usage() string {
	var b strings.Builder
	b.WriteString("Usage: controller [flags]\n\nThe CSI controller plugin of " + driver.DriverName + ".\n\nFlags:\n")
	fs := newFlagSet(&options{})
	fs.SetOutput(&b)
	fs.PrintDefaults()
	return b.String()
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	o, err := parseArgs(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, usage())
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "controller: %v\nRun 'controller --help' for usage.\n", err)
		return 2
	}
	log := kubelog.Setup(stderr, o.logLevel, o.logFormat)
	if err := serve(ctx, o, log); err != nil {
		log.Error("controller failed", "error", err)
		return 1
	}
	return 0
}

func serve(ctx context.Context, o *options, log *slog.Logger) error {
	cfg, err := kubeconfig.Load(o.kubeconfig)
	if err != nil {
		return err
	}
	scheme := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(scheme); err != nil {
		return err
	}
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return err
	}
	c, err := client.New(cfg, client.Options{Scheme: scheme})
	if err != nil {
		return fmt.Errorf("API client: %w", err)
	}
	changes := driver.NewChanges()
	if err := driver.WatchChanges(ctx, cfg, scheme, changes, 30*time.Second); err != nil {
		// Without the watch every wait polls, as before.
		log.Warn("waits poll their volume every 200ms: no watch of volumes", "error", err)
		changes = nil
	}
	ctl, err := driver.NewController(driver.ControllerConfig{
		Changes:          changes,
		Client:           c,
		Namespace:        o.namespace,
		Logger:           log,
		WaitTimeout:      o.waitTimeout,
		StaleAfter:       o.staleAfter,
		DefaultSizeBytes: o.defaultSize,
	})
	if err != nil {
		return err
	}
	l, err := driver.Listen(o.endpoint)
	if err != nil {
		return err
	}
	s := driver.NewGRPCServer(log)
	csi.RegisterIdentityServer(s, &driver.Identity{
		// Ready while the API server answers and our resources exist.
		Ready: func(ctx context.Context) error {
			return c.List(ctx, &v1alpha1.NBDStorageNodeList{}, client.Limit(1))
		},
	})
	csi.RegisterControllerServer(s, ctl)
	log.Info("controller serving", "endpoint", o.endpoint, "namespace", o.namespace, "api_server", cfg.Host, "version", driver.Version)
	return driver.Serve(ctx, s, l, 30*time.Second)
}
