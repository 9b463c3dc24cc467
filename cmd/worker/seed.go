package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemsaga/idemsaga/examples/order"
	"github.com/idemsaga/idemsaga/examples/transfer"
	"github.com/idemsaga/idemsaga/service"
)

type seedCmd struct {
	Accounts int   `default:"100" help:"Transfer accounts to create, numbered from 1."`
	Balance  int64 `default:"1000000" help:"Balance of each account, in the smallest unit."`
	Products int   `default:"10" help:"Products for the order example, numbered from 1."`
	Stock    int64 `default:"1000" help:"Units in stock of each product."`
	Replace  bool  `help:"Replace the accounts, products and ledgers that are there (their sagas' audit no longer adds up)."`
}

// Run seeds the examples' accounts and products, and records what it
// seeded, which reconcile checks money and stock against.
func (s *seedCmd) Run(ctx context.Context, f *service.Flags) error {
	g := withExamples(f)
	if s.Accounts < 1 || s.Balance < 0 || s.Products < 1 || s.Stock < 0 {
		return errors.New("--accounts and --products must be at least 1; --balance and --stock not negative")
	}
	pool, err := openDB(ctx, g.DatabaseURL, 2)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := checkExamplesMigrated(ctx, pool); err != nil {
		return err
	}
	if !s.Replace {
		var accounts, products int
		if err := pool.QueryRow(ctx, `select (select count(*) from transfer.accounts), (select count(*) from orders.products)`).Scan(&accounts, &products); err != nil {
			return fmt.Errorf("seed: %w", err)
		}
		if accounts > 0 || products > 0 {
			return fmt.Errorf("the database already holds %d accounts and %d products; pass --replace to seed them afresh (it empties the ledgers and the orders' reservations and shipments)", accounts, products)
		}
	}
	total, err := transfer.Seed(ctx, pool, s.Accounts, s.Balance)
	if err != nil {
		return err
	}
	if err := order.Seed(ctx, pool, s.Products, s.Stock); err != nil {
		return err
	}
	fmt.Printf("seeded %d accounts holding %d in all, and %d products of %d units\n", s.Accounts, total, s.Products, s.Stock)
	return nil
}
