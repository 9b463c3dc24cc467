package transfer_test

import (
	"fmt"

	"github.com/idemsaga/idemsaga/examples/transfer"
)

// The transfer's input is checked strictly before anything is written:
// a smuggled member is refused, and so is what the validator refuses.
func Example() {
	for _, body := range []string{
		`{"from":1,"to":2,"amount":100}`,
		`{"from":1,"to":2,"amount":5,"AMOUNT":7000}`,
		`{"from":1,"to":1,"amount":5}`,
	} {
		_, err := transfer.Definition.Input([]byte(body))
		fmt.Println(err)
	}
	// Output:
	// <nil>
	// idemsaga: invalid input for saga "transfer": member /AMOUNT is not a field of transfer.Input (names are matched exactly, case included)
	// idemsaga: invalid input for saga "transfer": transfer: source and destination are the same account (1)
}
