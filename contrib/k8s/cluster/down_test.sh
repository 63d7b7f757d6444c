#!/usr/bin/env bash
# `cluster.sh down` (which `up` runs first) on what a dead cluster leaves
# behind: a cluster process no pidfile names any more, a stale pidfile
# whose pid now belongs to an unrelated process, a volume still mounted
# under the run dir, a kubepods cgroup; a cluster process whose run dir
# was removed under it; and, for up, a port taken by another program. It
# runs in mount, pid and network
# namespaces of its own, with a tmpfs over /sys/fs/cgroup and /run/netns,
# so a live cluster on this machine is not touched.
#
#   contrib/k8s/cluster/down_test.sh [cluster.sh]     (root; make k8s-test)
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
script=${1:-$HERE/cluster.sh}
if [ "$(id -u)" != 0 ]; then
	echo "down_test: skipped: needs root (namespaces, mounts)"
	exit 0
fi
if [ "${KILN_K8S_DOWN_TEST_INSIDE:-}" != 1 ]; then
	exec env KILN_K8S_DOWN_TEST_INSIDE=1 unshare -m -p -n -f --mount-proc "$0" "$script"
fi

mount --make-rprivate /
mount -t tmpfs cgroups /sys/fs/cgroup
[ -d /run/netns ] && mount -t tmpfs netns /run/netns
ip link set lo up
t=$(mktemp -d /tmp/kiln-k8s-down-test.XXXXXX)
dir=$t/run bin=$t/bin
mkdir -p "$dir/pids" "$dir/logs" "$dir/kubelet/pods/p/volumes/v" "$bin" /sys/fs/cgroup/pids/kubepods/podx
: >"$dir/logs/etcd.log"
mount -t tmpfs volume "$dir/kubelet/pods/p/volumes/v"
# A stray "etcd" of the dead cluster: one of its binaries, the run dir on
# its command line, no pidfile.
cp "$(command -v tail)" "$bin/etcd"
"$bin/etcd" -f "$dir/logs/etcd.log" &
stray=$!
disown "$stray"
# An unrelated process that got the pid a stale pidfile names.
sleep 1000 &
other=$!
disown "$other"
echo "$other" >"$dir/pids/kube-apiserver.pid"

KILN_K8S_DIR=$dir KILN_K8S_GVISOR=0 "$script" down

gone() { [ ! -d "/proc/$1" ] || [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" = Z ]; }
fail=0
check() {
	if eval "$2"; then echo "ok: $1"; else
		echo "FAIL: $1"
		fail=1
	fi
}
check "the stray cluster process is killed" "gone $stray"
check "the unrelated process a stale pidfile names is left alone" "! gone $other"
check "the volume under the run dir is unmounted" "! grep -qF ' $dir/' /proc/self/mountinfo"
check "the run dir is removed" "[ ! -e '$dir' ]"
check "the kubepods cgroup is removed" "[ ! -e /sys/fs/cgroup/pids/kubepods ]"
kill -KILL "$other" "$stray" 2>/dev/null || true

# The run dir removed under a live cluster: its processes go all the same.
"$bin/etcd" -F "$dir/logs/etcd.log" 2>/dev/null &
stray=$!
disown "$stray"
KILN_K8S_DIR=$dir KILN_K8S_GVISOR=0 "$script" down
check "without a run dir, the stray cluster process is killed" "gone $stray"
kill -KILL "$stray" 2>/dev/null || true

# A port of the cluster's still taken after that (another program): up
# names it and starts nothing. Only where the binaries are built (up would
# build them first).
if [ -x "$(KILN_K8S_DIR=$dir "$script" env | sed -n 's/^KILN_K8S_KUBECTL=//p')" ]; then
	python3 -c 'import socket,time; s=socket.socket(); s.bind(("127.0.0.1", 2379)); s.listen(); time.sleep(1000)' &
	other=$!
	disown "$other"
	for _ in $(seq 50); do ss -Hltn "sport = :2379" | grep -q . && break; sleep 0.1; done
	out=$(KILN_K8S_DIR=$dir KILN_K8S_GVISOR=0 "$script" up 2>&1) && rc=0 || rc=$?
	check "up refuses to start on a taken port, and names it" "[ $rc != 0 ] && grep -q 'port 2379 is taken' <<<\"\$out\""
	check "up started nothing" "[ ! -e '$dir/pids' ] || [ -z \"\$(ls '$dir/pids')\" ]"
	kill -KILL "$other" 2>/dev/null || true
else
	echo "skip: up on a taken port (the cluster's binaries are not built)"
fi
rm -rf "$t"
exit $fail
