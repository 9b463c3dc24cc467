-- The greetings a greet saga sent, one per step key.
create table greetings.sent (
    key  uuid primary key,
    name text not null
);
