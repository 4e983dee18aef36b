//! Short, fixed-size digests for storage keys.

use base64::Engine;
use sha2::{Digest, Sha256};

/// 128 bits of SHA-256 in URL-safe base64 (22 characters): long enough that collisions
/// between distinct dedupe tuples are out of reach, short enough to keep per-key memory low.
pub fn short_hash(input: &[u8]) -> String {
    let digest = Sha256::digest(input);
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(&digest[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_hash_is_fixed_size_and_distinguishes() {
        let a = short_hash(b"a");
        assert_eq!(a.len(), 22);
        assert_ne!(a, short_hash(b"b"));
        assert_eq!(a, short_hash(b"a"));
    }
}
