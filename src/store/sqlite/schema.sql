-- The SQLite store's layout, version 5: what a new database is created with. Older databases
-- are brought here by the upgrades in migrate.rs; the upgraded schema must equal this one
-- (tests/store_contract.rs checks it on the fixtures of versions 1 and 2).
-- Beside it, every database gets the one-row `partitions` table, the partition count recorded
-- at first use (migrate.rs, settle_partitions): an addition that needs no new version.
--
-- Times are milliseconds since the epoch, taken from the caller's `now`. A row whose
-- `expires_at` is past is ignored at once and deleted later, in bounded batches, by the sweep.

-- Dedupe claims (store::DedupeClaim): the first answer to an event, replayed byte for byte.
CREATE TABLE dedupe_claims (
    key         TEXT PRIMARY KEY NOT NULL,
    -- Hash of the claiming request: a repeat with another one is a conflict.
    fingerprint TEXT NOT NULL,
    response    TEXT NOT NULL,
    expires_at  INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX dedupe_claims_by_expiry ON dedupe_claims (expires_at);

-- Payment status for the compare-and-set of a notification (ARCHITECTURE.md §1.3).
CREATE TABLE payments (
    payment_id TEXT PRIMARY KEY NOT NULL,
    status     TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX payments_by_expiry ON payments (expires_at);

-- One row per message: the message as accepted, and where it is in its lifecycle.
CREATE TABLE messages (
    id                      TEXT PRIMARY KEY NOT NULL,
    -- The immutable store::NewMessage, as JSON.
    message_json            TEXT NOT NULL,
    source                  TEXT,
    ordering_key            TEXT NOT NULL,
    -- store::MessageState::as_str.
    state                   TEXT NOT NULL,
    -- Delivery attempts recorded so far.
    delivery_attempts       INTEGER NOT NULL DEFAULT 0,
    -- delivery_attempts when a resend last requeued the finished message: the backoff
    -- counts from there (Lease::backoff_step = delivery_attempts - this).
    attempts_before_requeue INTEGER NOT NULL DEFAULT 0,
    -- Token of the latest lease; 0 before the first. complete and release must present it.
    lease_token             INTEGER NOT NULL DEFAULT 0,
    -- No attempt is scheduled after this instant.
    deadline                INTEGER NOT NULL,
    -- When a resend brought a scheduled retry forward, the time it was scheduled for: the
    -- automatic schedule resumes there after the expedited attempt. 0 when none.
    resume_at               INTEGER NOT NULL DEFAULT 0,
    -- 1 when a resend arrived while an attempt was in flight: deliver once more after it.
    deliver_again           INTEGER NOT NULL DEFAULT 0,
    -- Set only on the head of its ordering queue: when its next attempt is due.
    due_at                  INTEGER,
    -- Set while leased: when the lease runs out and the message may be claimed again.
    lease_until             INTEGER,
    -- Set once finished (or recorded): when the message and its history are deleted.
    expires_at              INTEGER,
    -- History rows ever recorded, kept or dropped.
    history_total           INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX messages_due ON messages (due_at, id) WHERE due_at IS NOT NULL;
CREATE INDEX messages_leased ON messages (lease_until) WHERE lease_until IS NOT NULL;
CREATE INDEX messages_expiry ON messages (expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX messages_by_state ON messages (state, id);
CREATE INDEX messages_by_source ON messages (source, id) WHERE source IS NOT NULL;
CREATE INDEX messages_by_key ON messages (ordering_key, id);

-- Unfinished messages of each ordering key, in acceptance order; only the head is due.
CREATE TABLE queue (
    position     INTEGER PRIMARY KEY,
    ordering_key TEXT NOT NULL,
    id           TEXT NOT NULL UNIQUE
);
CREATE INDEX queue_by_key ON queue (ordering_key, position);

-- History rows (store::Attempt as JSON) in order: the first and the latest HISTORY_TAIL.
CREATE TABLE attempts (
    seq          INTEGER PRIMARY KEY,
    message_id   TEXT NOT NULL,
    attempt_json TEXT NOT NULL
);
CREATE INDEX attempts_by_message ON attempts (message_id, seq);

-- Resend request ids; `response` holds store::encode_running_operation or
-- store::encode_finished_operation. Expires on the wall clock (the caller gives no `now`).
CREATE TABLE operations (
    key        TEXT PRIMARY KEY NOT NULL,
    response   TEXT,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX operations_by_expiry ON operations (expires_at);

-- Signature seals (store::SignatureSeal): the first answer to a signature, while it is valid.
CREATE TABLE seals (
    key        TEXT PRIMARY KEY NOT NULL,
    response   TEXT NOT NULL,
    expires_at INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX seals_by_expiry ON seals (expires_at);

-- Attempts per minute (store::counts), counted by each completion in its transaction: the
-- console's chart. A minute's row is deleted by the sweep once its lifetime
-- (counts::COUNT_LIFETIME_MS, two hours) is over.
CREATE TABLE delivery_counts (
    -- Start of the minute, ms.
    minute     INTEGER PRIMARY KEY NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 0,
    failures   INTEGER NOT NULL DEFAULT 0,
    dead       INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;

-- Inbound accepts per source and minute (store::recoveries), counted by each accept of a
-- provider callback in its transaction: `new` when it was recorded, `replays` when its
-- dedupe key was already claimed. What a recovery reports. A minute's row is deleted by the
-- sweep once its lifetime (recoveries::INBOUND_COUNT_LIFETIME_MS, two days) is over.
CREATE TABLE inbound_counts (
    source  TEXT NOT NULL,
    -- Start of the minute, ms.
    minute  INTEGER NOT NULL,
    new     INTEGER NOT NULL DEFAULT 0,
    replays INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (source, minute)
) WITHOUT ROWID;
CREATE INDEX inbound_counts_by_minute ON inbound_counts (minute);

-- Provider-side recoveries (store::Recovery, as JSON): the newest 100 at most, each kept 30
-- days after it started (recoveries::RECOVERY_LIFETIME_MS).
CREATE TABLE recoveries (
    -- rec_...: sorts by start.
    id            TEXT PRIMARY KEY NOT NULL,
    started_at    INTEGER NOT NULL,
    recovery_json TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX recoveries_by_start ON recoveries (started_at);
