-- Example: a day-partitioned outbox. Not applied by `walbox migrate`; copy and
-- adapt it when the outbox is busy enough that DELETE-based retention hurts.
--
-- Why: dropping yesterday's partition is instant and leaves no dead tuples,
-- where `DELETE … WHERE created_at < …` bloats the table and needs VACUUM.
--
-- What walbox needs: the publication must publish changes as the partitioned
-- root table, so every event carries the root's name and new partitions are
-- covered without touching the publication:
--
--   CREATE PUBLICATION walbox_outbox FOR TABLE public.outbox_events_by_day
--       WITH (publish = 'insert', publish_via_partition_root = true);
--
-- (`walbox init-slot` creates it with these options.) Point walbox at the root
-- table: --table public.outbox_events_by_day.

CREATE TABLE IF NOT EXISTS public.outbox_events_by_day (
    id             uuid        NOT NULL DEFAULT gen_random_uuid(),
    aggregate_type text        NOT NULL,
    aggregate_id   text        NOT NULL,
    event_type     text        NOT NULL,
    payload        jsonb       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at     timestamptz NOT NULL DEFAULT now(),
    -- A primary key on a partitioned table must include the partition key.
    CONSTRAINT outbox_events_by_day_pkey PRIMARY KEY (id, created_at),
    CONSTRAINT outbox_events_by_day_headers_is_object CHECK (jsonb_typeof(headers) = 'object')
) PARTITION BY RANGE (created_at);

COMMENT ON TABLE public.outbox_events_by_day IS
    'Day-partitioned transactional outbox; publish with publish_via_partition_root = true.';

-- Catches rows whose day has no partition yet, so an insert never fails
-- because the partition job is late. Keep it empty in normal operation.
CREATE TABLE IF NOT EXISTS public.outbox_events_by_day_default
    PARTITION OF public.outbox_events_by_day DEFAULT;

-- Creates the partitions for today and the next `days_ahead` days (UTC);
-- run it daily (pg_cron or any scheduler).
CREATE OR REPLACE FUNCTION public.outbox_events_by_day_create_partitions(days_ahead integer DEFAULT 3)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    day date;
BEGIN
    FOR i IN 0..days_ahead LOOP
        day := (now() AT TIME ZONE 'UTC')::date + i;
        EXECUTE format(
            'CREATE TABLE IF NOT EXISTS public.%I PARTITION OF public.outbox_events_by_day
                 FOR VALUES FROM (%L) TO (%L)',
            'outbox_events_by_day_' || to_char(day, 'YYYYMMDD'),
            (day::timestamp AT TIME ZONE 'UTC'),
            ((day + 1)::timestamp AT TIME ZONE 'UTC'));
    END LOOP;
END $$;

-- Drops the partitions that hold only days before `keep_days` ago (UTC).
-- Safe for walbox: events are read from the WAL, not from the table.
CREATE OR REPLACE FUNCTION public.outbox_events_by_day_drop_partitions(keep_days integer DEFAULT 7)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    part record;
    cutoff text := 'outbox_events_by_day_' || to_char((now() AT TIME ZONE 'UTC')::date - keep_days, 'YYYYMMDD');
BEGIN
    FOR part IN
        SELECT c.relname FROM pg_inherits i
          JOIN pg_class c ON c.oid = i.inhrelid
         WHERE i.inhparent = 'public.outbox_events_by_day'::regclass
           AND c.relname ~ '^outbox_events_by_day_[0-9]{8}$'
           AND c.relname < cutoff
    LOOP
        EXECUTE format('DROP TABLE public.%I', part.relname);
    END LOOP;
END $$;

SELECT public.outbox_events_by_day_create_partitions(3);
