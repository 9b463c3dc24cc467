// Command worker is idemsaga's examples' binary: the runtime's commands
// (run, migrate, start, list, show, retry, cancel, reconcile, workers)
// for the transfer, order and cross-border transfer sagas, and the
// examples' own: seed, the
// transfer and order shortcuts, the payment service, a self-contained
// demo, the chaos runs and the benchmark.
package main

import (
	"github.com/idemsaga/idemsaga/examples/crossborder"
	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/order/payments"
	"github.com/idemsaga/idemsaga/examples/settlement"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/service"
)

func main() {
	service.Main(service.Config{
		Name:            "worker",
		Description:     "idemsaga worker: durable sagas with idempotent steps on PostgreSQL and NATS JetStream, with the transfer, order and cross-border examples.",
		Flags:           &examples,
		DefinitionsFunc: examples.definitions,
		Migrations: []service.Migration{
			{Schema: transfer.Schema, Files: transfer.Migrations},
			{Schema: order.Schema, Files: order.Migrations},
			{Schema: payments.Schema, Files: payments.Migrations},
			{Schema: crossborder.Schema, Files: crossborder.Migrations},
			{Schema: settlement.Schema, Files: settlement.Migrations},
		},
		Checks:   checks,
		Commands: commands,
	})
}
