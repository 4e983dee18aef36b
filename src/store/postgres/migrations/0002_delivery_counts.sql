-- Layout 2: attempts per minute (store/counts.rs), counted by each completion in its
-- transaction, for the console's chart of the whole deployment. Only adds a table, so
-- processes of layout 1 run on beside it (they count nothing here).
--
-- One row per minute and slot (the completed message's partition): concurrent completions
-- of other partitions do not wait for each other's row lock, which a row per minute alone
-- would make every completion of the deployment take in turn until its commit. A read sums
-- the slots. The sweep deletes a minute's rows once its lifetime
-- (counts::COUNT_LIFETIME_MS, two hours) is over: at most 120 minutes x the partition count.
CREATE TABLE delivery_counts (
    -- Start of the minute, ms.
    minute     bigint NOT NULL,
    slot       smallint NOT NULL,
    deliveries bigint NOT NULL DEFAULT 0,
    failures   bigint NOT NULL DEFAULT 0,
    dead       bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (minute, slot)
);
-- Every completion updates a row: vacuum at 2% dead rows, as the other hot tables.
ALTER TABLE delivery_counts SET (autovacuum_vacuum_scale_factor = 0.02);
