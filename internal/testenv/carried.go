package testenv

// CarriedSQL counts the sagas whose start committed with the first attempt
// of their first step (attempt.Runner.Carry): one transaction, so one
// transaction time for the saga's creation and the step's outcome.
const CarriedSQL = `select count(*) from idemsaga.sagas s
join idemsaga.steps st on st.saga_id = s.id and st.step_index = 0 and st.phase = 'forward'
where st.updated_at = s.created_at and st.attempt = 1`
