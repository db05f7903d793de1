-- walbox migration 0003: walbox.emit(), events without an outbox table.
--
-- With source = "messages" (or "both"), an event is a transactional logical
-- decoding message instead of an outbox row: it is written to the WAL with
-- the transaction, and only if the transaction commits; no row, no index
-- entry, no dead tuple, nothing to clean up. Call it in the transaction of
-- the business change:
--
--   BEGIN;
--   UPDATE orders SET status = 'PAID' WHERE id = 42;
--   SELECT walbox.emit('order', '42', 'OrderPaid', '{"id": 42, "status": "PAID"}');
--   COMMIT;
--
-- It returns the event id (the Kafka header "id"). Arguments:
--   aggregate_type  the topic, through mapping.topic_template
--   aggregate_id    the message key (not empty)
--   event_type      the header "event_type" (NULL for none)
--   payload         the message value (NULL for none)
--   headers         a JSON object: one Kafka header per key; "traceparent" and
--                   "tracestate" carry W3C trace context to the consumer
--   prefix          walbox's message_prefix setting (default 'walbox')
--
-- The message is the envelope docs/configuration.md describes, version 1;
-- any language can write it with pg_logical_emit_message(true, prefix, envelope).
-- Streaming messages needs Postgres 14 or later; the function itself works on 13.

DO $$ BEGIN
  IF to_regnamespace('walbox') IS NULL THEN
    CREATE SCHEMA walbox;
    GRANT USAGE ON SCHEMA walbox TO PUBLIC;
  END IF;
END $$;

CREATE OR REPLACE FUNCTION walbox.emit(
    aggregate_type text,
    aggregate_id   text,
    event_type     text,
    payload        jsonb,
    headers        jsonb DEFAULT '{}',
    prefix         text  DEFAULT 'walbox'
) RETURNS uuid
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    event_id uuid := gen_random_uuid();
BEGIN
    IF aggregate_type IS NULL OR aggregate_type = '' THEN
        RAISE EXCEPTION 'walbox.emit: aggregate_type must not be empty';
    END IF;
    IF aggregate_id IS NULL OR aggregate_id = '' THEN
        RAISE EXCEPTION 'walbox.emit: aggregate_id must not be empty (it is the message key)';
    END IF;
    IF headers IS NOT NULL AND jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'walbox.emit: headers must be a JSON object, not %', jsonb_typeof(headers);
    END IF;
    PERFORM pg_logical_emit_message(true, prefix, jsonb_build_object(
        'v', 1,
        'id', event_id,
        'aggregate_type', aggregate_type,
        'aggregate_id', aggregate_id,
        'event_type', event_type,
        'payload', payload,
        'headers', coalesce(headers, '{}'::jsonb),
        'created_at', now()
    )::text);
    RETURN event_id;
END
$$;

COMMENT ON FUNCTION walbox.emit(text, text, text, jsonb, jsonb, text) IS
    'Writes an outbox event as a transactional logical decoding message (walbox source = messages); returns its id.';
