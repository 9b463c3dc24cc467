-- The cross-border transfer example's tables, in schema crossborder.
-- Every movement of money, an account's or the FX desk's, writes one
-- ledger row under the step key that made it, in the transaction that
-- records that key in the engine's inbox: a ledger row exists if and
-- only if its movement happened, once.

-- A customer's account, held in one currency. A balance is never
-- negative: a debit beyond it changes nothing.
create table crossborder.accounts (
    id       bigint primary key,
    currency text not null check (currency ~ '^[A-Z]{3}$'),
    balance  bigint not null check (balance >= 0),
    frozen   boolean not null default false
);

-- The FX desk's holdings: a conversion takes the sold currency in and
-- pays the bought one out, never more than it holds.
create table crossborder.desk (
    currency text primary key check (currency ~ '^[A-Z]{3}$'),
    position bigint not null check (position >= 0)
);

-- Rates the desk converts at, in millionths: 1 unit of sell buys
-- micros / 1e6 units of buy.
create table crossborder.rates (
    sell   text not null,
    buy    text not null,
    micros bigint not null check (micros > 0),
    primary key (sell, buy)
);

-- A quote fixes the rate of one conversion, under the quote step's key;
-- its compensation voids it.
create table crossborder.quotes (
    key     uuid primary key,
    saga_id uuid not null,
    sell    text not null,
    buy     text not null,
    sold    bigint not null check (sold > 0),
    bought  bigint not null check (bought > 0),
    micros  bigint not null,
    voided  boolean not null default false
);

-- amount is signed: what the step added to the holder's balance in
-- currency. A conversion moves two currencies under one key.
create table crossborder.ledger (
    key        uuid not null,
    currency   text not null,
    saga_id    uuid not null,
    step       text not null,
    holder     text not null,
    amount     bigint not null,
    created_at timestamptz not null default now(),
    primary key (key, currency)
);

-- What Seed opened each holder with (an account, or the desk), for the
-- audit: each holder holds its opening plus its ledger rows, and each
-- currency's money is conserved.
create table crossborder.openings (
    holder   text not null,
    currency text not null,
    amount   bigint not null,
    primary key (holder, currency)
);
