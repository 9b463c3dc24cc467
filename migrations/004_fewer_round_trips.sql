-- Why: fewer round trips and fewer writes per saga (issue 5).
--
-- The engine sends a transaction's writes together with its COMMIT,
-- in one round trip. A write that must touch a row (a conditional update
-- of a saga or a step, fenced by its version or attempt) cannot then be
-- checked in Go before the commit, so it checks itself in SQL: a miss
-- raises an error, PostgreSQL skips the rest of the pipeline, COMMIT
-- included, and the engine rolls back. The SQLSTATEs tell the engine why:
--   IDM01  the row moved: another writer got there first (a conflict);
--   IDM02  the saga is already in the target state (a duplicate);
--   IDM03  the saga does not exist.
create function idemsaga.expect(moved boolean, what text, found_state text default null, target text default null)
returns int
language plpgsql
as $$
begin
    if moved then
        return 1;
    end if;
    if target is null then
        raise exception using errcode = 'IDM01', message = what || ' moved meanwhile';
    end if;
    if found_state is null then
        raise exception using errcode = 'IDM03', message = what || ' does not exist';
    end if;
    if found_state = target then
        raise exception using errcode = 'IDM02', message = what || ' is already ' || target;
    end if;
    raise exception using errcode = 'IDM01', message = what || ' is now ' || found_state || ', not where this move starts';
end
$$;

-- When the step's current attempt was dispatched. idemsaga.step_attempts
-- now holds only attempts that ended otherwise than as the step's last
-- word (a retry scheduled, a lease expired) or that an operator's retry
-- re-opened; the current attempt is read from the step row. On the happy
-- path that saves an insert and an update per step. Rows written before
-- this migration keep their step_attempts rows, which take precedence.
alter table idemsaga.steps add column dispatched_at timestamptz;
