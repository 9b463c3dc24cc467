// Package engine runs sagas: it starts them (Client.Start and StartTx),
// applies step replies, schedules retries, takes over expired leases and
// runs the worker pool (Engine.Start, Engine.Stop).
//
//	pool, _ := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
//	nc, _ := nats.Connect(os.Getenv("NATS_URL"))
//	e, err := engine.New(engine.Config{Pool: pool, NATS: nc, Definitions: []*saga.Definition{def}})
//	if err != nil { ... }
//	if err := e.Start(ctx); err != nil { ... }
//	defer e.Stop(context.Background())
//	res, err := e.Client().Start(ctx, def, "order-1234", order)
//
// # Lifecycle
//
// Start runs the engine until Stop, StopAndCancel, or the end of the
// context it was given. Stop drains: nothing new is fetched, the work in
// hand finishes, what was committed is published; a Stop whose context
// ends first returns its error while the drain goes on. StopAndCancel
// cancels the work in hand first: each attempt cut short records what it
// knows (an external call's outcome is then unknown, and its next attempt
// runs under the same key). Stopped is closed once the engine stopped; a
// stopped engine can be started again.
//
// # Guarantees
//
//   - Start: one saga per (definition, key), adjudicated by a unique
//     constraint. The same key and input returns the existing saga with
//     Duplicate set; a different input returns saga.ErrIdempotencyKeyReused
//     and writes nothing.
//   - Submit tokens (Client.IssueToken): a key the server issued is
//     consumed by the start that carries it, in the statement that inserts
//     its saga, so a rollback leaves it unused and concurrent starts of one
//     token make one saga; one never issued, of another definition or
//     expired is ErrSubmitTokenInvalid, and writes nothing.
//   - Every state change is one conditional update on (state, version) in
//     the same transaction as the step's outcome and the next step's row.
//     The engine's own step workers apply an outcome in the step's
//     transaction, with the inbox row and the business write; a retry, an
//     external step's unknown outcome and an outcome whose saga moved
//     meanwhile come back as a reply. A reply or outcome already applied,
//     or from an older attempt, changes nothing.
//   - A command this process committed runs here when a step slot is free
//     (Config.StepConcurrency), and a database step the previous step's
//     transaction dispatched runs at once after it, claimed in the round
//     trip of that COMMIT. Anything else is published right after the
//     commit; the relay publishes what is left after Config.RelayHandOff.
//   - A dispatched step holds a lease taken from the database clock, which
//     runs from its attempt's claim. When it expires with no reply after a
//     claim, the step is dispatched again with the same key and the next
//     attempt number; a command no worker claimed keeps its attempt, and is
//     sent again only if the stream no longer holds it. A step given up (attempts exhausted,
//     its last lease expired, a cancel) is settled through the inbox first:
//     a tombstone under its key, unless it holds a final outcome, so a late
//     delivery does nothing. An external step any of whose attempts had an
//     unknown outcome is possibly done: its own compensation runs first, or
//     the saga parks (saga.StateParked) when it has none.
//   - Retries wait for a due time stored in the database, not a timer in
//     memory, so they survive restarts.
//   - An operator's repair (Client.Retry, Cancel, Skip, Close, and Bulk
//     for many sagas) keeps every step key, runs under the saga's lock and
//     is recorded, with who and why, in its own transaction under its
//     request key: sent again, it changes nothing.
//   - Any number of engines may share one database and one stream. The
//     reaper locks a saga before its step (as the orchestrator does) and
//     skips sagas another process holds.
//   - The shared settings (Stream, SubjectPrefix, LeaseGrace) and each
//     definition's description are recorded by the deployment (Deploy, or
//     the first process to start) and compared by every engine and client
//     at start: a difference is ErrDeploymentMismatch, naming the setting.
//     A client without a definition's code starts and repairs its sagas
//     from the description (Client.Definition).
//   - A saga runs the definition version it started with to its end
//     (saga.WithVersion); a new version is recorded beside the old ones.
//     A command a worker cannot run (its definition, version or step is
//     not there) is handed back a bounded number of times, then parked in
//     the dead-letter table and acknowledged; an engine that runs its
//     version sends it again at start and with every heartbeat, and
//     Client.ResendDeadLetters and DropDeadLetters are there for people.
//   - Retry and Cancel are recorded with their request key in the repair's
//     own transaction: a request sent again changes nothing and answers
//     with the first result (RepairResult.Replayed).
//   - Pause and PauseDefinition hold sagas without spending attempts: no
//     claim starts an attempt of a paused saga, and the reaper neither
//     dispatches its retries nor takes over its leases; Resume and
//     ResumeDefinition send each step in flight again at its attempt.
//     A definition's deadline (saga.WithDeadline) cancels a saga past it
//     as Cancel does, once, however many reapers run.
//
// # Repairs in your transaction
//
// Every write a user makes has a …Tx variant that runs in the caller's
// pgx.Tx: StartTx, IssueTokenTx, RetryTx, CancelTx, SkipTx, CloseTx,
// PauseTx, ResumeTx, BulkTx, PauseDefinitionTx, ResumeDefinitionTx,
// CompleteTx, ResendDeadLettersTx and DropDeadLettersTx. A repair or callback runs as
// a savepoint in tx: one that fails leaves tx as it was and usable; one
// that succeeds takes effect when tx commits, and not at all if it rolls
// back, so an operator's note, a ledger correction or a callback's own
// bookkeeping commit with it. Its saga may be one tx started (StartTx).
// What such a write sends is the relay's to publish after tx commits
// (Config.RelayPollInterval), and Config.OnFinishedFunc and the finished
// metrics do not see the sagas it ends, because this process does not see
// the commit. A step key held by an attempt still running is waited out
// inside tx (holding the locks tx holds), up to about ten seconds.
package engine
