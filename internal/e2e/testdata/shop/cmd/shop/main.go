// Command shop runs the shop's sagas: the whole of a user's main.
package main

import (
	"example.com/shop/orders"
	"github.com/idemsaga/idemsaga/saga"
	"github.com/idemsaga/idemsaga/service"
)

func main() {
	service.Main(service.Config{
		Name:        "shop",
		Definitions: []*saga.Definition{orders.Definition},
		Migrations:  []service.Migration{{Schema: "shop", Files: orders.Migrations}},
	})
}
