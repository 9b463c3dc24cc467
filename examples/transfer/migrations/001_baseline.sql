-- The transfer example's business tables, in schema transfer. Each step
-- changes one balance and writes its ledger row in the transaction that
-- also records the step key in the engine's inbox, so a ledger row exists
-- if and only if its effect happened.
--
-- The rules are domains, not table CHECKs: PostgreSQL 15 rebuilds a
-- table's CHECKs in every statement that writes the table (about 28,000
-- instructions per write under callgrind, four writes per transfer),
-- while a domain's check is built once per session.

-- A balance is never negative: a debit beyond it fails, whatever writes.
create domain transfer.balance as bigint
    constraint balance_not_negative check (value >= 0);

-- A ledger row is written by one of the transfer's steps.
create domain transfer.ledger_step as text
    constraint ledger_step_known check (value in ('deduct', 'credit', 'refund'));

create table transfer.accounts (
    id      bigint primary key,
    balance transfer.balance not null,
    frozen  boolean not null default false
);

-- amount is signed: what the step added to the account's balance. One row
-- per (saga, step): a step that ran twice would be refused here too.
create table transfer.ledger (
    saga_id    uuid not null,
    step       transfer.ledger_step not null,
    account_id bigint not null,
    amount     bigint not null,
    created_at timestamptz not null default now(),
    primary key (saga_id, step)
);

-- What Seed recorded, for the audit: money is conserved against it, in
-- total and per account.
create table transfer.seeds (
    id          int primary key default 1 check (id = 1),
    accounts    int not null,
    per_account bigint not null,
    total       bigint not null,
    seeded_at   timestamptz not null default now()
);
