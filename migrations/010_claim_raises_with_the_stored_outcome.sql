-- Why: a step's claim was preceded by a read of the inbox, in the same
-- round trip, so that a duplicate delivery learns the stored outcome
-- before the claim's raise ends the pipeline. That read cost every step a
-- statement, duplicates or not. The claim now calls idemsaga.key_taken
-- only when it finds the key taken: it reads what the inbox holds for the
-- key and raises IDM02, as idemsaga.expect does for a key already claimed,
-- with that outcome as a JSON array of the outcome, the result, the error
-- text and the attempt. Being VOLATILE, it reads with a snapshot of its
-- own, so it also sees an outcome whose writer committed while the claim
-- waited for the key.
--
-- The outcome travels in the error's COLUMN field, not its DETAIL: the
-- server log records an error's message, DETAIL, CONTEXT and statement,
-- and a step's result or error text is business data that has no place
-- there. The client receives every field.
--
-- A success applied to its saga in its own transaction, as its command
-- foresaw, leaves its result in the step's row alone (the step's row is
-- written in the same transaction): the result is read from there when
-- the inbox row has none.
--
-- Stop the step workers of older versions before running the new ones:
-- an older worker reads a result from the inbox row alone, so it would
-- answer a duplicate of such a success without its result, and hand the
-- step's compensation none (a newer worker falls back to the result the
-- compensation's command carries).
create function idemsaga.key_taken(claimed_saga uuid, claimed_key uuid)
returns int
language plpgsql
volatile
as $$
declare
    stored text;
begin
    select json_build_array(i.outcome, coalesce(i.result, st.result), coalesce(i.error, ''), i.attempt)::text
    into stored
    from idemsaga.inbox i
    left join idemsaga.steps st on i.outcome = 'succeeded' and i.result is null
        and st.saga_id = i.saga_id and st.step = i.step and st.phase = i.phase and st.status = 'succeeded'
    where i.saga_id = claimed_saga and i.step_key = claimed_key;
    raise exception using errcode = 'IDM02', message = 'step key is already claimed', column = coalesce(stored, '');
end
$$;
