-- walbox migration 0001: the outbox table.
--
-- Applications insert one row here in the same transaction as their business
-- change. walbox reads the INSERT from the WAL (a pgoutput slot on a
-- publication of this table) and publishes it to Kafka; it never queries this
-- table. Rows may be deleted at any time after commit, even in the same
-- transaction that inserted them: the event is already in the WAL.
--
-- Needs Postgres 13+ (gen_random_uuid() is built in from 13).

CREATE TABLE IF NOT EXISTS public.outbox_events (
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT outbox_events_pkey PRIMARY KEY (id),
    CONSTRAINT outbox_events_headers_is_object CHECK (jsonb_typeof(headers) = 'object')
);

COMMENT ON TABLE public.outbox_events IS
    'Transactional outbox: one row per domain event, inserted in the business transaction; streamed to Kafka by walbox from the WAL.';
COMMENT ON COLUMN public.outbox_events.id IS
    'Event id. Sent as the Kafka header "id"; consumers deduplicate on it (see processed_events).';
COMMENT ON COLUMN public.outbox_events.aggregate_type IS
    'Kind of aggregate the event belongs to (e.g. "order"). Chooses the topic via the template outbox.event.{aggregate_type}.';
COMMENT ON COLUMN public.outbox_events.aggregate_id IS
    'Id of the aggregate instance. The Kafka message key: one aggregate''s events land on one partition, in commit order.';
COMMENT ON COLUMN public.outbox_events.event_type IS
    'What happened (e.g. "OrderCreated"). Sent as the Kafka header "event_type".';
COMMENT ON COLUMN public.outbox_events.payload IS
    'The event body. Sent as the Kafka message value: the JSON text as stored.';
COMMENT ON COLUMN public.outbox_events.headers IS
    'A JSON object; each key becomes one Kafka header (string values as is, other values as JSON text).';
COMMENT ON COLUMN public.outbox_events.created_at IS
    'When the event was written. Sent as the Kafka message timestamp.';

-- For retention jobs (DELETE … WHERE created_at < now() - interval '7 days').
-- walbox itself never reads the table, so this is the only index it needs.
CREATE INDEX IF NOT EXISTS outbox_events_created_at_idx ON public.outbox_events (created_at);
