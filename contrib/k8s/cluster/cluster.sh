#!/usr/bin/env bash
# A one-node Kubernetes cluster built on this machine for kiln's tests
# (issue 17): etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler and kubelet built from the Go module proxy, containerd
# and runc from Debian, a registry on loopback, the standard CNI plugins,
# and kube-router in firewall-only mode, which enforces NetworkPolicy
# (the bridge CNI enforces none).
#
#   cluster.sh up      build what is missing (cached), start, wait Ready
#   cluster.sh down    stop everything, clean mounts, cgroups, netns, state
#   cluster.sh build   only build the binaries into the cache
#   cluster.sh status  is it up?  (exit 0 when the node is Ready)
#   cluster.sh env     the variables a test needs (KUBECONFIG, ...)
#
# Knobs: KILN_K8S_DIR (run dir, default /var/lib/kiln-k8s),
# KILN_K8S_CACHE (binaries, default ~/.cache/kiln/k8s),
# KILN_K8S_API_PORT (6443), KILN_K8S_REGISTRY_PORT (5000),
# KILN_K8S_ETCD_PORT (2379). Needs root. Logs are in $KILN_K8S_DIR/logs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PATH=/usr/local/go/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin:$PATH
export CGO_ENABLED=0

K8S_VERSION=v1.37.2
ETCD_VERSION=$(sed -n 's/^\tgo.etcd.io\/etcd\/server\/v3 \(v[^ ]*\).*/\1/p' "$HERE/etcd/go.mod")
DIR=${KILN_K8S_DIR:-/var/lib/kiln-k8s}
CACHE=${KILN_K8S_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kiln/k8s}
API_PORT=${KILN_K8S_API_PORT:-6443}
REG_PORT=${KILN_K8S_REGISTRY_PORT:-5000}
ETCD_PORT=${KILN_K8S_ETCD_PORT:-2379}
ETCD_PEER_PORT=$((ETCD_PORT + 1))
KUBE_BIN=$CACHE/$K8S_VERSION/bin
ETCD_BIN=$CACHE/etcd-$ETCD_VERSION/bin
TOOLS_BIN=$CACHE/tools-$(cat "$HERE/tools/go.mod" "$HERE/tools/go.sum" | sha256sum | cut -c1-12)/bin
# gVisor for the gvisor RuntimeClass: runsc and its containerd shim from
# the gVisor module kiln's go.mod pins (the gvisor backend's runsc).
GVISOR_VERSION=$(sed -n 's/^\tgvisor.dev\/gvisor \(v[^ ]*\).*/\1/p' "$HERE/../../../go.mod")
GVISOR_BIN=$CACHE/gvisor-$GVISOR_VERSION/bin
# kube-router, only its network policy controller (iptables and ipset).
KROUTER_VERSION=$(sed -n 's/^\tgithub.com\/cloudnativelabs\/kube-router\/v2 \(v[^ ]*\).*/\1/p' "$HERE/kuberouter/go.mod")
KROUTER_BIN=$CACHE/kube-router-$KROUTER_VERSION/bin
REGISTRY=localhost:$REG_PORT
PAUSE_IMAGE=$REGISTRY/kiln/pause:3.10
CTRD_SOCK=$DIR/containerd/containerd.sock
NODE=localhost
BRIDGE=kiln-k8s0
POD_CIDR=10.89.0.0/24
SVC_CIDR=10.96.0.0/24
# kube-router lets every Pod, even under a default-deny policy, reach the
# node's addresses on the NodePort range (that is how NodePort Services
# work): the tests use none, so the range is two ports, not 2768.
NODE_PORTS=30000-30001

log() { echo "k8s-cluster: $*" >&2; }
die() { log "$*"; exit 1; }

