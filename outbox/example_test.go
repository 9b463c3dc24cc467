package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemsaga/idemsaga/internal/exampleenv"
	"github.com/idemsaga/idemsaga/outbox"
)

// A message written in the transaction of a business write is published
// if and only if that transaction commits.
func Example() {
	infra := exampleenv.New()
	defer infra.Close()
	ctx := context.Background()
	js, _ := jetstream.New(infra.NATS)
	stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "EVENTS", Subjects: []string{"events.>"}})
	if err != nil {
		panic(err)
	}

	for _, commit := range []bool{true, false} {
		tx, _ := infra.Pool.Begin(ctx)
		// ... the business write, in tx ...
		_ = outbox.Write(ctx, tx, outbox.Message{Subject: "events.order", MsgID: fmt.Sprint("order-1/", commit), Payload: []byte(`{"order":1}`)})
		if commit {
			_ = tx.Commit(ctx)
		} else {
			_ = tx.Rollback(ctx)
		}
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{Pool: infra.Pool, JetStream: js, PollInterval: 10 * time.Millisecond})
	if err != nil {
		panic(err)
	}
	n, err := relay.RelayOnce(ctx)
	if err != nil {
		panic(err)
	}
	info, _ := stream.Info(ctx)
	fmt.Println("published", n, "stream holds", info.State.Msgs)
	// Output: published 1 stream holds 1
}
