//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) through the same checks the cargo-fuzz
//! targets run (`fuzz/checks/`), on the stable toolchain: every input the fuzzer kept stays a
//! regression test, in CI, without nightly or libFuzzer.

#[path = "../fuzz/checks/dedupe_key.rs"]
mod dedupe_key;
#[path = "../fuzz/checks/signature_header.rs"]
mod signature_header;

use std::path::PathBuf;

/// Runs `check` on every input of the target's corpus and returns how many there were;
/// fails naming every input that panicked.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    inputs.sort();
    let failed: Vec<String> = inputs
        .iter()
        .filter(|path| {
            let data = std::fs::read(path).unwrap();
            std::panic::catch_unwind(|| check(&data)).is_err()
        })
        .map(|path| path.display().to_string())
        .collect();
    assert!(
        failed.is_empty(),
        "{target}: inputs failing the check: {failed:#?}"
    );
    inputs.len()
}

#[test]
fn dedupe_key_corpus_passes_the_fuzz_check() {
    let n = replay("dedupe_key", dedupe_key::check);
    assert!(
        n >= 1_760,
        "RELIABILITY.md counts 1,760 kept inputs, found {n}"
    );
}

#[test]
fn signature_header_corpus_passes_the_fuzz_check() {
    let n = replay("signature_header", signature_header::check);
    assert!(
        n >= 1_178,
        "RELIABILITY.md counts 1,178 kept inputs, found {n}"
    );
}