# A module's binaries are built once per version: a stamp holds the hash
# of the module's go.mod and go.sum and of the build flags.
build_module() { # dir outdir ldflags pkgs...
	local mod=$1 out=$2 ld=$3; shift 3
	local stamp sum
	sum=$(cat "$HERE/$mod/go.mod" "$HERE/$mod/go.sum" <(echo "$ld $*") | sha256sum | cut -c1-16)
	stamp=$out/.stamp
	if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sum" ]; then return 0; fi
	log "building $mod into $out (a cold Kubernetes build takes minutes)"
	mkdir -p "$out"
	(cd "$HERE/$mod" && nice go build -trimpath -ldflags "$ld" -o "$out/" "$@") >"$out/../build.log" 2>&1 ||
		{ tail -20 "$out/../build.log" >&2; die "build of $mod failed (log: $out/../build.log)"; }
	echo "$sum" >"$stamp"
}

build() {
	local ld="-s -w" p
	for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		ld="$ld -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=37 -X $p.gitTreeState=clean"
		ld="$ld -X $p.gitCommit=0000000000000000000000000000000000000000 -X $p.buildDate=1970-01-01T00:00:00Z"
	done
	build_module kube "$KUBE_BIN" "$ld" k8s.io/kubernetes/cmd/kube-apiserver \
		k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
		k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl
	build_module etcd "$ETCD_BIN" "-s -w" go.etcd.io/etcd/server/v3
	[ -x "$ETCD_BIN/etcd" ] || mv "$ETCD_BIN/server" "$ETCD_BIN/etcd"
	build_module tools "$TOOLS_BIN" "-s -w" \
		github.com/distribution/distribution/v3/cmd/registry \
		github.com/google/go-containerregistry/cmd/crane \
		github.com/containernetworking/plugins/plugins/main/bridge \
		github.com/containernetworking/plugins/plugins/main/loopback \
		github.com/containernetworking/plugins/plugins/ipam/host-local \
		github.com/containernetworking/plugins/plugins/meta/portmap \
		./pause ./probe ./mkimage
	build_module kuberouter "$KROUTER_BIN" \
		"-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KROUTER_VERSION" \
		github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
	[ "${KILN_K8S_GVISOR:-1}" = 0 ] || build_gvisor ||
		log "no gvisor RuntimeClass: runsc's shim did not build (log: $GVISOR_BIN/../build.log)"
}

