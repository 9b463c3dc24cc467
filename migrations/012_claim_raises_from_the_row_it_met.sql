-- Why: a duplicate delivery's claim (an insert that meets the inbox row
-- of its step key) called idemsaga.key_taken (migration 010), which looked
-- the row up again, joined to the step's row, through a query of its own:
-- PostgreSQL started a nested loop over two index scans for every
-- duplicate, about half of the 214,000 instructions a duplicate's claim
-- cost it (measured under callgrind, docs/benchmarks.md, eleventh pass).
-- The claim's ON CONFLICT DO UPDATE holds the row it met, locked and in
-- its latest committed version (at READ COMMITTED, the default; at
-- REPEATABLE READ or SERIALIZABLE a row the claim's snapshot does not see
-- fails it with 40001, as before), so it now hands that row's columns to
-- idemsaga.key_held, which raises IDM02 with them as key_taken did. Only a
-- success whose result is not in the inbox row (one applied to its saga in
-- its own transaction keeps it in the step's row alone) still reads the
-- step's row, by its primary key. key_held is VOLATILE so that this read
-- takes a snapshot of its own: a duplicate that waited for the first
-- delivery's commit must see the step's row that commit wrote.
--
-- key_taken stays for step workers of older versions. Apply this
-- migration before running the new ones, whose claim calls key_held.
create function idemsaga.key_held(held_saga uuid, held_step text, held_phase text,
    held_outcome text, held_result jsonb, held_error text, held_attempt int)
returns int
language plpgsql
volatile
as $$
declare
    found_result jsonb := held_result;
begin
    if found_result is null and held_outcome = 'succeeded' then
        select st.result into found_result
        from idemsaga.steps st
        where st.saga_id = held_saga and st.step = held_step and st.phase = held_phase
          and st.status = 'succeeded';
    end if;
    raise exception using errcode = 'IDM02', message = 'step key is already claimed',
        column = json_build_array(held_outcome, found_result, coalesce(held_error, ''), held_attempt)::text;
end
$$;
