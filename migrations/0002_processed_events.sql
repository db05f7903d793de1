-- walbox migration 0002: the consumer-side deduplication table.
--
-- walbox delivers at least once: after a crash or a reconnect, events that were
-- in flight may be published again (each carries its event id in the Kafka
-- header "id"). A consumer that must act once per event records each id it has
-- handled, in the same transaction as its own side effects:
--
--   BEGIN;
--   INSERT INTO processed_events (consumer_name, event_id)
--        VALUES ('billing', $id) ON CONFLICT DO NOTHING;
--   -- 0 rows inserted: a duplicate, skip it (COMMIT and move on).
--   -- 1 row inserted: apply the event's effects, then COMMIT.
--   COMMIT;
--
-- The table belongs in the consumer's database; it is created here too so the
-- example is runnable, and so a consumer living in the same database can use it.

CREATE TABLE IF NOT EXISTS public.processed_events (
    consumer_name text        NOT NULL,
    event_id      uuid        NOT NULL,
    processed_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT processed_events_pkey PRIMARY KEY (consumer_name, event_id)
);

COMMENT ON TABLE public.processed_events IS
    'Consumer-side deduplication of outbox events: one row per (consumer, event id) already handled.';
COMMENT ON COLUMN public.processed_events.consumer_name IS
    'Which consumer handled the event; several consumers share the table.';
COMMENT ON COLUMN public.processed_events.event_id IS
    'The event id from the Kafka header "id" (outbox_events.id).';
COMMENT ON COLUMN public.processed_events.processed_at IS
    'When the consumer handled it. Rows older than the longest possible redelivery window can be deleted.';

CREATE INDEX IF NOT EXISTS processed_events_processed_at_idx ON public.processed_events (processed_at);
