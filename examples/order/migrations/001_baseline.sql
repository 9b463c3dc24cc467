-- The order example's business tables, in schema orders. reserve takes
-- stock and writes its reservation in the transaction that records its
-- step key, release gives both back, ship writes the shipment: each
-- effect happens once. The charge is another system's (schema payments).
create table orders.products (
    id    bigint primary key,
    stock bigint not null check (stock >= 0)
);

-- One reservation per order (saga), held until the order ships or is
-- compensated.
create table orders.reservations (
    saga_id    uuid primary key,
    product_id bigint not null references orders.products (id),
    quantity   bigint not null check (quantity > 0),
    created_at timestamptz not null default now()
);

create table orders.shipments (
    saga_id    uuid primary key,
    address    text not null,
    created_at timestamptz not null default now()
);

-- What Seed recorded, for the audit: stock is conserved against it.
create table orders.seeds (
    product_id bigint primary key,
    stock      bigint not null
);
