// cnitool: a small CNI runtime over libcni, for tabby's e2e tests.
//
// It does what a container runtime does with a network: load a conflist by network name from a
// directory, run ADD / CHECK / DEL of the whole chain with libcni (which caches the ADD result
// and hands it to CHECK and DEL as prevResult), and print what came back.
//
// Built in GOPATH mode against Debian's golang-github-appc-cni-dev (libcni 1.1.2) so that it
// needs nothing from the Go module proxy; see ../build.sh.
//
//	cnitool [flags] add|check|del <network> <netns>
//	cnitool [flags] validate <network>
//	cnitool [flags] cached <network>
//
// <netns> is a path, a name under /var/run/netns, or "" (DEL without a namespace, as containerd
// sends on RemovePodSandbox).
//
// Environment (flags win): NETCONFPATH (conflist dir), CNI_PATH (plugin dirs, ':'-separated),
// CNI_CACHE_DIR, CNI_IFNAME (default eth0), CNI_CONTAINERID (default: derived from <netns>),
// CNI_ARGS ("K=V;K=V"), CAP_ARGS (JSON object: runtimeConfig, e.g. {"portMappings": [...]}).
//
// Exit status 0 on success. On failure the reason goes to stderr and the exit status is 1; when
// the failure is a plugin's CNI error, that error's JSON ({"code","msg","details"}) is printed on
// stdout too, so callers can assert on the plugin's own code and message.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/containernetworking/cni/libcni"
	"github.com/containernetworking/cni/pkg/types"
)

const usage = `usage: cnitool [flags] add|check|del <network> <netns>
       cnitool [flags] validate|cached <network>
flags:
`

type options struct {
	confDir     string
	confFile    string
	pluginPath  string
	cacheDir    string
	ifName      string
	containerID string
	timeout     time.Duration
}

func envOr(name, def string) string {
	if v, ok := os.LookupEnv(name); ok && v != "" {
		return v
	}
	return def
}

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(argv []string) int {
	var o options
	fs := flag.NewFlagSet("cnitool", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(os.Stderr, usage)
		fs.PrintDefaults()
	}
	fs.StringVar(&o.confDir, "conf-dir", envOr("NETCONFPATH", "/etc/cni/net.d"), "directory of *.conflist files")
	fs.StringVar(&o.confFile, "conf-file", "", "load this conflist instead of searching --conf-dir by network name")
	fs.StringVar(&o.pluginPath, "path", envOr("CNI_PATH", "/opt/cni/bin"), "plugin directories, ':'-separated")
	fs.StringVar(&o.cacheDir, "cache-dir", envOr("CNI_CACHE_DIR", libcni.CacheDir), "libcni cache directory (results/ lives here)")
	fs.StringVar(&o.ifName, "ifname", envOr("CNI_IFNAME", "eth0"), "interface name inside the namespace")
	fs.StringVar(&o.containerID, "container-id", os.Getenv("CNI_CONTAINERID"), "container ID (default: derived from <netns>)")
	fs.DurationVar(&o.timeout, "timeout", 60*time.Second, "give up on the whole chain after this long")
	if err := fs.Parse(argv); err != nil {
		return 2
	}
	args := fs.Args()
	if len(args) < 2 {
		fs.Usage()
		return 2
	}
	verb, network := args[0], args[1]

	list, err := loadList(o, network)
	if err != nil {
		return fail(err)
	}
	cni := libcni.NewCNIConfigWithCacheDir(filepath.SplitList(o.pluginPath), o.cacheDir, nil)
	ctx, cancel := context.WithTimeout(context.Background(), o.timeout)
	defer cancel()

	switch verb {
	case "validate":
		caps, err := cni.ValidateNetworkList(ctx, list)
		if err != nil {
			return fail(err)
		}
		return printJSON(map[string]interface{}{"name": list.Name, "cniVersion": list.CNIVersion, "capabilities": caps})
	case "add", "check", "del", "cached":
	default:
		fs.Usage()
		return 2
	}

	netns := ""
	if len(args) >= 3 {
		netns = nsPath(args[2])
	} else if verb != "del" && verb != "cached" {
		fs.Usage()
		return 2
	}
	rt, err := runtimeConf(o, netns)
	if err != nil {
		return fail(err)
	}

	switch verb {
	case "add":
		result, err := cni.AddNetworkList(ctx, list, rt)
		if err != nil {
			return fail(err)
		}
		return printResult(result)
	case "check":
		if err := cni.CheckNetworkList(ctx, list, rt); err != nil {
			return fail(err)
		}
	case "del":
		if err := cni.DelNetworkList(ctx, list, rt); err != nil {
			return fail(err)
		}
	case "cached":
		result, err := cni.GetNetworkListCachedResult(list, rt)
		if err != nil {
			return fail(err)
		}
		if result == nil {
			return fail(fmt.Errorf("no cached result for %s/%s/%s", list.Name, rt.ContainerID, rt.IfName))
		}
		return printResult(result)
	}
	return 0
}

func loadList(o options, network string) (*libcni.NetworkConfigList, error) {
	if o.confFile != "" {
		list, err := libcni.ConfListFromFile(o.confFile)
		if err != nil {
			return nil, err
		}
		if list.Name != network {
			return nil, fmt.Errorf("%s defines network %q, not %q", o.confFile, list.Name, network)
		}
		return list, nil
	}
	return libcni.LoadConfList(o.confDir, network)
}

// nsPath turns a bare name into its /var/run/netns path; paths and "" pass through.
func nsPath(arg string) string {
	if arg == "" || strings.ContainsRune(arg, '/') {
		return arg
	}
	return filepath.Join("/var/run/netns", arg)
}

func runtimeConf(o options, netns string) (*libcni.RuntimeConf, error) {
	id := o.containerID
	if id == "" {
		if netns == "" {
			return nil, errors.New("CNI_CONTAINERID (or --container-id) is required without a netns")
		}
		sum := sha256.Sum256([]byte(netns))
		id = fmt.Sprintf("cnitool-%x", sum[:10])
	}
	rt := &libcni.RuntimeConf{
		ContainerID: id,
		NetNS:       netns,
		IfName:      o.ifName,
	}
	if raw := os.Getenv("CNI_ARGS"); raw != "" {
		for _, pair := range strings.Split(raw, ";") {
			if pair == "" {
				continue
			}
			kv := strings.SplitN(pair, "=", 2)
			if len(kv) != 2 {
				return nil, fmt.Errorf("CNI_ARGS: %q is not KEY=VALUE", pair)
			}
			rt.Args = append(rt.Args, [2]string{kv[0], kv[1]})
		}
	}
	if raw := os.Getenv("CAP_ARGS"); raw != "" {
		caps := map[string]interface{}{}
		if err := json.Unmarshal([]byte(raw), &caps); err != nil {
			return nil, fmt.Errorf("CAP_ARGS: %w", err)
		}
		rt.CapabilityArgs = caps
	}
	return rt, nil
}

func printResult(result types.Result) int {
	// Print in the version the chain produced, exactly as libcni cached it.
	if err := result.PrintTo(os.Stdout); err != nil {
		return fail(err)
	}
	return 0
}

func printJSON(v interface{}) int {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "    ")
	if err := enc.Encode(v); err != nil {
		return fail(err)
	}
	return 0
}

func fail(err error) int {
	fmt.Fprintf(os.Stderr, "cnitool: %v\n", err)
	var cniErr *types.Error
	if errors.As(err, &cniErr) {
		_ = json.NewEncoder(os.Stdout).Encode(cniErr)
	}
	return 1
}
