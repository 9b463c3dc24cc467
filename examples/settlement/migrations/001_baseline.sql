-- The settlement example's tables, in schema settlement. The nightly saga
-- totals one UTC day of the ledger into one settlements row, written in
-- the transaction that records the settle step's key: each day is settled
-- once, and the row names the key that settled it.

-- ledger: the day's business, booked by whatever records it (the tests
-- seed it). amount is signed, in the smallest unit; booked_at decides
-- the day.
create table settlement.ledger (
    id        bigint generated always as identity primary key,
    account   text not null,
    amount    bigint not null,
    booked_at timestamptz not null
);

create index ledger_booked_at on settlement.ledger (booked_at);

-- settlements: one row per UTC day settled. step_key is the settle
-- step's key: a second saga that would settle the day finds another key
-- and is refused, and the compensation deletes the row by its key.
create table settlement.settlements (
    day        date primary key,
    step_key   uuid not null unique,
    saga_id    uuid not null,
    entries    bigint not null,
    total      bigint not null,
    settled_at timestamptz not null default now()
);
