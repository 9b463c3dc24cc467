package order_test

import (
	"fmt"

	"github.com/idemsaga/idemsaga/examples/order"
)

// The order's input is checked strictly before anything is written.
func Example() {
	def, err := order.NewDefinition(order.Config{PaymentsURL: "http://127.0.0.1:9465"})
	if err != nil {
		panic(err)
	}
	for _, body := range []string{
		`{"customer":"ann","product":1,"quantity":2,"amount":1500,"address":"1 Main St"}`,
		`{"customer":"ann","product":1,"quantity":2,"amount":1500,"amount":1,"address":"1 Main St"}`,
	} {
		_, err := def.Input([]byte(body))
		fmt.Println(err)
	}
	// Output:
	// <nil>
	// idemsaga: invalid input for saga "order": member /amount appears twice; send each member once
}
