-- Why: the transfer's steps send their one statement in the round trip
-- that records the step's success (saga.StepContext.ExecLast), where its
-- row count is never seen: a debit or credit that cannot take effect must
-- fail instead of changing nothing. refuse raises under the code given
-- (TR001 source missing or frozen, TR002 insufficient funds, TR003
-- destination missing or frozen), which the handler turns into the
-- transfer's permanent errors.
create function transfer.refuse(code text) returns int
language plpgsql
volatile
as $$
begin
    raise exception using errcode = code, message = 'transfer refused';
end
$$;
