//! `store.key_prefix`: its default and which prefixes are usable. Nothing here imports the
//! rest of callbackd, so the config checks a prefix at load without depending on the engine.

/// The prefix of every key when `store.key_prefix` is not set: the names of every layout
/// before the prefix was configurable, so the default moves nothing.
pub const DEFAULT_KEY_PREFIX: &str = "cb";

/// Why a `store.key_prefix` is refused, `None` when it is usable. Letters, digits, `_`, `-`
/// and `.` only: `{` and `}` would move the hash tag, `:` would make one prefix the start of
/// another's names, and glob characters would widen the upgrade's SCAN patterns.
pub fn key_prefix_problem(prefix: &str) -> Option<&'static str> {
    if prefix.is_empty() {
        Some("must not be empty")
    } else if prefix.len() > 64 {
        Some("must be at most 64 characters")
    } else if !prefix
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Some("may hold only ASCII letters, digits, '_', '-' and '.'")
    } else {
        None
    }
}
