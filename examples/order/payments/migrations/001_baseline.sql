-- The example payment service's own table, in schema payments: another
-- system than the engine, which only reaches it over HTTP. A charge is
-- one row under its Idempotency-Key, so a key charges once however often
-- it is sent. A refund of a key that was never charged leaves a voided
-- row under it, so that the charge, arriving late, is refused: undoing
-- what never happened is harmless, and stays so.
create table payments.charges (
    key         uuid primary key,
    order_id    uuid not null,
    customer    text not null,
    -- What the charge holds; 0 for a voided key.
    amount      bigint not null check (amount >= 0),
    state       text not null check (state in ('charged', 'refunded', 'voided')),
    charged_at  timestamptz,
    refunded_at timestamptz,
    created_at  timestamptz not null default now()
);

-- One row per refund request, under its own Idempotency-Key: the same key
-- with another charge is refused.
create table payments.refunds (
    key        uuid primary key,
    charge_key uuid not null,
    created_at timestamptz not null default now()
);
