-- Why: reconciliation checks that money is conserved against what was
-- seeded, per account and in total; Seed records it here.
create table transfer.seeds (
    id          int primary key default 1 check (id = 1),
    accounts    int not null,
    per_account bigint not null,
    total       bigint not null,
    seeded_at   timestamptz not null default now()
);
