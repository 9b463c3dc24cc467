-- The shop's reservations, one per reserve step key.
create table shop.reservations (
    key      uuid primary key,
    item     text not null,
    quantity int not null check (quantity > 0)
);

