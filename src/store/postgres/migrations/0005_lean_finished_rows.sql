-- Layout 5: a finished callback in less disk, by the two things it kept that cost more than
-- what they held (BENCHMARKS.md, "PostgreSQL layout 5").
--
-- Processes of layout 4 would show a history without its first row, and could not read a
-- record compressed with a dictionary (store/record.rs: from this layout, new records are), so
-- migrate.rs does not apply this while one of them is connected (docs/storage.md, "Upgrades").

-- A message's first history row in its own row, not in `history`. Most messages have one
-- row, their only delivery; a row of its own cost its tuple header, the message id again and
-- a primary-key entry, more than the entry itself. The first row is never trimmed nor
-- rewritten (the rule keeps it whole, store/history.rs), so it can live with the message it
-- belongs to, and moves with it between partitions as the rest of the row does.
-- store::HistoryEntry as JSON, as `history.entry_json` holds it; NULL until the first row is
-- recorded, and in rows whose first row is in `history`: rows written before keep theirs
-- there (seq 1) and are read as they are, so this changes the catalog only.
ALTER TABLE messages ADD COLUMN first_entry text;

-- Listing by ordering key (a transaction's or a payment's messages, a handful each) by a hash
-- of the key instead of a B-tree of the key and the id: 35 bytes an entry instead of 135
-- (both written in random key order, as finishes come). The listing reads a key's few rows
-- and sorts them by id. Filled to 100%: most of its entries are on finished days, written as
-- a day fills and then only read; the live partition's few churn, and vacuum reuses their
-- space. Building it reads every retained message once, inside the upgrade's transaction.
DROP INDEX messages_by_key;
CREATE INDEX messages_by_key ON messages USING hash (ordering_key) WITH (fillfactor = 100);
