# kiln — build, run, test. Everything static, no cgo (the agent must run in
# any rootfs, and the jail's init uses all-thread syscalls).
export CGO_ENABLED := 0
# `make -C <dir> run` must not print "Entering directory" on the stdout
# that is the MCP client's.
MAKEFLAGS += --no-print-directory
GO      ?= go
BIN     := bin
APT_RUNTIME := python3 python3-numpy python3-pandas python3-matplotlib python3-dill python3-pip
APT_TEST    := iproute2 nftables curl qemu-system-x86 debootstrap e2fsprogs systemd uidmap bubblewrap python3-ipykernel python3-jupyter-client
# The field-host VM: QEMU boots it, debootstrap builds it, mkfs.ext4 packs
# its disks and debugfs reads the results back.
APT_FIELDHOST := qemu-system-x86 debootstrap e2fsprogs

.PHONY: all build build-full depaware run serve demo test test-go test-e2e conformance deps deps-runtime deps-test s3-server runsc wasm lint race fuzz k8s-cluster k8s-down k8s-test k8s-e2e fieldhost-test fieldhost-image deps-fieldhost clean

all: build

# The default kiln leaves out what most hosts never use: the kubernetes
# backend (client-go) and OCI push (go-containerregistry), which would
# double its size and its cold build. build-full builds them in, by their
# build tags (internal/cli/features.go); the kubernetes tests, CI's cluster
# path and a kiln for a Deployment use it.
FULL_TAGS := kiln_kubernetes,kiln_oci,kiln_s3

build:
	@$(GO) build -o $(BIN)/ ./cmd/kiln ./cmd/kiln-agent >&2

build-full:
	@$(GO) build -tags $(FULL_TAGS) -o $(BIN)/ ./cmd/kiln ./cmd/kiln-agent >&2

# Each binary's dependency list, per build variant, is checked in
# (cmd/kiln/depaware.txt, depaware-full.txt, cmd/kiln-agent/depaware.txt)
# as tailscale's depaware does; make lint fails when one is stale, and
# this rewrites them (commit them saying why the dependencies changed).
depaware:
	$(GO) test -count=1 -run '^TestDepaware$$' ./cmd/kiln -update

# The sandbox's Python runtime comes from Debian (the host's /usr is what
# the jail binds read-only into every box). Nothing here writes to stdout
# or reads stdin: `make run` is what an MCP client starts, and its stdout
# and stdin are the protocol's. Without root nothing is installed: the
# exact command to run is printed, and make stops.
define apt_need
@missing=$$(for p in $(1); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		missing=$$(echo $$missing); \
		if [ "$$(id -u)" != 0 ]; then \
			echo "kiln needs Debian packages that are not installed; run:" >&2; \
			echo "  sudo apt-get install $$missing" >&2; \
			exit 1; \
		fi; \
		echo "installing $$missing" >&2; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; } </dev/null >&2; \
	fi
endef

deps-runtime:
	$(call apt_need,$(APT_RUNTIME))

deps-test: deps-runtime s3-server
	$(call apt_need,$(APT_TEST))
	cd e2e && npm ci --no-audit --no-fund --loglevel=error
	cd e2e/conformance && npm ci --no-audit --no-fund --loglevel=error

deps: deps-runtime

# The S3 server the shared-saves tests run against: versitygw (Apache-2.0,
# a POSIX directory as its store), built from the Go module proxy at a
# pinned version into kiln's cache (about 2 minutes cold), found there by
# internal/sharedsaves/s3test.
VERSITYGW_VERSION := v1.8.0
VERSITYGW := $(HOME)/.cache/kiln/tools/versitygw-$(VERSITYGW_VERSION)/versitygw
s3-server:
	@test -x $(VERSITYGW) || { echo "building versitygw $(VERSITYGW_VERSION) (the tests' S3 server)" >&2; \
		GOBIN=$(dir $(VERSITYGW)) CGO_ENABLED=0 $(GO) install github.com/versity/versitygw/cmd/versitygw@$(VERSITYGW_VERSION) >&2; }

# The main job: kiln as an MCP server on stdio, on the jail backend.
# make prints nothing of its own here: its recipes are silent, and
# --no-print-directory (above) keeps "Entering directory" off stdout under -C.
run: deps-runtime build
	@exec $(BIN)/kiln mcp

serve: deps-runtime build
	exec $(BIN)/kiln serve --addr 127.0.0.1:8080

demo: deps-runtime build
	$(BIN)/kiln run --images . -c 'import matplotlib.pyplot as plt; p=[n for n in range(2,80) if all(n%d for d in range(2,n))][:20]; print(p); plt.plot([b-a for a,b in zip(p,p[1:])], marker="o"); plt.title("gaps between the first 20 primes"); plt.show()'

# The test command (README, .ci/run). It tests the full kiln: the e2e
# suite's kubernetes test needs its backend and OCI push, and the packages
# whose registration the tags select (cli, cmd) run both ways.
test: deps-test build-full test-go test-e2e conformance

test-go: export KILN_TEST_S3 := 1
test-go: export KILN_VERSITYGW := $(VERSITYGW)
test-go:
	$(GO) test -count=1 -timeout 30m ./...
	$(GO) test -count=1 -timeout 10m -tags $(FULL_TAGS) ./internal/cli ./cmd/...

test-e2e: build-full
	cd e2e && KILN_TEST_S3=1 KILN_VERSITYGW=$(VERSITYGW) KILN_BIN=$(CURDIR)/$(BIN)/kiln node --test --test-concurrency=1

# The official MCP conformance suite (server mode) against kiln serve,
# without and with a token; e2e/conformance/expected-failures.yml lists
# the scenarios that need the suite's own fixtures. Needs `make deps-test`
# (npm ci in e2e/conformance, which brings Node 22 from npm).
conformance: build-full
	cd e2e/conformance && KILN_BIN=$(CURDIR)/$(BIN)/kiln node run.mjs

