-- A cancel of a parked saga takes its possibly-done step as not done: a
-- person checked the other system, or undid it by hand. The repair names
-- that step, as a skip names the step it marked succeeded, so that
-- reconcile reads the operator's word instead of calling the step a
-- possibly-done step left uncompensated.
alter table idemsaga.repairs drop constraint repairs_skip_names_step,
    add constraint repairs_names_step check (
        case operation
            when 'skip' then step is not null and phase is not null
            when 'cancel' then (step is null) = (phase is null)
            else step is null and phase is null
        end);
