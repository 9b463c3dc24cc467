// Package sagatest runs sagas in a test on the real engine: a database
// of the test's own on PostgreSQL, an in-process JetStream server, and a
// clock the test moves, so that backoffs, leases and retention take no
// wall time.
//
//	func TestOrder(t *testing.T) {
//		env := sagatest.New(t, sagatest.Config{
//			Definitions: []*saga.Definition{orders.Definition},
//			Migrations:  []service.Migration{{Schema: "shop", Files: orders.Migrations}},
//		})
//		env.Inject(sagatest.Fault{Kind: sagatest.LoseOutcome, Step: "charge", Attempt: 1})
//		sg := env.Run(t, orders.Definition, "order-1", orders.Input{Item: "book", Quantity: 1})
//		require.Equal(t, saga.State("charged"), sg.State)
//		require.Len(t, sg.Attempts, 3) // reserve, then charge twice under one key
//	}
//
// PostgreSQL is found through SAGATEST_DATABASE_URL, then DATABASE_URL,
// then postgres://postgres@127.0.0.1:5432/postgres; its user must be
// allowed to create databases. Each Env creates one database and drops
// it when the test ends; under Main, a package's tests share databases
// cloned from one migrated template, each brought back to it between
// tests. A missing server fails the test; it never skips.
//
// # The clock
//
// The engine measures leases, retry times and retention with
// idemsaga.now(), on the database, never with a worker's clock. The kit
// replaces that function in its own database with the database's clock
// plus an offset (Clock.Advance). Wait moves the offset whenever the saga
// only waits for time: to a retry's due time at once, to an attempt's
// lease once the saga has been quiet for a moment (the attempt's worker
// died), and to a callback step's deadline once it has been quiet for a
// second (no callback is coming). It moves it only while nothing is on its
// way in the engine (a command or reply unpublished, in the stream, in a
// worker's hands, or being written), so a lease never runs out under a
// command that waits for a busy worker. A saga's child sagas are waited
// for with it: Wait moves the clock to what a child waits for, never to
// its parent's deadline for a child that still runs (only for one that
// is parked). Clock.Advance moves it at once. A test completes a
// callback step with Env.Client.Complete, before Wait or from another
// goroutine; a callback sent before the step waits is kept for it.
// Handlers' own timeouts (RetryPolicy.Timeout) stay on wall time.
//
// # Faults
//
// Env.Inject arms the faults a saga must survive: an attempt whose
// outcome is lost after it took effect (LoseOutcome), a worker that dies
// right after a commit (CrashAfterCommit), a command delivered twice
// (DeliverTwice). They are the engine's own failure paths, reached
// without killing the test process.
package sagatest
