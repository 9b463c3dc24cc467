// Package attempt is the step runner: it runs one attempt of a step, from
// a command delivered by the broker, a command its own process dispatched
// (run at once, its claim sent with the COMMIT that dispatched it), or a
// saga's start that carries its first step (Runner.Carry).
//
// A database step's attempt is one transaction: the claim of its key in
// the inbox, the handler's writes, and the outcome with the saga's move
// (package store writes every statement). An external or callback step's
// attempt claims its key in a transaction of its own, calls, and records
// the outcome after. Whatever the path, an outcome is recorded once under
// the step's key; a duplicate delivery finds it and is answered from it.
package attempt
