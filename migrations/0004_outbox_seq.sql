-- walbox migration 0004: an insertion-order column on the outbox table.
--
-- The stream gives one aggregate's events in commit order, and one
-- transaction's events in the order they were inserted. Events walbox
-- publishes from the table instead of the WAL (init-slot --backfill, a
-- recreated slot, walbox resync) can follow that order only if the table
-- records it: created_at is one value per transaction (now()), and the event
-- id is random. walbox orders such rows by this column (or by commit
-- timestamps, with track_commit_timestamp = on): docs/operations.md,
-- "Order of events published from the table".
--
-- On an existing table with rows, adding the column rewrites the table under
-- an ACCESS EXCLUSIVE lock (each row gets a value, in no particular order):
-- apply it when the outbox is small (after retention), or in a maintenance
-- window. Applications need not set it.

-- bigserial (a sequence default), not an identity column: Postgres cannot add
-- an identity column to a partitioned table that has partitions.
ALTER TABLE public.outbox_events
    ADD COLUMN IF NOT EXISTS seq bigserial;

COMMENT ON COLUMN public.outbox_events.seq IS
    'Insertion order (a sequence). walbox publishes rows read from the table (backfill, a recreated slot, resync) in this order, so one transaction''s events of an aggregate keep the order the stream gives them.';
