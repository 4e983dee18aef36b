-- Layout 4: a message's record compressed, and finished days without the indexes only the
-- live partition needs. About a fifth less disk per finished callback, and a finish that
-- writes two index entries fewer (BENCHMARKS.md, "PostgreSQL layout 4").
--
-- It changes what a row may hold, so processes of layout 3 must not run beside it: they
-- would read a NULL `message_json`. migrate.rs refuses to apply it while another callbackd
-- of an older layout is connected (docs/storage.md, "Upgrades").

-- The record (store/record.rs): zstd-compressed JSON, or the JSON itself when that is no
-- larger. New rows fill `record` and leave `message_json` NULL; rows of layout 3 keep their
-- `message_json` and are read as they are, so nothing is rewritten. Both statements only
-- change the catalog.
ALTER TABLE messages ALTER COLUMN message_json DROP NOT NULL;
ALTER TABLE messages ADD COLUMN record bytea;

-- Listing by state walks the primary key of the finished days (reads.rs): delivered and
-- recorded are what finished days are made of, so an index of them would be as large as the
-- key and read no fewer rows. Dead messages are few, and both the listing of dead letters and
-- the queue depth count them, so they keep an entry; so do pending and in-flight messages,
-- which only the live partition holds. Building it reads every retained message once.
DROP INDEX messages_by_state;
CREATE INDEX messages_by_state ON messages (state, id)
    WHERE state IN ('pending', 'in_flight', 'dead');

-- Listing by source: an index of the live partition only. On finished days a source is one of
-- the few a deployment has, so the walk of the primary key finds a page of it after a few
-- pages' worth of rows; a rare source reads more, in a listing, never on the accept's or the
-- delivery's path.
DROP INDEX messages_by_source;
CREATE INDEX messages_live_by_source ON messages_live (source, id) WHERE source IS NOT NULL;
