-- Layout 5: a message's first history row kept in its own row, not in `history`. Most
-- messages have one row, their only delivery; a row of its own in `history` cost its tuple
-- header, the message id again, and a primary-key entry, more than the entry itself
-- (BENCHMARKS.md, "PostgreSQL layout 5"). The first row is never trimmed nor rewritten (the
-- rule keeps it whole, store/history.rs), so it can live with the message it belongs to, and
-- moves with it between partitions as the rest of the row does.
--
-- Rows written before keep their first row in `history` (seq 1) and are read as they are:
-- the upgrade rewrites nothing, and only changes the catalog. Processes of layout 4 would
-- show a history without its first row, so migrate.rs does not apply this while one of them
-- is connected (docs/storage.md, "Upgrades").

-- store::HistoryEntry as JSON, as `history.entry_json` holds it; NULL until the first row is
-- recorded, and in rows whose first row is in `history`.
ALTER TABLE messages ADD COLUMN first_entry text;
