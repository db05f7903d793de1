-- walbox migration 0006: delivery receipts from every broker.
--
-- A receipt says where the broker stored the event, in the broker's own
-- terms: a Kafka partition and offset (as before), a RabbitMQ exchange and
-- routing key (confirmed by the broker, at acked_at), an SQS message id
-- and, on a FIFO queue, its sequence number, a NATS JetStream stream and
-- sequence, or the HTTP status a webhook answered. `broker` says which;
-- the other brokers' columns are NULL. walbox.await_delivery returns them
-- all:
--
--   SELECT broker, amqp_routing_key, sqs_message_id
--     FROM walbox.await_delivery('a1b2…', '5 seconds');
--
-- Receipts written before this migration are Kafka's (broker = 'kafka').

ALTER TABLE walbox.receipts
    ALTER COLUMN kafka_partition DROP NOT NULL,
    ALTER COLUMN kafka_offset DROP NOT NULL,
    ADD COLUMN IF NOT EXISTS broker text NOT NULL DEFAULT 'kafka',
    ADD COLUMN IF NOT EXISTS amqp_exchange text,
    ADD COLUMN IF NOT EXISTS amqp_routing_key text,
    ADD COLUMN IF NOT EXISTS sqs_message_id text,
    ADD COLUMN IF NOT EXISTS sqs_sequence_number text,
    ADD COLUMN IF NOT EXISTS nats_stream text,
    ADD COLUMN IF NOT EXISTS nats_sequence bigint,
    ADD COLUMN IF NOT EXISTS http_status integer;

DO $$
DECLARE
    a record;
BEGIN
    FOR a IN SELECT * FROM (VALUES ('broker', 'text'), ('amqp_exchange', 'text'),
                                   ('amqp_routing_key', 'text'), ('sqs_message_id', 'text'),
                                   ('sqs_sequence_number', 'text'), ('nats_stream', 'text'),
                                   ('nats_sequence', 'bigint'), ('http_status', 'integer')) v(name, type)
    LOOP
        IF NOT EXISTS (SELECT 1 FROM pg_attribute
                        WHERE attrelid = (SELECT typrelid FROM pg_type WHERE oid = 'walbox.receipt'::regtype)
                          AND attname = a.name AND NOT attisdropped) THEN
            EXECUTE format('ALTER TYPE walbox.receipt ADD ATTRIBUTE %I %s', a.name, a.type);
        END IF;
    END LOOP;
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
        SELECT r.event_id, r.topic, r.kafka_partition, r.kafka_offset, r.acked_at, r.dead_lettered,
               r.broker, r.amqp_exchange, r.amqp_routing_key, r.sqs_message_id, r.sqs_sequence_number,
               r.nats_stream, r.nats_sequence, r.http_status
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
