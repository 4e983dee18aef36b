-- Layout 3: provider-side recoveries (store/recoveries.rs). Only adds tables, so processes of
-- layout 2 run on beside it (they count no inbound accepts, so a recovery's figures miss what
-- they accept until every process runs layout 3).
--
-- Inbound accepts per source, minute and slot (the accepted message's partition), counted by
-- each group commit of accepts in one sorted upsert (accept_set.rs): `new` when recorded,
-- `replays` when the dedupe key was already claimed. One row per slot, as delivery_counts,
-- so concurrent batches of other partitions do not queue on one row lock. A read sums the
-- slots. The sweep deletes a minute's rows once its lifetime
-- (recoveries::INBOUND_COUNT_LIFETIME_MS, two days) is over.
CREATE TABLE inbound_counts (
    source  text NOT NULL,
    -- Start of the minute, ms.
    minute  bigint NOT NULL,
    slot    smallint NOT NULL,
    new     bigint NOT NULL DEFAULT 0,
    replays bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (source, minute, slot)
);
CREATE INDEX inbound_counts_by_minute ON inbound_counts (minute);
ALTER TABLE inbound_counts SET (autovacuum_vacuum_scale_factor = 0.02);

-- Recoveries (store::Recovery as JSON): the newest 100 at most, each kept 30 days after it
-- started (recoveries::RECOVERY_LIFETIME_MS).
CREATE TABLE recoveries (
    -- rec_...: sorts by start.
    id            text PRIMARY KEY,
    started_at    bigint NOT NULL,
    recovery_json text NOT NULL
);
CREATE INDEX recoveries_by_start ON recoveries (started_at);
