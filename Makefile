GO ?= go
STATICCHECK_VERSION ?= v0.8.2
WORKER_PKG := ./cmd/worker

.PHONY: test lint demo build migrate chaos chaos-orders chaos-crossborder chaos-settlement bench compare-dbos

# Needs cgo and a C compiler for -race (scripts/ensure-cc.sh installs gcc and
# libc6-dev on Debian/Ubuntu when they are missing), and PostgreSQL at
# 127.0.0.1:5432 (user postgres, trust auth) or DATABASE_URL;
# scripts/ensure-postgres.sh sets that up when it is missing (its trust rule
# lets every local user in as postgres: not for shared or production machines).
# The console's browser test drives Debian's headless Chromium
# (/usr/bin/chromium); scripts/ensure-chromium.sh installs it when missing.
# scripts/prerequisites.sh first finds every package missing and installs
# them in one apt-get run, or names them all at once.
test:
	GO="$(GO)" ./scripts/prerequisites.sh test
	GO="$(GO)" ./scripts/ensure-cc.sh
	./scripts/ensure-postgres.sh
	./scripts/ensure-chromium.sh
	$(GO) test -race -count=1 -timeout 15m ./...

lint:
	@unformatted="$$("$$($(GO) env GOROOT)/bin/gofmt" -l .)"; if [ -n "$$unformatted" ]; then echo "gofmt: not formatted (run gofmt -w):"; echo "$$unformatted"; exit 1; fi
	$(GO) vet ./...
	$(GO) run honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION) ./...

demo:
	./scripts/prerequisites.sh demo
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) demo

build:
	$(GO) build -o bin/worker $(WORKER_PKG)

migrate:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) migrate

# The full chaos run: 5,000 transfers across 3 worker processes, a SIGKILL
# about every second, a NATS restart, a SIGSTOP past the leases and a cut of
# the workers' database connections; ends with reconcile (must be 0).
chaos:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) chaos

# The same for the order example: 2,000 orders against its payment service,
# which loses answers after charging, answers 500 and 503, and answers late;
# workers are killed during calls. Checks no order charged twice, every
# charge shipped or refunded, stock conserved, money held = shipped total.
chaos-orders:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) chaos --saga order

# 5,000 cross-border transfers, their FX conversions child sagas, half of
# them started by events (some published twice): money conserved per
# currency, no compensated transfer's child left standing.
chaos-crossborder:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) chaos --saga crossborder

# 60 nights of the nightly settlement on a clock that passes a night a
# second, every worker down for 5 of them: each night settled and reported
# once, or compensated; only the nights the catch-up skips go without one.
chaos-settlement:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) chaos --saga settlement

# Sagas per second, latency and cost per saga against the local PostgreSQL,
# with pgbench as the ceiling (bench/JOURNAL.md).
bench:
	./scripts/ensure-postgres.sh
	$(GO) run $(WORKER_PKG) bench

# The same transfer load on DBOS Transact Go, to compare the two on one
# machine in one sitting (bench/compare/dbos is a module of its own: the
# engine does not depend on DBOS). Run it alternately with `make bench`.
compare-dbos:
	./scripts/ensure-postgres.sh
	cd bench/compare/dbos && $(GO) run .
