-- Child sagas (saga.ChildStep). A child is an ordinary saga, started by
-- its parent's step under the key saga.ChildKey derives from the step's
-- key; parent_id and parent_step name that step, so that the child's end
-- reaches it (at once, and by the reaper's sweep when the process died
-- between the two), so that inspection lists a saga's children, and so
-- that retention keeps a child while its parent is kept: a parent that
-- compensates later needs its completed child to compensate it. No
-- foreign key: a parent and its child are deleted by retention in
-- separate passes, the parent first.
alter table idemsaga.sagas
    add column parent_id uuid,
    add column parent_step text,
    add constraint sagas_parent_whole check ((parent_id is null) = (parent_step is null));

-- A parent's children, for the sweep, inspection and retention.
create index sagas_parent_idx on idemsaga.sagas (parent_id) where parent_id is not null;

-- A completed child is compensated whole when its parent compensates:
-- recorded as a repair of the child, by the engine, under a request key
-- derived from the parent's compensation key.
alter table idemsaga.repairs drop constraint repairs_operation_check,
    add constraint repairs_operation_check check (operation in ('retry', 'cancel', 'skip', 'close', 'pause', 'resume', 'compensate'));
