-- The PostgreSQL store's layout, version 1 (migrate.rs applies it, and records the version in
-- callbackd_layout in the same transaction). Modelled on the SQLite layout
-- (src/store/sqlite/schema.sql); what differs is how finished messages go away.
--
-- Times are milliseconds since the epoch, taken from the caller's `now` (leases: from the
-- database's clock). A row whose `expires_at` is past is ignored at once and deleted later, in
-- bounded batches, by the sweep. Keys and ids are compared byte by byte (COLLATE "C"), as the
-- other engines compare them, whatever the database's locale.
--
-- Retention without bloat: a message and its history rows carry `end_day`, 0 while the message
-- has work left, else the day its retention ends. Both tables are partitioned by it: the live
-- partition (0) holds only unfinished messages and churns like a queue, and each finished day
-- is a partition of its own, created when its first message finishes into it and dropped whole
-- once the sweep horizon (sweep_horizon.swept_to) has passed its last millisecond: no DELETE
-- scans or bloats anything. A resend of a finished message moves it (and its history) back to
-- the live partition in its own transaction, so a partition drop, which waits for that
-- transaction's locks, can never take a message that still has work; and a message whose end
-- is at or below the horizon is gone to every read and to resend alike, dropped or not yet.

CREATE TABLE callbackd_layout (
    version    integer PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- One row: the partition count (store.partitions), fixed when the store was first used. The
-- queue itself is one table; the count is kept so that ids are what they would be on any
-- engine.
CREATE TABLE callbackd_partitions (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    count    integer NOT NULL CHECK (count BETWEEN 1 AND 256)
);

-- One row: finished messages whose end is at or before `swept_to` are gone (store::sweep).
-- Only ever raised.
CREATE TABLE sweep_horizon (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    swept_to bigint NOT NULL
);
INSERT INTO sweep_horizon (swept_to) VALUES (-9223372036854775808);

-- Dedupe claims (store::DedupeClaim): the first answer to an event, replayed byte for byte.
CREATE TABLE dedupe_claims (
    key         text COLLATE "C" PRIMARY KEY,
    -- Hash of the claiming request: a repeat with another one is a conflict.
    fingerprint text NOT NULL,
    response    text NOT NULL,
    expires_at  bigint NOT NULL
);
CREATE INDEX dedupe_claims_by_expiry ON dedupe_claims (expires_at);

-- Signature seals (store::SignatureSeal): the first answer to a signature, while it is valid.
CREATE TABLE seals (
    key        text COLLATE "C" PRIMARY KEY,
    response   text NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX seals_by_expiry ON seals (expires_at);

-- Payment status for the compare-and-set of a notification (ARCHITECTURE.md §1.3); it lives
-- store.payment_retention_secs after its last transition, longer than any claim.
CREATE TABLE payments (
    payment_id text COLLATE "C" PRIMARY KEY,
    status     text NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX payments_by_expiry ON payments (expires_at);

-- Resend request ids; `response` holds store::encode_running_operation or
-- store::encode_finished_operation. Expires by the database's clock (the caller gives no
-- `now`).
CREATE TABLE operations (
    key        text COLLATE "C" PRIMARY KEY,
    response   text NOT NULL,
    expires_at bigint NOT NULL
);
CREATE INDEX operations_by_expiry ON operations (expires_at);

-- One row per message: the message as accepted, and where it is in its lifecycle.
CREATE TABLE messages (
    id                      text COLLATE "C" NOT NULL,
    -- 0 while the message has work left (pending, in flight); else the day its retention
    -- ends, ends_at / 86400000 + 1, which names its partition (messages_d<end_day>).
    end_day                 integer NOT NULL,
    -- The immutable store::NewMessage, as JSON.
    message_json            text NOT NULL,
    source                  text COLLATE "C",
    ordering_key            text COLLATE "C" NOT NULL,
    -- store::MessageState::as_str.
    state                   text NOT NULL,
    -- Delivery attempts recorded so far.
    delivery_attempts       integer NOT NULL DEFAULT 0,
    -- delivery_attempts when a resend last requeued the finished message: the backoff counts
    -- from there (Lease::backoff_step = delivery_attempts - this).
    attempts_before_requeue integer NOT NULL DEFAULT 0,
    -- Token of the latest lease; 0 before the first. complete and release must present it.
    lease_token             bigint NOT NULL DEFAULT 0,
    -- No attempt is scheduled after this instant.
    deadline                bigint NOT NULL,
    -- When a resend brought a scheduled retry forward, the time it was scheduled for: the
    -- automatic schedule resumes there after the expedited attempt.
    resume_at               bigint,
    -- A resend arrived while an attempt was in flight: deliver once more after it.
    deliver_again           boolean NOT NULL DEFAULT false,
    -- Set only on the head of its ordering queue: when its next attempt is due.
    due_at                  bigint,
    -- Set while leased: when the lease runs out (the database's clock).
    lease_until             bigint,
    -- Set once finished (or recorded): when the message and its history end.
    ends_at                 bigint,
    -- History rows ever recorded, kept or dropped.
    history_total           bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (id, end_day),
    CHECK ((end_day = 0) = (ends_at IS NULL))
) PARTITION BY LIST (end_day);
CREATE TABLE messages_live PARTITION OF messages FOR VALUES IN (0);
-- Listing: every partition, merged in id order.
CREATE INDEX messages_by_state ON messages (state, id);
CREATE INDEX messages_by_source ON messages (source, id) WHERE source IS NOT NULL;
CREATE INDEX messages_by_key ON messages (ordering_key, id);
-- Claiming: only the live partition has due heads and leases.
CREATE INDEX messages_due ON messages_live (due_at, id) WHERE due_at IS NOT NULL;
CREATE INDEX messages_leased ON messages_live (lease_until) WHERE lease_until IS NOT NULL;

-- History rows (store::HistoryEntry as JSON) in order: the first and the latest HISTORY_TAIL.
-- They live in the partition of their message, and move with it.
CREATE TABLE history (
    message_id text COLLATE "C" NOT NULL,
    end_day    integer NOT NULL,
    -- The row's number in its message's history (history_total when it was written).
    seq        bigint NOT NULL,
    entry_json text NOT NULL,
    PRIMARY KEY (message_id, end_day, seq)
) PARTITION BY LIST (end_day);
CREATE TABLE history_live PARTITION OF history FOR VALUES IN (0);

-- Unfinished messages of each ordering key, in acceptance order; only the head is due.
CREATE TABLE queue (
    position     bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ordering_key text COLLATE "C" NOT NULL,
    id           text COLLATE "C" NOT NULL UNIQUE
);
CREATE INDEX queue_by_key ON queue (ordering_key, position);

-- The tables every accept and delivery writes and deletes from stay small only if vacuum
-- keeps up with them: vacuum them at 2% dead rows, not the default 20%.
ALTER TABLE messages_live SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE history_live SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE queue SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE dedupe_claims SET (autovacuum_vacuum_scale_factor = 0.02);
ALTER TABLE seals SET (autovacuum_vacuum_scale_factor = 0.02);
