package order_test

import (
	"bytes"
	"encoding/json"
)

func bytesReader(b []byte) *bytes.Reader { return bytes.NewReader(b) }

// customerOf reads the customer of a payment request's body.
func customerOf(body []byte) string {
	var v struct {
		Customer string `json:"customer"`
	}
	_ = json.Unmarshal(body, &v)
	return v.Customer
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}
