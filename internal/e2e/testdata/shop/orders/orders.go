// Package orders is a user's own saga, written against idemsaga's public
// API only: reserve stock in the shop's database, then charge.
package orders

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/idemsaga/idemsaga/saga"
)

//go:embed migrations/*.sql
var Migrations embed.FS

// Input is an order.
type Input struct {
	Item     string `json:"item"`
	Quantity int    `json:"quantity"`
	// Card is "ok", "slow" (refused, not charged, until the order is
	// cancelled) or "lossy" (the bank's answers are lost until the file
	// named by $SHOP_BANK_UP exists).
	Card string `json:"card"`
}

// Validate refuses what no order can be.
func (in Input) Validate() error {
	if in.Item == "" || in.Quantity < 1 {
		return errors.New("item is required and quantity must be at least 1")
	}
	return nil
}

// Definition is the order saga.
var Definition = saga.WithInput(saga.MustNew("order",
	saga.Step{Name: "reserve", Reaches: "reserved", Kind: saga.DatabaseStep,
		Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, in Input) (struct{}, error) {
			_, err := sc.Tx.Exec(ctx, `insert into shop.reservations (key, item, quantity) values ($1, $2, $3)`, sc.Key, in.Item, in.Quantity)
			return struct{}{}, err
		}),
		Compensate: func(ctx context.Context, sc *saga.StepContext) (json.RawMessage, error) {
			_, err := sc.Tx.Exec(ctx, `delete from shop.reservations where key = $1`, sc.ForwardKey)
			return nil, err
		},
	},
	saga.Step{Name: "charge", Reaches: "charged", Kind: saga.ExternalStep,
		Retry: saga.RetryPolicy{MaxAttempts: 2, InitialBackoff: 50 * time.Millisecond, MaxBackoff: 100 * time.Millisecond, Timeout: 5 * time.Second},
		Forward: saga.Handle(func(ctx context.Context, sc *saga.StepContext, in Input) (string, error) {
			switch in.Card {
			case "slow":
				return "", saga.RetryAfter(saga.NotApplied(errors.New("the bank is busy")), time.Minute)
			case "lossy":
				if _, err := os.Stat(os.Getenv("SHOP_BANK_UP")); err != nil {
					return "", fmt.Errorf("the bank did not answer for key %s", sc.Key)
				}
			}
			return "charged " + sc.Key.String(), nil
		}),
	},
), Input.Validate)