# runsc (kiln's cached build when there is one: the same pin and flags)
# and containerd-shim-runsc-v1, both static.
build_gvisor() {
	[ -x "$GVISOR_BIN/runsc" ] && [ -x "$GVISOR_BIN/containerd-shim-runsc-v1" ] && return 0
	[ -n "$GVISOR_VERSION" ] || return 1
	log "building runsc's containerd shim $GVISOR_VERSION into $GVISOR_BIN"
	mkdir -p "$GVISOR_BIN"
	local cached=${XDG_CACHE_HOME:-$HOME/.cache}/kiln/bin/runsc-$GVISOR_VERSION pkgs=gvisor.dev/gvisor/shim@$GVISOR_VERSION tmp
	if [ -x "$cached" ]; then cp "$cached" "$GVISOR_BIN/runsc"; else pkgs="$pkgs gvisor.dev/gvisor/runsc@$GVISOR_VERSION"; fi
	tmp=$(mktemp -d /tmp/kiln-k8s-gvisor.XXXXXX)
	# shellcheck disable=SC2086
	(cd "$tmp" && GOBIN="$tmp" GOWORK=off GOFLAGS=-buildvcs=false nice go install -trimpath \
		-ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=$GVISOR_VERSION" $pkgs) \
		>"$GVISOR_BIN/../build.log" 2>&1 || { rm -rf "$tmp"; return 1; }
	[ -x "$tmp/runsc" ] && mv "$tmp/runsc" "$GVISOR_BIN/runsc"
	mv "$tmp/shim" "$GVISOR_BIN/containerd-shim-runsc-v1"
	rm -rf "$tmp"
}

# ---- processes: one pidfile each, so a crashed run's are found again ----

start_proc() { # name cmd...
	local name=$1; shift
	setsid "$@" >"$DIR/logs/$name.log" 2>&1 </dev/null &
	echo $! >"$DIR/pids/$name.pid"
}

# alive: pidfile → the pid, if that process still runs and is ours (its
# command line names the run dir): after a reboot or a crash a pidfile may
# name a pid the kernel gave to an unrelated process, which must not be
# taken for a live cluster nor killed.
alive() {
	local f=$1 pid
	[ -f "$f" ] || return 1
	pid=$(cat "$f")
	[ -n "$pid" ] && [ -d "/proc/$pid" ] || return 1
	{ tr '\0' ' ' <"/proc/$pid/cmdline"; } 2>/dev/null | grep -qF -- "$DIR/" || return 1
	echo "$pid"
}

stop_procs() { # names...: TERM to all at once, KILL what is left after 5 s
	local n pid i left pids=()
	for n; do
		if pid=$(alive "$DIR/pids/$n.pid"); then
			kill -TERM "$pid" 2>/dev/null || true
			pids+=("$pid")
		fi
		rm -f "$DIR/pids/$n.pid"
	done
	for i in $(seq 50); do
		left=""
		for pid in "${pids[@]}"; do [ -d "/proc/$pid" ] && left="$left $pid"; done
		[ -z "$left" ] && return 0
		sleep 0.1
	done
	# shellcheck disable=SC2086
	kill -KILL $left 2>/dev/null || true
}

# Our containerd's shims (started with -address $CTRD_SOCK), which a
# crashed containerd leaves behind, and the processes of our Pods (in the
# kubelet's cgroups), which a crashed shim leaves behind.
leftover_pids() {
	local p
	for p in /proc/[0-9]*; do
		{ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- " $CTRD_SOCK " && echo "${p#/proc/}"
	done
	for p in /proc/[0-9]*; do
		{ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- " $DIR/kube-router.kubeconfig " && echo "${p#/proc/}"
	done
	for p in /sys/fs/cgroup/pids/kubepods /sys/fs/cgroup/kubepods; do
		[ -d "$p" ] && find "$p" -name cgroup.procs -exec cat {} + 2>/dev/null
	done
	# The cluster's own processes that no pidfile names any more (a run
	# dir removed under a live cluster, a crash while starting): one of
	# its binaries with the run dir on its command line.
	local cmd
	for p in /proc/[0-9]*; do
		cmd=$({ tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null) || continue
		case "${cmd%% *}" in
		*/etcd | */kube-apiserver | */kube-controller-manager | */kube-scheduler | */kubelet | */kube-router | */registry | containerd | */containerd) ;;
		*) continue ;;
		esac
		case "$cmd" in *" $DIR/"* | *"=$DIR/"*) echo "${p#/proc/}" ;; esac
	done
	return 0
}

wait_for() { # what seconds cmd...
	local what=$1 secs=$2 i; shift 2
	for i in $(seq $((secs * 10))); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	die "$what not ready after ${secs}s (logs in $DIR/logs)"
}

# ---- down ----

# down also runs without a run dir: what a dead cluster left outside it
# (processes, netns, the bridge, cgroups) goes all the same.
down() {
	local ns c pid m i left pids
	stop_procs kube-router kubelet kube-scheduler kube-controller-manager kube-apiserver etcd
	# Containers: kill every task containerd runs for us, then containerd.
	if alive "$DIR/pids/containerd.pid" >/dev/null && [ -S "$CTRD_SOCK" ]; then
		for ns in $(ctr -a "$CTRD_SOCK" namespaces ls -q 2>/dev/null); do
			for c in $(ctr -a "$CTRD_SOCK" -n "$ns" tasks ls -q 2>/dev/null); do
				ctr -a "$CTRD_SOCK" -n "$ns" tasks kill -s SIGKILL "$c" >/dev/null 2>&1 || true
			done
		done
	fi
	stop_procs containerd registry
	# Then the rest, and wait for it to be gone (its mounts, ports, cgroups).
	pids=$(leftover_pids | sort -u)
	for pid in $pids; do kill -KILL "$pid" 2>/dev/null || true; done
	for i in $(seq 50); do
		left=""
		for pid in $pids; do [ -d "/proc/$pid" ] && left="$left $pid"; done
		[ -z "$left" ] && break
		sleep 0.1
	done
	[ -z "$left" ] || log "processes still there after SIGKILL:$left"
	netpol_clean
	# Mounts under the run dir (overlay rootfs, kubelet volumes), deepest first.
	for m in $(awk -v d="$DIR/" 'index($5, d) == 1 {print $5}' /proc/self/mountinfo | sort -r); do
		umount -l "$m" 2>/dev/null || true
	done
	# Network namespaces containerd made for our Pods, if no process is in them.
	if [ -d /run/netns ]; then
		for ns in /run/netns/cni-*; do
			[ -e "$ns" ] || continue
			[ -z "$(ip netns pids "$(basename "$ns")" 2>/dev/null)" ] && ip netns delete "$(basename "$ns")" 2>/dev/null || true
		done
	fi
	ip link delete "$BRIDGE" 2>/dev/null || true
	# The kubelet's cgroups (cgroupfs driver: /kubepods in each hierarchy);
	# a cgroup whose last task is still exiting refuses rmdir for a moment.
	for i in 1 2 3 4 5; do
		left=""
		for c in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/*/kubepods.slice; do
			[ -d "$c" ] || continue
			find "$c" -depth -type d -exec rmdir {} + 2>/dev/null || left="$left $c"
		done
		[ -z "$left" ] && break
		sleep 1
	done
	[ -z "$left" ] || log "cgroups left:$left"
	rm -rf "$DIR"
}

# ---- NetworkPolicy: kube-router's firewall only ----

# kube-router's network policy controller turns each NetworkPolicy into
# iptables chains (KUBE-ROUTER-INPUT/FORWARD/OUTPUT, a KUBE-POD-FW-* chain
# per Pod, KUBE-NWPLCY-* per policy) and ipsets (KUBE-SRC-*, KUBE-DST-*).

# What kube-router's informers read, and no more.
netpol_rbac() {
	cat <<EOF
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:kube-router"}
rules:
- apiGroups: [""]
  resources: [namespaces, pods, services, nodes, endpoints]
  verbs: [get, list, watch]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:kube-router"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kube-router"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: "system:kube-router"}
EOF
}

# Pods on the bridge are switched, not routed: br_netfilter must pass
# their frames through iptables or Pod to Pod traffic skips the policy.
netpol_start() {
	[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] || modprobe br_netfilter 2>/dev/null ||
		die "no br_netfilter: Pod to Pod traffic on the bridge would bypass NetworkPolicy"
	[ -e /proc/sys/net/bridge/bridge-nf-call-iptables ] || die "no /proc/sys/net/bridge/bridge-nf-call-iptables"
	echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
	netpol_rbac | "$KUBE_BIN/kubectl" --kubeconfig "$DIR/admin.kubeconfig" apply -f - >/dev/null
	# The Node object must exist (kube-router reads its InternalIP to tell
	# this node's Pods); no router, no service proxy, no health or
	# metrics listener.
	start_proc kube-router "$KROUTER_BIN/kube-router" \
		--kubeconfig "$DIR/kube-router.kubeconfig" --hostname-override "$NODE" \
		--run-firewall=true --run-router=false --run-service-proxy=false \
		--service-cluster-ip-range "$SVC_CIDR" --service-node-port-range "$NODE_PORTS" --health-port 0 --metrics-port 0 -v 1
	# Synced: its first full sync of the policies into iptables is done.
	wait_for kube-router 60 grep -q "sync iptables took" "$DIR/logs/kube-router.log"
}

# What a kube-router that is gone left in iptables and ipset: stale rules
# for Pod IPs that new Pods would be given again. (Not kube-router
# --cleanup-config: it also flushes every IPVS service on the host.)
netpol_clean() {
	local chains s
	command -v iptables-save >/dev/null || return 0
	chains=$(iptables-save -t filter | sed -n 's/^:\(KUBE-ROUTER-[A-Z]*\|KUBE-POD-FW-[A-Z0-9]*\|KUBE-NWPLCY-[A-Z0-9]*\) .*/\1/p')
	if [ -n "$chains" ]; then
		{
			echo "*filter"
			iptables-save -t filter | grep -E '^-A (INPUT|FORWARD|OUTPUT) .*-j KUBE-ROUTER-(INPUT|FORWARD|OUTPUT)$' | sed 's/^-A/-D/'
			for s in $chains; do echo "-F $s"; done
			for s in $chains; do echo "-X $s"; done
			echo COMMIT
		} | iptables-restore --noflush || log "could not remove kube-router's iptables chains"
	fi
	command -v ipset >/dev/null || return 0
	for s in $(ipset list -n 2>/dev/null | grep -E '^(KUBE-SRC-|KUBE-DST-)'); do
		ipset destroy "$s" 2>/dev/null || true
	done
}

# ---- up ----

# Up: the node is Ready and kube-router enforces NetworkPolicy.
status() {
	alive "$DIR/pids/kube-router.pid" >/dev/null && node_ready
}

# Ready, and with the Hostname address the apiserver reaches the kubelet
# by (exec, attach, logs). The node IP is left to the kubelet: it refuses
# a loopback one and then publishes no address at all.
# Every process of the cluster must be alive too: a dead etcd, containerd
# or registry is not a cluster to reuse.
node_ready() {
	local n
	[ -f "$DIR/admin.kubeconfig" ] || return 1
	for n in registry etcd containerd kube-apiserver kube-controller-manager kube-scheduler kubelet; do
		alive "$DIR/pids/$n.pid" >/dev/null || return 1
	done
	"$KUBE_BIN/kubectl" --kubeconfig "$DIR/admin.kubeconfig" get node "$NODE" \
			-o jsonpath='{.status.conditions[?(@.type=="Ready")].status} {.status.addresses[?(@.type=="Hostname")].address}' \
			2>/dev/null | grep -qx "True $NODE"
}

cert() { # name CN O [SANs]
	local name=$1 cn=$2 o=$3 san=${4:-} pki=$DIR/pki subj="/CN=$2"
	[ -n "$o" ] && subj="/O=$o$subj"
	openssl genrsa -out "$pki/$name.key" 2048 2>/dev/null
	openssl req -new -key "$pki/$name.key" -subj "$subj" -out "$pki/$name.csr" 2>/dev/null
	{
		echo "basicConstraints=CA:FALSE"
		echo "keyUsage=critical,digitalSignature,keyEncipherment"
		echo "extendedKeyUsage=serverAuth,clientAuth"
		[ -n "$san" ] && echo "subjectAltName=$san"
	} >"$pki/$name.ext"
	openssl x509 -req -in "$pki/$name.csr" -CA "$pki/ca.crt" -CAkey "$pki/ca.key" -CAcreateserial \
		-days 3650 -sha256 -extfile "$pki/$name.ext" -out "$pki/$name.crt" 2>/dev/null
	rm -f "$pki/$name.csr" "$pki/$name.ext"
}

kubeconfig() { # file user
	cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: kiln
  cluster:
    server: https://127.0.0.1:$API_PORT
    certificate-authority: $DIR/pki/ca.crt
users:
- name: $2
  user:
    client-certificate: $DIR/pki/$2.crt
    client-key: $DIR/pki/$2.key
contexts:
- name: kiln
  context: {cluster: kiln, user: $2}
current-context: kiln
EOF
}

pki() {
	local p=$DIR/pki
	mkdir -p "$p"
	openssl genrsa -out "$p/ca.key" 2048 2>/dev/null
	openssl req -x509 -new -key "$p/ca.key" -subj "/CN=kiln-k8s-ca" -days 3650 -sha256 -out "$p/ca.crt" 2>/dev/null
	cert apiserver kube-apiserver "" "DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,IP:127.0.0.1,IP:10.96.0.1"
	cert admin kubernetes-admin system:masters
	cert apiserver-kubelet-client kube-apiserver-kubelet-client system:masters
	cert controller-manager system:kube-controller-manager ""
	cert scheduler system:kube-scheduler ""
	cert kubelet-client "system:node:$NODE" system:nodes
	cert kubelet "$NODE" "" "DNS:$NODE,IP:127.0.0.1"
	cert kube-router system:kube-router ""
	openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
	openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
	kubeconfig "$DIR/admin.kubeconfig" admin
	kubeconfig "$DIR/controller-manager.kubeconfig" controller-manager
	kubeconfig "$DIR/scheduler.kubeconfig" scheduler
	kubeconfig "$DIR/kubelet.kubeconfig" kubelet-client
	kubeconfig "$DIR/kube-router.kubeconfig" kube-router
}

containerd_config() {
	local c=$DIR/containerd
	mkdir -p "$c/certs.d/$REGISTRY" "$c/certs.d/127.0.0.1:$REG_PORT" "$DIR/cni/net.d"
	for h in "$REGISTRY" "127.0.0.1:$REG_PORT"; do
		cat >"$c/certs.d/$h/hosts.toml" <<EOF
server = "http://127.0.0.1:$REG_PORT"
[host."http://127.0.0.1:$REG_PORT"]
  capabilities = ["pull", "resolve"]
EOF
	done
	local runsc=""
	if have_gvisor; then
		runsc="
[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runsc]
  runtime_type = \"io.containerd.runsc.v1\"
[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runsc.options]
  TypeUrl = \"io.containerd.runsc.v1.options\"
  ConfigPath = \"$c/runsc.toml\""
		cat >"$c/runsc.toml" <<EOF
binary_name = "$GVISOR_BIN/runsc"
root = "$DIR/runsc"
[runsc_config]
  platform = "systrap"
EOF
	fi
	cat >"$c/config.toml" <<EOF
version = 2
root = "$c/root"
state = "$c/state"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "$CTRD_SOCK"
[ttrpc]
  address = "$c/containerd.sock.ttrpc"
[debug]
  address = "$c/debug.sock"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$PAUSE_IMAGE"
  restrict_oom_score_adj = true
  enable_unprivileged_ports = false
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = false
  BinaryName = "$(command -v runc)"
$runsc
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "$TOOLS_BIN"
  conf_dir = "$DIR/cni/net.d"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "$c/certs.d"
EOF
	cat >"$DIR/cni/net.d/10-kiln.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "kiln-k8s",
  "plugins": [
    {
      "type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false,
      "hairpinMode": true,
      "ipam": {"type": "host-local", "dataDir": "$DIR/cni/ipam",
               "ranges": [[{"subnet": "$POD_CIDR"}]], "routes": [{"dst": "0.0.0.0/0"}]}
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

kubelet_config() {
	cat >"$DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
healthzBindAddress: 127.0.0.1
readOnlyPort: 0
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $DIR/pki/ca.crt}
authorization: {mode: Webhook}
tlsCertFile: $DIR/pki/kubelet.crt
tlsPrivateKeyFile: $DIR/pki/kubelet.key
cgroupDriver: cgroupfs
failCgroupV1: false
failSwapOn: false
containerRuntimeEndpoint: unix://$CTRD_SOCK
clusterDomain: cluster.local
resolvConf: /etc/resolv.conf
serializeImagePulls: false
evictionHard: {memory.available: 100Mi, nodefs.available: 1%, imagefs.available: 1%, nodefs.inodesFree: 1%}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
maxPods: 250
# A node-level backstop: no Pod (all its containers) runs more than 1024
# processes and threads, whatever its code does. A box's own, lower limit
# is kiln's (RLIMIT_NPROC in the agent); this one holds if that fails.
podPidsLimit: 1024
EOF
}

# runsc's shim lowers its own oom_score_adj to -999 at start and fails
# when it may not (no CAP_SYS_RESOURCE, as in some VMs and containers):
# there the gvisor RuntimeClass could start no Pod, so it is left out.
have_gvisor() {
	[ "${KILN_K8S_GVISOR:-1}" != 0 ] && [ -x "$GVISOR_BIN/containerd-shim-runsc-v1" ] && [ -x "$GVISOR_BIN/runsc" ] &&
		cap_sys_resource
}

cap_sys_resource() {
	local eff
	eff=$(sed -n 's/^CapEff:[[:space:]]*//p' /proc/self/status)
	(((0x$eff >> 24) & 1))
}

# RuntimeClasses for the handlers containerd has: runc always, gvisor
# when runsc's shim was built (the operator's manifest,
# contrib/kubernetes/runtimeclass.yaml).
runtimeclasses() {
	printf 'apiVersion: node.k8s.io/v1\nkind: RuntimeClass\nmetadata: {name: runc}\nhandler: runc\n'
	if have_gvisor; then
		printf -- '---\n'
		cat "$HERE/../../kubernetes/runtimeclass.yaml"
	fi
}

up() {
	[ "$(id -u)" = 0 ] || die "needs root"
	local missing="" p
	for p in containerd runc iptables ipset curl openssl; do command -v $p >/dev/null || missing="$missing $p"; done
	if [ -n "$missing" ]; then
		log "installing$missing from Debian"
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
	fi
	build
	if status; then
		log "already up"
		echo "$DIR/admin.kubeconfig"
		return 0
	fi
	# Anything left of an earlier run (crashed or half up) goes first;
	# a port still taken then is another program's, named here.
	down
	local port who
	for port in "$API_PORT" "$ETCD_PORT" "$ETCD_PEER_PORT" "$REG_PORT" 10248 10250 10257 10259; do
		who=$(ss -Hltnp "sport = :$port" 2>/dev/null) || continue
		[ -z "$who" ] || die "port $port is taken (KILN_K8S_*_PORT choose others; 10248-10259 are the kubelet's, controller-manager's and scheduler's): $who"
	done
	mkdir -p "$DIR/logs" "$DIR/pids" "$DIR/etcd" "$DIR/registry"
	local t0 kc=$DIR/admin.kubeconfig k
	t0=$(date +%s%N)
	pki
	containerd_config
	kubelet_config

	cat >"$DIR/registry.yml" <<EOF
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $DIR/registry}, delete: {enabled: true}}
http: {addr: 127.0.0.1:$REG_PORT}
EOF
	start_proc registry "$TOOLS_BIN/registry" serve "$DIR/registry.yml"
	start_proc etcd "$ETCD_BIN/etcd" --name kiln --data-dir "$DIR/etcd" \
		--listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
		--listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
		--initial-cluster "kiln=http://127.0.0.1:$ETCD_PEER_PORT" --log-level warn \
		--unsafe-no-fsync --quota-backend-bytes 2147483648
	start_proc containerd env PATH="$GVISOR_BIN:$PATH" containerd --config "$DIR/containerd/config.toml"

	# The sandbox image: Kubernetes' pause is on a registry this machine
	# may not reach, so a static one built here is pushed to ours.
	wait_for registry 30 curl -fsS "http://127.0.0.1:$REG_PORT/v2/"
	if ! "$TOOLS_BIN/crane" digest --insecure "$PAUSE_IMAGE" >/dev/null 2>&1; then
		"$TOOLS_BIN/mkimage" -ref "$PAUSE_IMAGE" -entrypoint /pause -user 65535:65535 "pause=$TOOLS_BIN/pause" >/dev/null
	fi

	wait_for etcd 30 curl -fsS "http://127.0.0.1:$ETCD_PORT/health"
	local adv
	adv=$(ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p')
	start_proc kube-apiserver "$KUBE_BIN/kube-apiserver" \
		--etcd-servers "http://127.0.0.1:$ETCD_PORT" \
		--bind-address 127.0.0.1 --secure-port "$API_PORT" ${adv:+--advertise-address "$adv"} \
		--service-cluster-ip-range "$SVC_CIDR" --service-node-port-range "$NODE_PORTS" \
		--client-ca-file "$DIR/pki/ca.crt" \
		--tls-cert-file "$DIR/pki/apiserver.crt" --tls-private-key-file "$DIR/pki/apiserver.key" \
		--kubelet-client-certificate "$DIR/pki/apiserver-kubelet-client.crt" \
		--kubelet-client-key "$DIR/pki/apiserver-kubelet-client.key" \
		--kubelet-certificate-authority "$DIR/pki/ca.crt" \
		--kubelet-preferred-address-types Hostname,InternalIP,ExternalIP \
		--service-account-issuer https://kubernetes.default.svc.cluster.local \
		--service-account-key-file "$DIR/pki/sa.pub" \
		--service-account-signing-key-file "$DIR/pki/sa.key" \
		--authorization-mode Node,RBAC --allow-privileged=true --profiling=false \
		--enable-admission-plugins NodeRestriction
	wait_for containerd 30 ctr -a "$CTRD_SOCK" version
	wait_for kube-apiserver 60 "$KUBE_BIN/kubectl" --kubeconfig "$kc" get --raw /readyz

	start_proc kube-controller-manager "$KUBE_BIN/kube-controller-manager" \
		--kubeconfig "$DIR/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$DIR/controller-manager.kubeconfig" \
		--authorization-kubeconfig "$DIR/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false \
		--service-account-private-key-file "$DIR/pki/sa.key" --root-ca-file "$DIR/pki/ca.crt" \
		--cluster-signing-cert-file "$DIR/pki/ca.crt" --cluster-signing-key-file "$DIR/pki/ca.key" \
		--use-service-account-credentials=true --service-cluster-ip-range "$SVC_CIDR"
	start_proc kube-scheduler "$KUBE_BIN/kube-scheduler" \
		--kubeconfig "$DIR/scheduler.kubeconfig" \
		--authentication-kubeconfig "$DIR/scheduler.kubeconfig" \
		--authorization-kubeconfig "$DIR/scheduler.kubeconfig" \
		--bind-address 127.0.0.1 --leader-elect=false
	start_proc kubelet "$KUBE_BIN/kubelet" \
		--config "$DIR/kubelet.yaml" --kubeconfig "$DIR/kubelet.kubeconfig" \
		--root-dir "$DIR/kubelet" --hostname-override "$NODE"
	wait_for "node $NODE" 120 node_ready
	netpol_start
	[ "${KILN_K8S_GVISOR:-1}" = 0 ] || cap_sys_resource ||
		log "no gvisor RuntimeClass: without CAP_SYS_RESOURCE runsc's shim cannot start (it sets oom_score_adj -999)"
	runtimeclasses | "$KUBE_BIN/kubectl" --kubeconfig "$kc" apply -f - >/dev/null
	k=$((($(date +%s%N) - t0) / 1000000))
	log "up in $((k / 1000)).$(printf %03d $((k % 1000)))s; logs in $DIR/logs; kubectl: $KUBE_BIN/kubectl"
	echo "$kc"
}

env_() {
	echo "KUBECONFIG=$DIR/admin.kubeconfig"
	echo "KILN_K8S_KUBECTL=$KUBE_BIN/kubectl"
	echo "KILN_K8S_REGISTRY=$REGISTRY"
	echo "KILN_K8S_CRANE=$TOOLS_BIN/crane"
	echo "KILN_K8S_SECCOMP_DIR=$DIR/kubelet/seccomp"
	echo "KILN_K8S_TOOLS=$TOOLS_BIN"
	# The node's address on the Pods' bridge (the bridge plugin's gateway).
	echo "KILN_K8S_POD_GATEWAY=${POD_CIDR%.*}.1"
}

case "${1:-}" in
up) up ;;
down) down ;;
build) build ;;
status) status ;;
env) env_ ;;
*) die "usage: $0 up|down|build|status|env" ;;
esac
