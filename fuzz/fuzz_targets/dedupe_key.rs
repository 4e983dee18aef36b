//! Dedupe key derivation must never panic on any JSON a provider sends, must be deterministic,
//! and must give different keys to callbacks whose key fields differ. The property lives in
//! `checks/`, which `cargo test` also runs over the kept corpus.
#![no_main]

#[path = "../checks/dedupe_key.rs"]
mod check;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| check::check(data));
