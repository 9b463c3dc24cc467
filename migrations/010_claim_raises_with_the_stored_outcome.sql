-- Why: a step's claim was preceded by a read of the inbox, in the same
-- round trip, so that a duplicate delivery learns the stored outcome
-- before the claim's raise ends the pipeline. That read cost every step a
-- statement, duplicates or not. The claim now calls idemsaga.key_taken
-- only when it finds the key taken: it reads what the inbox holds for the
-- key and raises IDM02, as idemsaga.expect does for a key already claimed,
-- with that outcome in the error's DETAIL, as a JSON array of the outcome,
-- the result, the error text and the attempt. Being VOLATILE, it reads
-- with a snapshot of its own, so it also sees an outcome whose writer
-- committed while the claim waited for the key.
--
-- A success applied to its saga in its own transaction, as its command
-- foresaw, leaves its result in the step's row alone (the step's row is
-- written in the same transaction): the result is read from there when
-- the inbox row has none.
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
    raise exception using errcode = 'IDM02', message = 'step key is already claimed', detail = coalesce(stored, '');
end
$$;
