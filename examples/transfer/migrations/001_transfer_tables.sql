-- Why: the business tables of the transfer example. Each step writes its
-- ledger row in the same transaction as its balance change and the engine's
-- inbox record, so a ledger row exists if and only if its effect happened.
create table transfer.accounts (
    id      bigint primary key,
    balance bigint not null check (balance >= 0),
    frozen  boolean not null default false
);

-- step is 'deduct', 'credit' or 'refund'; amount is signed: what the step
-- added to the account's balance.
create table transfer.ledger (
    saga_id    uuid not null,
    step       text not null check (step in ('deduct', 'credit', 'refund')),
    account_id bigint not null,
    amount     bigint not null,
    created_at timestamptz not null default now(),
    primary key (saga_id, step)
);