# Habits CI keeps: formatting, vet for linux and darwin (the darwin stubs
# must keep compiling), both without and with the optional features'
# tags, staticcheck (pinned in go.mod as a Go tool), a tidy go.mod, and
# current dependency lists (make depaware).
lint:
	@out=$$(gofmt -l cmd internal contrib); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	GOOS=darwin $(GO) vet ./...
	$(GO) vet -tags $(FULL_TAGS) ./internal/cli ./cmd/...
	GOOS=darwin $(GO) vet -tags $(FULL_TAGS) ./internal/cli ./cmd/...
	$(GO) tool staticcheck ./...
	$(GO) tool staticcheck -tags $(FULL_TAGS) ./internal/cli ./cmd/...
	$(GO) mod tidy -diff
	$(GO) test -count=1 -run '^TestDepaware$$' ./cmd/kiln

# The race detector needs cgo. Only packages whose tests start no sandbox:
# the others need root and real boxes, whose timing the detector's slowdown
# breaks.
RACE_PKGS := ./cmd/kiln-agent ./internal/agent ./internal/agentproto ./internal/guestinit \
	./internal/sandbox ./internal/image ./internal/bench ./internal/cli ./internal/audit ./internal/metrics ./internal/oauth
race: deps-runtime
	CGO_ENABLED=1 $(GO) test -race -count=1 -timeout 15m $(RACE_PKGS)

# A short run of every fuzzer, found by name so a new one is run too.
# A count, not a duration: with a duration the fuzz coordinator can report
# its own deadline ("context deadline exceeded") as a failure, which failed
# CI once with no bug found.
FUZZTIME ?= 100000x
fuzz:
	@set -e; grep -rl --include='*_test.go' '^func Fuzz' cmd internal | sort | while read -r f; do \
		for fz in $$(sed -n 's/^func \(Fuzz[A-Za-z0-9_]*\)(.*/\1/p' $$f); do \
			echo "fuzz $$fz ./$$(dirname $$f)"; \
			$(GO) test -run='^$$' -fuzz="^$$fz$$" -fuzztime=$(FUZZTIME) ./$$(dirname $$f); \
		done; \
	done

runsc:
	KILN_TEST_GVISOR=1 $(GO) test ./internal/sandbox/gvisor -run '^TestEnsureRunsc$$' -count=1 -timeout 30m

# The wasm backend's pinned Deno and Pyodide, fetched with npm into kiln's
# cache and checked against their pinned sha512 (about 50 MB).
wasm: build
	$(BIN)/kiln wasm install

# A one-node Kubernetes cluster built here for the kubernetes backend's
# tests (issue 17): contrib/k8s/cluster/cluster.sh builds its binaries
# once into ~/.cache/kiln/k8s, starts it and prints the kubeconfig path;
# `cluster.sh env` prints KUBECONFIG and the registry for tests.
# k8s-test checks that `down` cleans what a dead cluster leaves (in
# namespaces of its own), pushes an image to its registry and runs, execs
# into and deletes a Pod. Needs root, containerd and runc (apt-get).
K8S_CLUSTER := contrib/k8s/cluster/cluster.sh
k8s-cluster:
	@$(K8S_CLUSTER) up

k8s-down:
	@$(K8S_CLUSTER) down

k8s-test: k8s-cluster
	contrib/k8s/cluster/down_test.sh
	cd contrib/k8s/cluster/tools && env $$(../cluster.sh env) KILN_K8S_SMOKE=1 $(GO) test -count=1 -v ./smoke

# k8s-e2e: e2e/kubernetes.test.mjs alone on the cluster (a real MCP client
# through two kiln serve replicas); `make test` runs it with KILN_TEST_K8S=1.
k8s-e2e: build-full k8s-cluster
	cd e2e && env $$(../$(K8S_CLUSTER) env) KILN_TEST_K8S=1 KILN_BIN=$(CURDIR)/$(BIN)/kiln node --test --test-concurrency=1 kubernetes.test.mjs

# The field-host VM (issue 24, contrib/fieldhost): a Debian bookworm guest
# with systemd as PID 1 on cgroup v2 alone, Landlock and user namespaces,
# and an ordinary user with subuid ranges, lingering and delegated
# controllers; built once and cached by a hash of its inputs under
# ~/.cache/kiln/fieldhost (a cold build takes about 10 minutes), booted
# under QEMU (KVM where a guest boots under it, else TCG). It runs the
# jail's battery, the cgroup v2 limits, the orphan sweep and the systemd
# unit as root, and the battery again as the user in a systemd session.
# Each suite's result, time and log land in bin/fieldhost/results.
# FIELDHOST_FLAGS="-suites systemd-unit" runs some only.
deps-fieldhost:
	$(call apt_need,$(APT_FIELDHOST))

fieldhost-test: deps-fieldhost
	$(GO) run ./contrib/fieldhost $(FIELDHOST_FLAGS)

# The image alone (printing its directory), so CI can build it while other
# tests run.
fieldhost-image: deps-fieldhost
	@$(GO) run ./contrib/fieldhost -build-only

clean:
	rm -rf $(BIN)

# A kiln for `kiln bench`'s hardening rows only: built with the tag
# kiln_benchknobs, it reads KILN_BENCH_WEAKEN, which turns seccomp, Landlock
# or the per-box cgroup off in forked jail boxes. Never ship it; `make
# build` has no code that reads the variable.
.PHONY: bench-kiln
bench-kiln: build
	$(GO) build -tags kiln_benchknobs -o $(BIN)/kiln-benchknobs ./cmd/kiln
