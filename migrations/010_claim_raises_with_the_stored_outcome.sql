-- Why: a step's claim was preceded by a read of the inbox, in the same
-- round trip, so that a duplicate delivery learns the stored outcome
-- before the claim raises and ends the pipeline. That read cost every
-- step a statement, duplicates or not. The claim now reads the stored
-- outcome only when it finds the key taken, and raises with it:
-- idemsaga.key_taken raises IDM02, as idemsaga.expect does for a key
-- already claimed, with the stored outcome (a JSON array, as the step
-- worker reads it) in the error's DETAIL. An empty DETAIL means the
-- statement could not see the outcome (its writer committed while the
-- claim waited for it); the worker then reads it in a round trip of its
-- own.
create function idemsaga.key_taken(stored text)
returns int
language plpgsql
as $$
begin
    raise exception using errcode = 'IDM02', message = 'step key is already claimed', detail = coalesce(stored, '');
end
$$;
