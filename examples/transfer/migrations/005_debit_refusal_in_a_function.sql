-- Why: the debit told its two refusals apart (TR001 source missing or
-- frozen, TR002 insufficient funds) with a second EXISTS over the accounts
-- in the statement itself. PostgreSQL starts every subplan of a statement
-- when it starts the statement, so each debit, refused or not, paid for an
-- index scan it ran only on a refusal. refuse_debit reads the account only
-- when the debit took no effect, and raises the same codes. Being VOLATILE,
-- it reads with a snapshot of its own: a debit that waited on an account
-- frozen meanwhile is now refused as frozen (TR001), where the statement's
-- own snapshot said insufficient funds (TR002).
--
-- Apply this migration (worker migrate) before running the new build: its
-- debit calls refuse_debit, and without it every debit fails.
create function transfer.refuse_debit(account bigint) returns int
language plpgsql
volatile
as $$
begin
    if exists (select 1 from transfer.accounts where id = account and not frozen) then
        return transfer.refuse('TR002');
    end if;
    return transfer.refuse('TR001');
end
$$;
