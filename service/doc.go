// Package service is idemsaga's runtime: it turns a list of saga
// definitions and the migrations of their tables into a binary with every
// command a deployment needs.
//
//	func main() {
//		service.Main(service.Config{
//			Name:        "shop",
//			Definitions: []*saga.Definition{orders.Definition},
//			Migrations:  []service.Migration{{Schema: "shop", Files: orders.Migrations}},
//		})
//	}
//
// The binary's commands:
//
//	run        the engine (outbox relay, step workers, orchestrator, lease
//	           reaper, cleaner) and, on --http-addr, the HTTP API under /v1,
//	           the web console under /ui/ (its data from /v1, behind the
//	           same tokens), /metrics, /healthz and /readyz; SIGINT or
//	           SIGTERM drains it. --embedded-nats DIR runs JetStream in the
//	           process, on 127.0.0.1, for a single machine
//	migrate    the engine's tables and the service's (Config.Migrations);
//	           records the deployment's shared settings and definitions
//	start      start a saga from JSON input, with its idempotency key
//	list, show the sagas, their steps and every attempt
//	retry, cancel, pause, resume
//	           recorded repairs that keep every step key (pause and
//	           resume also for a whole definition: --definition)
//	reconcile  the engine's invariants and the service's Checks
//	workers    the live workers and the definition versions each runs
//	dead-letters
//	           list, resend or drop commands parked because no worker that
//	           received them knew their definition, version or step
//
// Every flag has an environment variable as fallback (DATABASE_URL,
// NATS_URL, IDEMSAGA_STREAM, …; `--help` lists them).
//
// # Guarantees
//
//   - Settings that must match across processes (the stream, the subject
//     prefix, the lease grace, each definition's steps and policies) are
//     checked, not trusted: `migrate` records them, and every process
//     compares its own at start and refuses to run on a difference.
//   - A binary without definitions is an admin tool: it starts, shows and
//     repairs sagas from the recorded definitions, and the workers that
//     have the code run the steps.
//   - `run` refuses to serve the API to other machines without API tokens
//     (--api-tokens-file) unless told --insecure-no-auth; with tokens,
//     every /v1 request and /metrics (unless --metrics-open) needs one.
//   - No password, token or seed from a URL, a token file or a header
//     reaches a log line or an error.
//   - SIGINT or SIGTERM stops the HTTP server first, then drains the engine
//     (the work in hand finishes, committed commands are published).
package service
