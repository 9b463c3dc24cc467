// Package orchestrate moves sagas on everything that is not a step's own
// attempt: the replies the orchestrator consumes (ApplyReply,
// HandleReplyMsg), the reaper's leases, retries, requeues and deadlines
// (ReapOnce), callbacks (Complete), an operator's repairs (Repair,
// RepairDefinition) and dead letters sent again (Resend,
// ResumeDeadLetters). Package attempt runs the attempts themselves and
// asks Core for the move an outcome makes (Move, Moved).
//
// Core decides with package plan and writes through package store, the one
// writer; it holds no SQL of its own that changes a saga. Package engine
// is its only caller: engine.Client and engine.Engine check what users
// give, then call Core with this package's request types, and give its
// results and errors their public types. What a transaction of Core
// commits goes to the HandOff it was built with (the engine's step
// workers and relay), never to function fields set afterwards.
package orchestrate
