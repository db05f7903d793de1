-- walbox migration 0007: back-pressure the application can see.
--
-- walbox.backlog(slot) says, without scanning the outbox, how far behind
-- the relay of a slot is: WAL written since the position it confirmed,
-- the age of the oldest event it has read and the broker has not yet
-- acknowledged, whether a walbox streams from the slot, and the budget
-- walbox run was given (backlog.max_bytes, backlog.max_age).
--
--   SELECT * FROM walbox.backlog();          -- the slot named walbox
--   SELECT * FROM walbox.backlog('orders');
--
-- walbox.require_capacity(slot) raises an error when the relay is over its
-- budget (SQLSTATE WB001) or no walbox streams from the slot (WB002), so
-- an application can shed or queue writes before WAL fills the primary's
-- disk. Call it in the transaction that writes the event:
--
--   BEGIN;
--   SELECT walbox.require_capacity();
--   INSERT INTO outbox_events (...) VALUES (...);
--   COMMIT;
--
-- require_capacity() reads one row of walbox.relay_state, which the
-- walbox streaming from the slot writes every second (with its verdict):
-- cheap enough per request. A row older than 5 seconds means no walbox
-- streams (stopped, crashed, reconnecting, or stuck). backlog() also reads
-- pg_replication_slots, for people and dashboards. walbox.relay_state is
-- UNLOGGED: no WAL, in no publication, emptied by a crash of Postgres,
-- absent on standbys: call the functions on the primary.

DO $$ BEGIN
  IF to_regnamespace('walbox') IS NULL THEN
    CREATE SCHEMA walbox;
    GRANT USAGE ON SCHEMA walbox TO PUBLIC;
  END IF;
END $$;

CREATE UNLOGGED TABLE IF NOT EXISTS walbox.relay_state (
    slot               text        PRIMARY KEY,
    -- When walbox last wrote this row (every second while it runs).
    reported_at        timestamptz NOT NULL,
    -- The commit time of the oldest event walbox has read and the broker
    -- has not acknowledged; NULL when none waits.
    oldest_undelivered timestamptz,
    -- backlog.max_bytes and backlog.max_age; NULL: no such budget.
    max_bytes          bigint,
    max_age            interval,
    -- walbox.backlog(slot).over_budget when walbox last wrote the row.
    over_budget        boolean     NOT NULL DEFAULT false
);
GRANT SELECT ON walbox.relay_state TO PUBLIC;

COMMENT ON TABLE walbox.relay_state IS
    'What walbox run reports about each slot every second, for walbox.backlog() and walbox.require_capacity(). Unlogged: no WAL, in no publication, emptied by a crash.';

DO $$ BEGIN
  IF to_regtype('walbox.backlog') IS NULL THEN
    CREATE TYPE walbox.backlog AS (
        slot                   text,
        streaming              boolean,
        unconfirmed_bytes      bigint,
        oldest_undelivered_age interval,
        max_bytes              bigint,
        max_age                interval,
        over_budget            boolean
    );
  END IF;
END $$;

-- unconfirmed_bytes: WAL written since the slot's confirmed position
-- (every table's writes, not only the outbox's: walbox confirms past them
-- as it reads them). oldest_undelivered_age: the age of the oldest event
-- walbox has read and not had acknowledged (0 when none waits); while no
-- walbox streams, at least the time since one last reported (what was
-- written since waits), or NULL when none ever did. over_budget: either
-- figure past its budget. NULL fields for a slot that does not exist.
CREATE OR REPLACE FUNCTION walbox.backlog(slot_name text DEFAULT 'walbox')
RETURNS walbox.backlog
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    b     walbox.backlog;
    state walbox.relay_state;
BEGIN
    b.slot := slot_name;
    SELECT s.active,
           CASE WHEN pg_is_in_recovery() THEN NULL
                ELSE pg_wal_lsn_diff(pg_current_wal_lsn(), s.confirmed_flush_lsn)::bigint END
      INTO b.streaming, b.unconfirmed_bytes
      FROM pg_replication_slots s
     WHERE s.slot_name = backlog.slot_name AND s.slot_type = 'logical';
    IF NOT FOUND THEN
        RETURN b;
    END IF;
    SELECT * INTO state FROM walbox.relay_state r WHERE r.slot = backlog.slot_name;
    IF FOUND THEN
        b.max_bytes := state.max_bytes;
        b.max_age := state.max_age;
        b.oldest_undelivered_age := CASE
            WHEN state.oldest_undelivered IS NOT NULL
                THEN greatest(now() - state.oldest_undelivered, '0'::interval)
            WHEN b.streaming THEN '0'::interval
            ELSE greatest(now() - state.reported_at, '0'::interval)
        END;
    END IF;
    b.over_budget := coalesce(b.unconfirmed_bytes > b.max_bytes, false)
                  OR coalesce(b.oldest_undelivered_age > b.max_age, false);
    RETURN b;
END $$;

-- Raises WB001 (over budget) or WB002 (no walbox has streamed from the
-- slot in the last 5 seconds, or no such slot); returns nothing otherwise.
-- The usual path is one primary-key lookup; the full look (backlog()) runs
-- only to word a refusal. No SET search_path clause (names are qualified
-- instead): measured, the clause alone costs a call ~40 us, four times the
-- lookup; the function is no SECURITY DEFINER, so a caller's search_path
-- can only change what the caller itself gets.
CREATE OR REPLACE FUNCTION walbox.require_capacity(slot_name text DEFAULT 'walbox')
RETURNS void
LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
    state    walbox.relay_state;
    reported boolean;
    b        walbox.backlog;
BEGIN
    SELECT * INTO state FROM walbox.relay_state r WHERE r.slot = require_capacity.slot_name;
    reported := FOUND AND state.reported_at > pg_catalog.now() - interval '5 seconds';
    IF reported AND NOT state.over_budget THEN
        RETURN;
    END IF;
    b := walbox.backlog(slot_name);
    IF b.streaming IS NULL THEN
        RAISE EXCEPTION 'walbox: replication slot "%" does not exist', slot_name
            USING ERRCODE = 'WB002',
                  HINT = 'create it with walbox init-slot, or name the slot walbox streams from';
    ELSIF NOT reported THEN
        RAISE EXCEPTION 'walbox: no walbox streams from slot "%": events written now wait (% bytes of WAL unconfirmed)',
                slot_name, b.unconfirmed_bytes
            USING ERRCODE = 'WB002',
                  HINT = 'start walbox run (and walbox migrate, for it to report here); meanwhile shed or queue writes that can wait';
    ELSE
        RAISE EXCEPTION 'walbox: the relay of slot "%" is over its budget: % bytes of WAL unconfirmed (budget %), oldest event waiting % (budget %)',
                slot_name, b.unconfirmed_bytes, coalesce(b.max_bytes::text, 'none'),
                b.oldest_undelivered_age, coalesce(b.max_age::text, 'none')
            USING ERRCODE = 'WB001',
                  HINT = 'shed or queue writes that can wait; see walbox status and the broker';
    END IF;
END $$;

COMMENT ON FUNCTION walbox.backlog(text) IS
    'How far behind the walbox of a slot is: unconfirmed WAL, the oldest undelivered event''s age, whether it streams, its budget. Cheap: no scan of the outbox.';
COMMENT ON FUNCTION walbox.require_capacity(text) IS
    'Raises SQLSTATE WB001 when the walbox of a slot is over its budget (backlog.max_bytes, backlog.max_age), WB002 when none streams from it.';
